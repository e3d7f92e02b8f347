"""Nothing lost, nothing crashed: outputs written through one writer, results files locked by the file they
are, every option checked as it is parsed, inputs refused by line, and commands that need rows refusing none.
The toy preset, one thread."""

import dataclasses
import hashlib
import json
import math
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvrescue_local import presets, wheels
from kvrescue_local.bench import run as bench_run
from kvrescue_local.bench.results_file import writing
from kvrescue_local.cli import main
from kvrescue_local.errors import KVRescueError
from kvrescue_local.paths import SHIPPED_MODELS

TOY = SHIPPED_MODELS / "toy"
PROBLEM = "a=8 b=6 c=5"
FAST = ["--preset", "toy", "-t", "1", "--max-tokens", "24", "--max-step-tokens", "12"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result) -> str:
    """Failed with exactly one `Error:` line and no traceback."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return errors[0]


def toy_rows(tmp_path, name="toy.jsonl", limit=2):
    """A tiny sweep on the toy preset: a results file of `limit` rows."""
    results = tmp_path / name
    done = invoke("bench", "run", "--dataset", "toy", "--limit", limit, "--modes", "full", "--ns", "1", *FAST,
                  "--results", results)
    assert done.exit_code == 0, done.output
    return results


def char_device(path: Path, minor: int) -> Path:
    """A memory character device (1:3 is /dev/null, 1:7 /dev/full) inside the test folder."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    except PermissionError:
        pytest.skip("making a device node needs root")
    return path


# --- 1. outputs: devices, symlinks, missing folders ----------------------------------------------

def test_a_device_given_as_json_is_written_through_never_replaced(tmp_path):
    null = char_device(tmp_path / "null", 3)
    done = invoke("solve", *FAST, "--json", null, PROBLEM)
    assert done.exit_code == 0, done.output
    assert stat.S_ISCHR(null.stat().st_mode), "the device is still a device"
    full = char_device(tmp_path / "full", 7)
    assert "the disk is full" in one_error_line(invoke("solve", *FAST, "--json", full, PROBLEM))
    assert stat.S_ISCHR(full.stat().st_mode)


def test_a_fifo_is_written_through_and_one_without_a_reader_is_refused(tmp_path):
    from kvrescue_local.files import write_output

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(KVRescueError, match="no process reads"):
        write_output(fifo, "{}", "--json")
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    while True:  # the reader has the FIFO open once a non-blocking writer can open it
        try:
            write_output(fifo, '{"a": 1}\n', "--json")
            break
        except KVRescueError:
            continue
    reader.join(10)
    assert received == ['{"a": 1}\n'] and stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_symlinked_json_is_written_at_its_target(tmp_path):
    target = tmp_path / "target.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    done = invoke("solve", *FAST, "--json", link, PROBLEM)
    assert done.exit_code == 0, done.output
    assert link.is_symlink() and json.loads(target.read_text())["steps"] is not None


def test_a_missing_folder_is_an_error_never_created(tmp_path):
    missing = tmp_path / "no" / "such" / "x.json"
    assert "does not exist: create it first" in one_error_line(invoke("solve", *FAST, "--json", missing, PROBLEM))
    assert not (tmp_path / "no").exists()
    merged = invoke("bench", "merge", toy_rows(tmp_path), "--out", missing)
    assert "does not exist" in one_error_line(merged) and not (tmp_path / "no").exists()


def test_merge_into_a_device_is_refused(tmp_path):
    null = char_device(tmp_path / "null", 3)
    assert "is a character device, not a regular file" in one_error_line(
        invoke("bench", "merge", toy_rows(tmp_path), "--out", null))
    assert stat.S_ISCHR(null.stat().st_mode)


# --- 2. merge loses nothing -------------------------------------------------------------------------

def test_merge_refuses_an_existing_output_that_is_not_an_input_unless_forced(tmp_path):
    rows = toy_rows(tmp_path)
    precious = tmp_path / "precious.jsonl"
    precious.write_text("not results, but someone's\n")
    assert "already exists and is not one of the inputs" in one_error_line(
        invoke("bench", "merge", rows, "--out", precious))
    assert precious.read_text() == "not results, but someone's\n"
    forced = invoke("bench", "merge", rows, "--out", precious, "--force")
    assert forced.exit_code == 0 and precious.read_bytes() == rows.read_bytes(), forced.output
    into_an_input = invoke("bench", "merge", rows, precious, "--out", rows)
    assert into_an_input.exit_code == 0 and "2 results" in into_an_input.output, into_an_input.output


