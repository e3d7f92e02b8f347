"""Benchmark sweeps, grading, datasets (vendored, hub cache, JSONL) and resumability."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvrescue_local.bench.datasets import HUB, load_dataset, split_of
from kvrescue_local.bench.grade import is_correct
from kvrescue_local.bench.results_file import read_rows
from kvrescue_local.bench.run import run_sweep
from kvrescue_local.cli import main
from kvrescue_local.errors import KVRescueError
from kvrescue_local.files import ZSTD_MAGIC
from kvrescue_local.rescue.record import Trajectory
from kvrescue_local.answers import last_boxed
from test_reliability import one_error_line, sweep, sweep_args  # noqa: F401  (sweep: a fixture)
from test_report import assert_one_line_error


@pytest.mark.parametrize("name", ["math500", "gsm8k"])
def test_every_gold_answer_grades_against_itself_and_perturbed_ones_fail(name):
    problems = load_dataset(name).problems
    assert len(problems) == {"math500": 500, "gsm8k": 1319}[name]
    for p in problems:
        answer = last_boxed(f"So the result follows.\n\n\\boxed{{{p.answer}}}")
        assert is_correct(p.answer, answer), p
        assert not is_correct(p.answer, f"{p.answer}+1"), p
    assert not is_correct("54", None)
    assert is_correct("\\frac{14}{3}", "\\dfrac{14}{3}")


def test_gsm8k_splits_never_mix_and_other_datasets_refuse_a_split():
    train = load_dataset("gsm8k", split="train")
    evaluation = load_dataset("gsm8k", split="eval", limit=5)
    assert len(train.problems) == 900 and train.problems[-1].id == "899"
    assert [p.id for p in evaluation.problems] == ["900", "901", "902", "903", "904"]
    assert {split_of("gsm8k", p.id) for p in train.problems} == {"train"}
    assert split_of("gsm8k", "900") == "eval" and split_of("math500", "0") is None
    with pytest.raises(KVRescueError, match="gsm8k .*math500"):
        load_dataset("toy", split="train")


def test_skip_starts_after_the_first_problems_of_the_split_and_a_sweep_runs_those_alone(base_path, tmp_path):
    later = load_dataset("gsm8k", split="eval", skip=100, limit=3)
    assert [p.id for p in later.problems] == ["1000", "1001", "1002"]
    assert [p.id for p in load_dataset("gsm8k", skip=899).problems] == [str(i) for i in range(899, 1319)]
    with pytest.raises(KVRescueError, match=r"--skip 419 leaves no problem: gsm8k \(eval\) has 419"):
        load_dataset("gsm8k", split="eval", skip=419)
    results = tmp_path / "next.jsonl"
    args = ["bench", "run", "--dataset", "gsm8k", "--split", "eval", "--skip", "100", "--limit", "2", "--modes", "full",
            "--ns", "1", "--max-tokens", "8", "--base", str(base_path), "--results", str(results)]
    ran = CliRunner().invoke(main, args)
    assert ran.exit_code == 0, ran.output
    assert sorted(r["id"] for r in read_rows(results)) == ["1000", "1001"]
    refused = CliRunner().invoke(main, [*args[:6], "--skip", "419", *args[8:]])
    assert refused.exit_code != 0 and refused.output.strip().splitlines()[-1].startswith("Error: --skip 419")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_datasets_and_bad_rows(tmp_path):
    good = write_jsonl(tmp_path / "mine.jsonl", [{"id": "q1", "problem": "1+1?", "answer": "2"},
                                                 {"problem": "2+2?", "answer": "4"}])
    mine = load_dataset(path=good)
    assert mine.label == "mine" and [p.id for p in mine.problems] == ["q1", "mine-2"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "q1", "problem": "1+1?", "answer": "2"}, {"id": "q2", "answer": "3"}])
    with pytest.raises(KVRescueError, match=r"bad.jsonl:2: the row has no 'problem' field"):
        load_dataset(path=bad)
    with pytest.raises(KVRescueError, match="unknown dataset 'math5000'.*math500"):
        load_dataset("math5000")
    (tmp_path / "broken.jsonl").write_text('{"problem": "x", "answer": "1"}\nnot json\n')
    with pytest.raises(KVRescueError, match="broken.jsonl:2: not a JSON object"):
        load_dataset(path=tmp_path / "broken.jsonl")


def test_hub_datasets_come_from_the_cache_offline(tmp_path):
    """A local directory laid out as a Hugging Face hub cache; nothing touches the network."""
    spec = HUB["amc23"]
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / f"datasets--{spec.repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    write_jsonl(snapshot / spec.filename, [{"id": 1, "question": "What is 3*4?", "answer": 12.0}])
    amc = load_dataset("amc23", cache_dir=tmp_path / "hub", offline=True)
    assert amc.label == "amc23" and amc.problems[0].problem == "What is 3*4?" and amc.problems[0].answer == "12.0"
    with pytest.raises(KVRescueError, match="not in the Hugging Face cache.*--data"):
        load_dataset("aime24", cache_dir=tmp_path / "hub", offline=True)


def bench_args(base_path, helper_path, prm_path, results, *extra):
    return ["bench", "run", "--dataset", "gsm8k", "--limit", "20", "--modes", "full,kvrescue", "--ns", "2", "--policies", "rkv",
            "--budgets", "32", "--buffer", "16", "--max-tokens", "60", "--max-step-tokens", "16", "--tau-entropy", "50",
            "--base", str(base_path), "--helper", str(helper_path), "--prm", str(prm_path), "--results", str(results),
            *extra]


def test_killed_sweep_resumes_without_duplicates_or_gaps(base_path, helper_path, tiny_prm_path, tmp_path):
    results = tmp_path / "results.jsonl"
    args = bench_args(base_path, helper_path, tiny_prm_path, results)
    proc = subprocess.Popen([sys.executable, "-m", "kvrescue_local", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not results.exists() or len(results.read_text().splitlines()) < 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # a crash, not a polite stop
    proc.wait()
    partial = len(read_rows(results))
    assert 5 <= partial < 40
    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "--resume" in again.output
    resumed = CliRunner().invoke(main, args + ["--resume"])
    assert resumed.exit_code == 0, resumed.output
    rows = read_rows(results)
    keys = [(r["dataset"], r["id"], r["config_key"]) for r in rows]
    assert len(keys) == len(set(keys)) == 40
    assert {r["config_key"] for r in rows} == {"full-b0-n2-none", "kvrescue-b32-n2-rkv"}
    row = rows[0]
    assert set(row) >= {"gold", "answer", "correct", "degenerate", "n_steps", "tokens", "timings", "detector"}
    for row in rows:  # each row carries its whole trajectory, candidates included
        trajectory = Trajectory.from_json(row["trajectory"])
        assert trajectory.answer == row["answer"] and trajectory.n_steps == row["n_steps"]
        assert sum(len(s.candidates) for s in trajectory.steps) >= row["n_steps"]
    report = CliRunner().invoke(main, ["report", str(results), "--plots", str(tmp_path / "plots")])
    assert report.exit_code == 0, report.output
    assert "full" in report.output and "kvrescue" in report.output and "pass@1" in report.output
    assert (tmp_path / "plots" / "pass1_vs_budget.png").stat().st_size > 1000
    nothing = CliRunner().invoke(main, args + ["--resume"])
    assert "0 new results" in nothing.output
    other = CliRunner().invoke(main, args[:-2] + ["--results", str(results), "--resume", "--seed", "5"])
    assert other.exit_code != 0 and "different configuration (seed 0 vs 5)" in other.output


def test_shards_merge_into_the_full_sweep(base_path, helper_path, tiny_prm_path, tmp_path):
    shards = []
    for i in range(2):
        out = tmp_path / f"shard{i}.jsonl"
        args = bench_args(base_path, helper_path, tiny_prm_path, out, "--shard", f"{i}/2")
        args[args.index("--limit") + 1] = "5"
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        shards.append(out)
    merged = tmp_path / "merged.jsonl"
    result = CliRunner().invoke(main, ["bench", "merge", *map(str, shards + shards[:1]), "--out", str(merged)])
    assert result.exit_code == 0 and "10 results" in result.output
    keys = {(r["id"], r["config_key"]) for r in read_rows(merged)}
    assert len(keys) == 10
    bad = CliRunner().invoke(main, bench_args(base_path, helper_path, tiny_prm_path, tmp_path / "x.jsonl",
                                              "--shard", "2/2"))
    assert bad.exit_code != 0 and "--shard 2/2" in bad.output


def test_n1_sweep_opens_no_prm_and_a_problem_that_cannot_finish_becomes_a_row(base_path, tmp_path, monkeypatch):
    from kvrescue_local.rescue import Rescue

    begin = Rescue.begin

    def fails_on_the_robe(self, item, problem, slot, own=None):
        solving = begin(self, item, problem, slot, own)
        if problem.startswith("A robe"):
            solving.error = "the helper context (n_ctx=512) is full: raise its context size or lower --max-tokens"
        return solving

    monkeypatch.setattr(Rescue, "begin", fails_on_the_robe)
    results = tmp_path / "r.jsonl"
    args = ["bench", "run", "--dataset", "gsm8k", "--limit", "3", "--modes", "full,bon", "--ns", "1", "--budgets", "32",
            "--buffer", "16", "--max-tokens", "24", "--max-step-tokens", "12", "--base", str(base_path),
            "--prm", str(tmp_path / "absent-prm.gguf"), "--results", str(results)]
    run = CliRunner().invoke(main, args)  # N = 1 has no choice to make: the (missing) PRM is never opened
    assert run.exit_code == 0, run.output
    rows = read_rows(results)
    assert len(rows) == 6
    failed = [r for r in rows if r.get("error")]
    assert [r["id"] for r in failed] == ["1", "1"] and all(r["stop"] == "error" and not r["correct"] for r in failed)
    assert "helper context (n_ctx=512) is full" in failed[0]["error"]
    report = CliRunner().invoke(main, ["report", str(results)])
    assert report.exit_code == 0, report.output


COMMITTED = Path(__file__).resolve().parent.parent / "results" / "coder-gsm8k-judge-n4.jsonl.zst"


def test_committed_results_are_compressed_and_read_as_plain_ones(tmp_path):
    assert COMMITTED.read_bytes().startswith(ZSTD_MAGIC)
    plain, again = tmp_path / "plain.jsonl", tmp_path / "again.jsonl.zst"
    for source, out in ((COMMITTED, plain), (plain, again)):
        merged = CliRunner().invoke(main, ["bench", "merge", str(source), "--out", str(out)])
        assert merged.exit_code == 0, merged.output
    assert not plain.read_bytes().startswith(ZSTD_MAGIC) and again.read_bytes().startswith(ZSTD_MAGIC)
    rows = read_rows(COMMITTED)
    assert len(rows) == 10 and read_rows(plain) == rows == read_rows(again)
    reports = [CliRunner().invoke(main, ["report", str(path)]) for path in (COMMITTED, plain, again)]
    assert all(r.exit_code == 0 for r in reports), reports[0].output
    assert "kvrescue" in reports[0].output and reports[0].output == reports[1].output == reports[2].output


@pytest.mark.parametrize("name", ["new.jsonl.zst", "compressed.jsonl"])
def test_no_sweep_appends_to_a_compressed_file(tmp_path, name):
    path = tmp_path / name
    if not name.endswith(".zst"):  # compressed under a plain name: known by its first bytes
        path.write_bytes(COMMITTED.read_bytes())
    before = path.read_bytes() if path.exists() else None
    for args in (["bench", "run", "--dataset", "gsm8k", "--limit", "1", "--resume", "--results", str(path)],
                 ["prm", "train", "--preset", "toy", "--rollouts", str(path)]):
        option = args[-2]
        assert_one_line_error(CliRunner().invoke(main, args), f"{option} {path} is zstd-compressed", "bench merge")
    with pytest.raises(KVRescueError, match="is zstd-compressed"):
        run_sweep(None, [], None, None, path)
    assert (path.read_bytes() if path.exists() else None) == before


def test_a_damaged_compressed_results_file_ends_in_one_error_line(tmp_path):
    damaged = tmp_path / "damaged.jsonl.zst"
    damaged.write_bytes(COMMITTED.read_bytes()[:1000])
    for args in (["report", str(damaged)], ["bench", "merge", str(damaged), "--out", str(tmp_path / "out.jsonl")]):
        assert_one_line_error(CliRunner().invoke(main, args), f"{damaged} is a damaged zstd file")


# --- rows read back: every field of its type, a cut last line left out alike ---------------------------------------

def set_field(row: dict, dotted: str, value) -> dict:
    *parents, name = dotted.split(".")
    record = row
    for parent in parents:
        record = record[parent]
    record[name] = value
    return row


@pytest.mark.parametrize("field, value", [("id", [1]), ("setup", "a setup"), ("setup", None), ("engine.concurrency", 0),
                                          ("config.n", "2"), ("config.mode", "fast"), ("tokens.base", -1),
                                          ("setup.models.base.size", None), ("trajectory.steps", {}),
                                          ("trajectory.steps.0.candidates.0.tokens", 1.5), ("timings.total", float("nan"))],
                         ids=lambda v: str(v)[:24])
def test_a_malformed_row_is_one_error_line_naming_its_line_and_field(sweep, base_path, helper_path, tiny_prm_path,
                                                                    tmp_path, field, value):
    lines = sweep.read_text().splitlines()
    row = json.loads(lines[1])
    if field.startswith("trajectory.steps.0"):
        row["trajectory"]["steps"][0]["candidates"][0]["tokens"] = value
        field = "trajectory.steps[0].candidates[0].tokens"
    else:
        set_field(row, field, value)
    results = tmp_path / "edited.jsonl"
    results.write_text("\n".join([lines[0], json.dumps(row), *lines[2:]]) + "\n")
    for args in (["report", str(results)], ["bench", "merge", str(results), "--out", str(tmp_path / "m.jsonl")],
                 sweep_args(base_path, helper_path, tiny_prm_path, results, "--resume")):
        error = one_error_line(CliRunner().invoke(main, args))
        assert "edited.jsonl:2 is not a results line" in error and f"{field} is " in error, (args, error)


def test_merge_and_report_leave_a_cut_last_line_out_alike_and_say_so(sweep, tmp_path):
    lines = sweep.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:5]) + lines[5][:150])
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(lines[:5]))
    merged = CliRunner().invoke(main, ["bench", "merge", str(cut), "--out", str(tmp_path / "m.jsonl")])
    assert merged.exit_code == 0 and "5 results" in merged.stdout, merged.output
    assert merged.stderr.strip() == f"warning: left out {cut}:6, a partial last line (150 bytes: a writer stopped mid-line)"
    assert (tmp_path / "m.jsonl").read_text() == whole.read_text()
    reported = CliRunner().invoke(main, ["report", str(cut)])
    assert reported.exit_code == 0, reported.output
    assert reported.stderr == merged.stderr
    assert reported.stdout == CliRunner().invoke(main, ["report", str(whole)]).stdout.replace(str(whole), str(cut))
