"""Results you can trust: a clean tail, one writer, no silent mixing of setups, one-line errors
checked before model work, limits stated up front, and a thread default that survives a busy CPU."""

import errno
import json
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
from click.testing import CliRunner

from kvrescue_local.bench import results_file
from kvrescue_local.bench.results_file import model_fingerprint, read_rows
from kvrescue_local.cli import main
from kvrescue_local.gguf_export import TINY_BASE, write_tiny_model
from kvrescue_local.runtime import context


def sweep_args(base, helper, prm, results, *extra):
    return ["bench", "run", "--dataset", "gsm8k", "--limit", "3", "--modes", "full,kvrescue", "--ns", "2",
            "--budgets", "32", "--buffer", "16", "--max-tokens", "40", "--max-step-tokens", "16", "--tau-entropy", "50",
            "--base", str(base), "--helper", str(helper), "--prm", str(prm), "--results", str(results), *extra]


def one_error_line(result) -> str:
    """The command failed with exactly one `Error: ...` line and no traceback."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    return lines[-1]


@pytest.fixture(scope="module")
def sweep(base_path, helper_path, tiny_prm_path, tmp_path_factory):
    """A finished 6-row sweep (3 problems x full and kvrescue) on the tiny models; tests copy it."""
    results = tmp_path_factory.mktemp("sweep") / "results.jsonl"
    done = CliRunner().invoke(main, sweep_args(base_path, helper_path, tiny_prm_path, results))
    assert done.exit_code == 0, done.output
    return results


def copy_of(sweep, tmp_path, name="results.jsonl"):
    out = tmp_path / name
    out.write_bytes(sweep.read_bytes())
    return out


# --- 1. a truncated last line ----------------------------------------------------------------------

def test_a_partial_last_line_is_cut_off_before_resuming(sweep, base_path, helper_path, tiny_prm_path, tmp_path):
    lines = sweep.read_text().splitlines(keepends=True)
    assert len(lines) == 6
    results = tmp_path / "cut.jsonl"
    results.write_text("".join(lines[:4]) + lines[4][:150])  # a crash or a full disk mid-write
    args = sweep_args(base_path, helper_path, tiny_prm_path, results, "--resume")
    resumed = CliRunner().invoke(main, args)
    assert resumed.exit_code == 0, resumed.output
    assert "cut a partial last line (150 bytes" in resumed.output and "2 new results" in resumed.output
    text = results.read_text()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())
    assert len(read_rows(results)) == 6
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and "0 new results" in again.output, again.output


def test_a_whole_row_that_lost_only_its_newline_is_kept(sweep, tmp_path):
    results = tmp_path / "no-newline.jsonl"
    results.write_text(sweep.read_text().rstrip("\n"))
    assert results_file.repair_tail(results) == 0
    assert results.read_text() == sweep.read_text()


# --- 2. one writer at a time -----------------------------------------------------------------------

@contextmanager
def held_by_another_process(results):
    """A child process holding the one-writer lock of results; yields it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from kvrescue_local.bench.results_file import writing\n"
         "with writing(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(120)", str(results)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_second_writer_is_refused_naming_the_pid(base_path, helper_path, tiny_prm_path, tmp_path):
    results = tmp_path / "shared.jsonl"
    with held_by_another_process(results) as holder:
        refused = CliRunner().invoke(main, sweep_args(base_path, helper_path, tiny_prm_path, results))
        assert f"being written by another process (PID {holder.pid})" in one_error_line(refused)
    assert not results.exists() or read_rows(results) == []


def test_a_symlinked_results_file_is_refused_while_its_target_is_written(sweep, base_path, helper_path,
                                                                          tiny_prm_path, tmp_path):
    two = copy_of(sweep, tmp_path, "two.jsonl")
    link = tmp_path / "two-link.jsonl"
    link.symlink_to(two)
    with held_by_another_process(two) as holder:
        refused = CliRunner().invoke(main, sweep_args(base_path, helper_path, tiny_prm_path, link, "--resume"))
        assert f"being written by another process (PID {holder.pid})" in one_error_line(refused)
    assert two.read_bytes() == sweep.read_bytes()


# --- 3. rows say what produced them; mixing is refused -------------------------------------------