@pytest.mark.parametrize("content", [b"\x00\xff\xfe binary", b"\n\n  \n", b'{"dataset": "toy", "id": "toy-0"'])
def test_merge_refuses_an_input_without_rows(tmp_path, content):
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(content)
    result = invoke("bench", "merge", toy_rows(tmp_path), junk, "--out", tmp_path / "m.jsonl")
    assert "junk.jsonl holds no results lines" in one_error_line(result)
    assert not (tmp_path / "m.jsonl").exists()


# --- 3. / 14. one lock per file, gone when its writer is -----------------------------------------

def test_the_lock_belongs_to_the_file_not_its_name(tmp_path):
    two = tmp_path / "two.jsonl"
    link = tmp_path / "two-link.jsonl"
    link.symlink_to(two)
    with writing(two):
        with pytest.raises(KVRescueError, match=f"PID {os.getpid()}"):
            with writing(link):
                pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two-link.jsonl"], "no lock file left behind"


def test_a_finished_or_refused_run_leaves_no_lock_and_no_empty_results(tmp_path, monkeypatch):
    toy_rows(tmp_path, "done.jsonl", limit=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.jsonl"]

    def refuse(*args, **kwargs):
        raise KVRescueError("refused before the first row")

    monkeypatch.setattr(bench_run, "Rescue", refuse)
    refused = invoke("bench", "run", "--dataset", "toy", "--limit", 1, "--modes", "full", "--ns", 1, *FAST,
                     "--results", tmp_path / "new.jsonl")
    assert "refused before the first row" in one_error_line(refused)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.jsonl"]


# --- 4. a results file is a regular file --------------------------------------------------------------

def test_a_results_path_that_is_a_device_is_refused(tmp_path):
    null = char_device(tmp_path / "fulldev", 3)
    refused = invoke("bench", "run", "--dataset", "toy", "--limit", 1, "--modes", "full", "--ns", 1, *FAST,
                     "--results", null)
    assert "is a character device, not a regular file" in one_error_line(refused)
    zero = char_device(tmp_path / "zero", 5)  # endless: read, it would fill the memory
    assert "not a regular file" in one_error_line(invoke("report", zero))
    assert "not a regular file" in one_error_line(invoke("bench", "merge", zero, "--out", tmp_path / "m.jsonl"))


# each command that reads a model or head, with {} where the FIFO goes, and what its error says: `solve`, `bench
# run` and `serve` once blocked forever opening it (reading its GGUF header, then in llama.cpp's load)
FIFO_MODELS = {"--base": ["solve", *FAST, "--base", "{}", PROBLEM],
               "--helper": ["bench", "run", "--dataset", "toy", "--limit", "1", *FAST, "--helper", "{}",
                            "--results", "r.jsonl"],
               "--prm": ["serve", "--preset", "toy", "-t", "1", "-n", "2", "--prm", "{}"],
               "reward head": ["solve", *FAST, "-n", "2", "--prm", f"{TOY / 'prm.gguf'}:{{}}", PROBLEM],
               "--bases": ["bench", "run", "--dataset", "toy", "--limit", "1", *FAST, "--bases", "{}",
                           "--results", "r.jsonl"],
               "": ["doctor", "--load-on", "CPU", "--model", "{}"]}  # straight to llama.cpp's load: no option named
RUN_EACH = """import json, sys
from click.testing import CliRunner
from kvrescue_local.cli import main
for args in json.loads(sys.argv[1]):
    print(json.dumps(CliRunner().invoke(main, args).output), flush=True)
"""


def test_a_fifo_as_a_model_or_head_is_one_error_line_not_a_hang(tmp_path):
    """Every command in one child (one start-up), killed if it blocks: a FIFO is refused before it is opened."""
    fifo = tmp_path / "model.head.npz"
    os.mkfifo(fifo)
    runs = [[str(fifo) if a == "{}" else a.replace("{}", str(fifo)) for a in args] for args in FIFO_MODELS.values()]
    try:
        done = subprocess.run([sys.executable, "-c", RUN_EACH, json.dumps(runs)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "KVRESCUE_THREADS": "1"})
    except subprocess.TimeoutExpired as hung:
        answered = (hung.stdout or b"").count(b"\n")
        pytest.fail(f"blocked on the FIFO: {runs[answered]}")
    outputs = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(outputs) == len(runs), done.stderr
    for option, output in zip(FIFO_MODELS, outputs):
        errors = [line for line in output.splitlines() if line.startswith("Error:")]
        said = f"{option} {fifo} is a FIFO, not a regular file: pass" if option else f"{fifo} is not a regular file"
        assert len(errors) == 1 and said in errors[0], output

# --- 5. sizes llama.cpp asserts on ------------------------------------------------------------------

@pytest.mark.parametrize("prm_ctx", ["1", "5", "16", "64", "-1"])
def test_a_prm_context_llama_cpp_would_abort_on_is_refused(prm_ctx):
    # a child process: an abort there is an exit status here, not the end of the test run
    done = subprocess.run([sys.executable, "-m", "kvrescue_local", "solve", *FAST, "--prm-ctx", prm_ctx, PROBLEM],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == (2 if prm_ctx == "-1" else 1), done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--prm-ctx" in errors[0] and "GGML_ASSERT" not in done.stderr


# --- 6. no tracebacks -----------------------------------------------------------------------------

@pytest.mark.parametrize("template, says", [("x {problem} {foo}", "holds {foo}"), ("{problem} {", "not a template"),
                                            ("no field", "must contain {problem}"), ("{problem!r}", "holds {problem}")])
def test_a_prompt_template_holds_problem_and_nothing_else(template, says):
    assert says in one_error_line(invoke("solve", *FAST, "--prompt-template", template, PROBLEM))


def test_a_literal_brace_in_a_template_is_written_doubled():
    done = invoke("solve", *FAST, "-n", 1, "--prompt-template", "{{x}} {problem}", PROBLEM)
    assert done.exit_code == 0, done.output


def test_undecodable_bytes_name_their_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"id": 1, "problem": "1+1", "answer": "2"}\n{"id": 2, "problem": "\xff", "answer": "3"}\n')
    result = invoke("bench", "run", "--data", data, *FAST, "--results", tmp_path / "r.jsonl")
    assert "data.jsonl:2 is not UTF-8 text (byte 0xff" in one_error_line(result)


def test_an_empty_list_option_is_refused(tmp_path):
    for option in ("--budgets", "--ns"):
        result = invoke("bench", "run", "--dataset", "toy", option, "", *FAST, "--results", tmp_path / "r.jsonl")
        assert f"'{option}': '' holds no values" in one_error_line(result)


@pytest.mark.parametrize("cut", [0, 10, 200])
def test_a_broken_head_file_is_one_error_line(tmp_path, cut):
    prm = tmp_path / "prm.gguf"
    prm.symlink_to(TOY / "prm.gguf")
    (tmp_path / "prm.head.npz").write_bytes((TOY / "prm.head.npz").read_bytes()[:cut])
    assert "prm.head.npz is unreadable" in one_error_line(invoke("solve", *FAST, "-n", 2, "--prm", prm, PROBLEM))


# --- 7. duplicate ids ------------------------------------------------------------------------------

def test_duplicate_dataset_ids_are_refused_naming_both_lines(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"id": "1", "problem": "1+1", "answer": "2"}\n{"id": 2, "problem": "2+2", "answer": "4"}\n'
                    '{"id": 1, "problem": "3+3", "answer": "6"}\n')
    result = invoke("bench", "run", "--data", data, *FAST, "--results", tmp_path / "r.jsonl")
    assert "data.jsonl:3: id '1' is already the id of line 1" in one_error_line(result)