def test_rows_record_model_fingerprints_prompt_and_settings(sweep, base_path, helper_path, tiny_prm_path):
    rows = read_rows(sweep)
    full = next(r for r in rows if r["config"]["mode"] == "full")
    kvrescue = next(r for r in rows if r["config"]["mode"] == "kvrescue")
    assert set(full["setup"]["models"]) == {"base", "prm"}  # full mode uses no helper
    assert set(kvrescue["setup"]["models"]) == {"base", "helper", "prm"}
    assert kvrescue["setup"]["models"]["base"] == model_fingerprint(base_path)
    assert kvrescue["setup"]["models"]["prm"]["head_sha256"]
    assert model_fingerprint(base_path) != model_fingerprint(helper_path)
    settings = kvrescue["setup"]["settings"]
    assert {"temperature", "top_p", "seed", "tau_entropy", "tau_compression", "buffer", "max_tokens"} <= set(settings)
    assert len(kvrescue["setup"]["prompt_sha256"]) == 16


def test_resume_with_another_model_is_refused_naming_it(sweep, helper_path, tiny_prm_path, tmp_path):
    other = write_tiny_model(tmp_path / "other-base.gguf", TINY_BASE, seed=7)
    results = copy_of(sweep, tmp_path)
    refused = CliRunner().invoke(main, sweep_args(other, helper_path, tiny_prm_path, results, "--resume"))
    message = one_error_line(refused)
    assert "base model base.gguf" in message and "vs other-base.gguf" in message
    assert read_rows(results) == read_rows(sweep), "nothing appended"


def with_setting(rows, name, value):
    return [{**r, "setup": {**r["setup"], "settings": {**r["setup"]["settings"], name: value}}} for r in rows]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_merge_refuses_rows_of_another_setup(sweep, tmp_path):
    hotter = write_rows(tmp_path / "hot.jsonl", with_setting(read_rows(sweep), "temperature", 1.5))
    refused = CliRunner().invoke(main, ["bench", "merge", str(sweep), str(hotter), "--out", str(tmp_path / "m.jsonl")])
    assert "temperature 0.7 vs 1.5" in one_error_line(refused)
    assert not (tmp_path / "m.jsonl").exists()


def test_report_keeps_setups_apart_unless_pooled(sweep, tmp_path):
    rows = read_rows(sweep)
    mixed = write_rows(tmp_path / "mixed.jsonl", rows + with_setting(rows, "temperature", 1.5))
    apart = CliRunner().invoke(main, ["report", str(mixed)])
    assert apart.exit_code == 0, apart.output
    table2 = apart.output.split("Table 1")[0]
    # the setups are ordered by their fingerprints, so the note may name either first
    assert " setup " in table2 and ("temperature 0.7 vs 1.5" in table2 or "temperature 1.5 vs 0.7" in table2)
    assert [line.split()[0] for line in table2.splitlines() if line.split()[:1] in (["full"], ["kvrescue"])] == \
        ["full", "full", "kvrescue", "kvrescue"]
    pooled = CliRunner().invoke(main, ["report", str(mixed), "--pool-setups"])
    assert pooled.exit_code == 0, pooled.output
    assert " setup " not in pooled.output and "temperature" not in pooled.output
    one_setup = CliRunner().invoke(main, ["report", str(sweep)])
    assert " setup " not in one_setup.output


def test_old_results_without_setups_are_reported_but_not_resumed(sweep, base_path, helper_path, tiny_prm_path,
                                                                  tmp_path):
    old = write_rows(tmp_path / "old.jsonl", [{k: v for k, v in r.items() if k != "setup"} for r in read_rows(sweep)])
    assert CliRunner().invoke(main, ["report", str(old)]).exit_code == 0
    refused = CliRunner().invoke(main, sweep_args(base_path, helper_path, tiny_prm_path, old, "--resume"))
    assert "before model fingerprints were recorded" in one_error_line(refused)


# --- 4. one `Error:` line, before any model work where it can be ---------------------------------

MISSING_MODEL = ["--base", "/nonexistent/base.gguf", "--helper", "/nonexistent/helper.gguf",
                 "--prm", "/nonexistent/prm.gguf"]


def test_an_unwritable_json_path_fails_before_solving():
    result = CliRunner().invoke(main, ["solve", "What is 2+3?", "--json", "/proc/x", *MISSING_MODEL])
    assert "cannot write --json /proc/x" in one_error_line(result)


def test_a_full_disk_is_one_line(sweep, tmp_path, monkeypatch):
    def no_space(*_):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "m.jsonl"))

    monkeypatch.setattr("kvrescue_local.bench.run.os.replace", no_space)
    result = CliRunner().invoke(main, ["bench", "merge", str(sweep), "--out", str(tmp_path / "m.jsonl")])
    assert "the disk is full" in one_error_line(result) and "m.jsonl" in one_error_line(result)


def test_problems_that_are_not_utf8_are_refused(tmp_path):
    latin1 = tmp_path / "problem.txt"
    latin1.write_bytes("What is 2+3 in the café?".encode("latin-1"))
    from_file = CliRunner().invoke(main, ["solve", "--file", str(latin1), *MISSING_MODEL])
    assert "not UTF-8 text (byte 0xe9 at offset 22)" in one_error_line(from_file)
    argument = CliRunner().invoke(main, ["solve", "What is 2+3 in the caf\udce9?", *MISSING_MODEL])
    assert "not UTF-8" in one_error_line(argument)


def test_a_json_line_that_is_not_a_result_is_refused(base_path, helper_path, tiny_prm_path, tmp_path):
    results = tmp_path / "foreign.jsonl"
    results.write_text('{"foo": 1}\n')
    refused = CliRunner().invoke(main, sweep_args(base_path, helper_path, tiny_prm_path, results, "--resume"))
    assert "foreign.jsonl:1 is not a results line" in one_error_line(refused)


def test_junk_checkpoints_are_refused_by_convert_prm(tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text("<html>rate limited</html>")
    result = CliRunner().invoke(main, ["models", "convert-prm", str(junk), str(tmp_path / "out.gguf")])
    assert "config.json is not JSON" in one_error_line(result)
    (junk / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForProcessRewardModel"], "hidden_size": 8,
                                                  "num_hidden_layers": 1, "num_attention_heads": 2,
                                                  "intermediate_size": 16, "vocab_size": 300}))
    (junk / "model.safetensors").write_bytes(b"\xff" * 64)
    result = CliRunner().invoke(main, ["models", "convert-prm", str(junk), str(tmp_path / "out.gguf")])
    assert "model.safetensors is not a readable safetensors file" in one_error_line(result)
    (junk / "model.safetensors").write_bytes(b"\x05")
    result = CliRunner().invoke(main, ["models", "convert-prm", str(junk), str(tmp_path / "out.gguf")])
    assert "not a readable safetensors file" in one_error_line(result)
    (junk / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForProcessRewardModel"]}))
    result = CliRunner().invoke(main, ["models", "convert-prm", str(junk), str(tmp_path / "out.gguf")])
    assert "has no integer hidden_size" in one_error_line(result)


# --- 5. limits stated up front ---------------------------------------------------------------------

def test_a_problem_longer_than_the_models_context_is_refused():
    result = CliRunner().invoke(main, ["solve", "--preset", "toy", "-n", "1", "1+" * 10_000 + "1 = ?"])
    message = one_error_line(result)
    assert "takes" in message and "trained on 1,024" in message and "shorten it" in message


def test_an_empty_problem_is_refused(tmp_path):
    assert "the PROBLEM argument is empty" in one_error_line(CliRunner().invoke(main, ["solve", "  \n", *MISSING_MODEL]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"id": "a", "problem": "", "answer": "1"}\n')
    result = CliRunner().invoke(main, ["bench", "run", "--data", str(empty), "--results", str(tmp_path / "r.jsonl"),
                                       *MISSING_MODEL])
    assert "empty.jsonl:1: the 'problem' field is empty" in one_error_line(result)


def test_n_beyond_the_sequences_of_a_context_names_the_largest_n():
    result = CliRunner().invoke(main, ["solve", "What is 2+3?", "-n", "1000", *MISSING_MODEL])
    assert "the largest N in kvrescue mode is 127" in one_error_line(result)
    result = CliRunner().invoke(main, ["solve", "What is 2+3?", "--mode", "bon", "-n", "256", *MISSING_MODEL])
    assert "the largest N in bon mode is 255" in one_error_line(result)


def test_a_bad_shard_is_refused_before_models_load(tmp_path):
    result = CliRunner().invoke(main, ["bench", "run", "--shard", "3/2", "--results", str(tmp_path / "r.jsonl"),
                                       *MISSING_MODEL])
    assert "--shard 3/2: i must be in [0, n)" in one_error_line(result)


# --- 7. a busy CPU ---------------------------------------------------------------------------------

def test_default_threads_leave_one_physical_core_free(monkeypatch):
    monkeypatch.delenv("KVRESCUE_THREADS", raising=False)
    assert 1 <= context.physical_cores() <= (os.cpu_count() or 1)
    assert context.default_threads() == max(1, context.physical_cores() - 1)
    monkeypatch.setattr(context, "physical_cores", lambda: 8)
    assert context.default_threads() == 7
    monkeypatch.setattr(context, "physical_cores", lambda: 1)
    assert context.default_threads() == 1
    monkeypatch.setenv("KVRESCUE_THREADS", "3")
    assert context.default_threads() == 3