# --- 8. / 9. / 14. numbers within their range ------------------------------------------------------

@pytest.mark.parametrize("option, value, says", [
    ("--limit", "0", "0 is not in the range x>=1"), ("--limit", "-1", "-1 is not in the range x>=1"),
    ("--temp", "nan", "not a finite number"), ("--temp", "inf", "not a finite number"),
    ("--tau-entropy", "nan", "not a finite number"), ("--tau-compression", "-inf", "not a finite number"),
    ("--top-p", "0", "it must be > 0 and <= 1"), ("-t", "-1", "not in the range"), ("-t", "999", "not in the range"),
    ("--budgets", "64,0", "every value must be >= 1"), ("--policies", "rkv:lam=0.1,lam=0.2", "sets lam more than once"),
    ("--policies", "rkv,rkv", "given more than once")])
def test_bench_options_are_checked_as_they_are_parsed(tmp_path, option, value, says):
    result = invoke("bench", "run", "--dataset", "toy", *FAST, option, value, "--results", tmp_path / "r.jsonl")
    assert says in one_error_line(result) and not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("option, value, says", [
    ("--temp", "nan", "not a finite number"), ("--policy", "rkv:lam=0.1,lam=0.2", "sets lam more than once"),
    ("-n", "0", "not in the range"), ("--budget", "100000000", "--budget 100000000 exceeds the 1,024 positions"),
    ("--seed", "-1", "not in the range")])
def test_solve_options_are_checked_before_solving(option, value, says):
    message = one_error_line(invoke("solve", *FAST, option, value, PROBLEM))
    assert says in message and (option != "--budget" or "--max-tokens" not in message)


def test_a_record_holding_nan_is_refused_not_written(tmp_path):
    from kvrescue_local.cli.common import write_json

    out = tmp_path / "t.json"
    with pytest.raises(KVRescueError, match="not finite"):
        write_json(out, {"score": math.nan}, "--json")
    assert not out.exists()


# --- 10. report's setup notes -------------------------------------------------------------------------

def test_report_names_each_setups_own_values(tmp_path):
    from kvrescue_local.bench.metrics import setup_label

    hot, cold = tmp_path / "hot.jsonl", tmp_path / "cold.jsonl"
    for path, temp in ((hot, 1.0), (cold, 0.5)):
        done = invoke("bench", "run", "--dataset", "toy", "--limit", 1, "--modes", "full,helper", "--ns", 1, *FAST,
                      "--temp", temp, "--results", path)
        assert done.exit_code == 0, done.output
    temperature = {setup_label(json.loads(line)): temp for path, temp in ((hot, 1.0), (cold, 0.5))
                   for line in path.read_text().splitlines()}
    out = invoke("report", hot, cold)
    assert out.exit_code == 0, out.output
    notes = [line for line in out.output.split("Table 1")[0].splitlines() if ": setup " in line]
    assert len(notes) == 2 and "not recorded" not in out.output
    for line in notes:
        first, second = line.split(": setup ")[1].split(": ")[0].split(" vs ")
        assert f"temperature {temperature[first]} vs {temperature[second]}" in line, line


# --- 11. models list ---------------------------------------------------------------------------------

def test_models_list_checks_the_cache_by_size_and_hash(tmp_path, monkeypatch):
    content = b"0123456789"
    small = {name: dataclasses.replace(model, size=len(content), sha256=hashlib.sha256(content).hexdigest())
             for name, model in wheels.WHEEL_MODELS.items()}
    monkeypatch.setattr(wheels, "WHEEL_MODELS", small)
    monkeypatch.setattr(presets, "MODELS_CACHE", tmp_path)
    (tmp_path / "coder-1.5b.gguf").write_bytes(b"")
    (tmp_path / "coder-0.5b.gguf").write_bytes(b"01234")
    listing = invoke("models", "list")
    assert listing.exit_code == 0, listing.output
    assert " cached" not in listing.output and listing.output.count("broken (") == 2
    (tmp_path / "coder-1.5b.gguf").write_bytes(b"9876543210")
    (tmp_path / "coder-0.5b.gguf").write_bytes(content)
    listing = invoke("models", "list").output
    assert "sha256 differs" in listing and "cached (size and sha256 checked)" in listing
    coder = next(line for line in listing.splitlines() if line.startswith("coder "))
    assert "no PRM" not in coder and "PRM: a value head on the helper's own context" in coder


# --- 12. commands that need rows --------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"", b"\x00\x01\xff binary"])
def test_prm_eval_on_a_file_without_rows_is_an_error(tmp_path, content):
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_bytes(content)
    assert "holds no usable rows" in one_error_line(invoke("prm", "eval", "--rollouts", rollouts, "--preset", "toy",
                                                           "-t", 1))


@pytest.mark.parametrize("count", ["0", "-3"])
def test_toy_sample_needs_a_positive_count(count):
    assert "not in the range x>=1" in one_error_line(invoke("toy", "sample", "--count", count))


# --- 13. the right message ---------------------------------------------------------------------------

def test_solve_without_a_problem_says_so(tmp_path):
    message = one_error_line(invoke("solve", *FAST))
    assert "give the problem as an argument or with --file" in message and "not both" not in message
    both = tmp_path / "p.txt"
    both.write_text(PROBLEM)
    assert "not both" in one_error_line(invoke("solve", *FAST, "--file", both, PROBLEM))


# --- found by tests/test_fuzz.py --------------------------------------------------------------------

def test_a_buffer_beyond_the_trained_context_is_refused_not_allocated():
    message = one_error_line(invoke("solve", *FAST, "--buffer", 100000000, PROBLEM))
    assert "--buffer 100000000 exceeds the 1,024 positions" in message


def test_a_protected_prompt_that_fills_the_budget_is_refused_before_solving(tmp_path):
    result = invoke("bench", "run", "--dataset", "toy", "--limit", 1, "--modes", "kvrescue", *FAST, "--budgets", 64,
                    "--protect-prompt", "--results", tmp_path / "r.jsonl")
    message = one_error_line(result)  # the budget named by bench run's own option for it
    assert "--protect-prompt keeps the prompt's" in message and "raise --budgets to at least" in message
    assert "or evict the prompt" in message
    assert not (tmp_path / "r.jsonl").exists()
    roomy = invoke("solve", *FAST, "--protect-prompt", "--budget", 200, PROBLEM)
    assert roomy.exit_code == 0, roomy.output


# --- a copy of a preset's model takes its recipe; another model's defaults are lowered to what it holds -------------

def test_a_copy_of_the_presets_base_and_its_quantized_copy_take_the_presets_recipe(tmp_path):
    copy = tmp_path / "base.gguf"
    copy.write_bytes((TOY / "base.gguf").read_bytes())
    quantized = invoke("models", "quantize", copy, "--type", "Q8_0", "--out", tmp_path / "q8.gguf")
    assert quantized.exit_code == 0, quantized.output
    recorded = json.loads((tmp_path / "q8.gguf.source.json").read_text())
    assert recorded["source"] == "base.gguf" and recorded["type"] == "Q8_0"
    for base in (copy, tmp_path / "q8.gguf"):  # --max-tokens etc. are the preset's (320), not RescueConfig's (4096)
        solved = invoke("solve", "--mode", "full", "-n", "1", "-t", "1", "--base", base, PROBLEM)
        assert solved.exit_code == 0 and "answer: " in solved.output and "lowered" not in solved.output, solved.output


def test_another_models_defaults_are_lowered_to_its_trained_context_and_only_a_given_value_is_refused(tmp_path):
    from kvrescue_local.gguf_export import TINY_BASE, write_tiny_model

    short = write_tiny_model(tmp_path / "short.gguf", dataclasses.replace(TINY_BASE, n_ctx_train=1024), seed=1)
    solved = invoke("solve", "--mode", "full", "-n", "1", "-t", "1", "--base", short, PROBLEM)
    assert solved.exit_code == 0 and "answer: " in solved.output, solved.output
    assert ("lowered the default --max-tokens 4,096 to 1,024, the positions short.gguf was trained on (give them to "
            "choose)") in solved.stderr
    given = invoke("solve", "--mode", "full", "-n", "1", "-t", "1", "--max-tokens", 4096, "--base", short, PROBLEM)
    assert "--max-tokens 4096 exceeds the 1,024 positions short.gguf was trained on" in one_error_line(given)
    (tmp_path / "q8.gguf").write_bytes(short.read_bytes())  # a record that names another file's fingerprint
    (tmp_path / "q8.gguf.source.json").write_text(json.dumps({"source_sha256": "x", "sha256": "stale"}))
    stale = invoke("solve", "--mode", "full", "-n", "1", "-t", "1", "--base", tmp_path / "q8.gguf", PROBLEM)
    assert stale.exit_code == 0 and "lowered the default --max-tokens" in stale.stderr, stale.output
