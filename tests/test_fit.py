"""`kvrescue-local fit`: a preset folder fitted for a pair through llama.cpp on the toy preset's models, loaded by
--preset; `fit --rows` rebuilding the coder preset's shipped files from the committed rows; a stopped fit resumed to
the same folder; a pair of no preset never judged by another pair's judge."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvrescue_local.cli import main, serve
from kvrescue_local.cli.serve import build_served
from kvrescue_local.files import file_hash
from kvrescue_local.paths import SHIPPED_MODELS
from kvrescue_local.prmtrain.rules_file import BASE_FIRST, fit_rules
from kvrescue_local.toy.task import problems

ROOT = Path(__file__).resolve().parent.parent
TOY = SHIPPED_MODELS / "toy"
FITTED_FILES = ("preset.json", "detector.json", "commit.json", "helper.head.npz")


def toy_training_file(path: Path, count: int = 6) -> Path:
    """Toy problems of a seed neither the toy's training nor its evaluation drew."""
    path.write_text("".join(json.dumps({"id": f"t{i}", "problem": p.text, "answer": str(p.answer)}) + "\n"
                            for i, p in enumerate(problems(5000, count))))
    return path


def fit_args(data: Path, out: Path) -> list[str]:
    return ["fit", "--base", str(TOY / "base.gguf"), "--helper", str(TOY / "helper.gguf"), "--data", str(data),
            "--budgets", "48,64", "--out", str(out)]


def test_fit_writes_a_preset_folder_that_solve_runs_with_the_rule_and_thresholds_it_printed(tmp_path):
    out = tmp_path / "pair"
    ran = CliRunner().invoke(main, fit_args(toy_training_file(tmp_path / "train.jsonl"), out))
    assert ran.exit_code == 0, ran.output
    assert ran.output.index("estimated wall time") < ran.output.index("1/4 detector") and "resuming" not in ran.output
    printed_rule = ran.output.split("\nrule: ", 1)[1].split("\n", 1)[0]
    entropy, zstd = ran.output.split("\ndetector: entropy ", 1)[1].split(" nats, zstd ")
    record = json.loads((out / "preset.json").read_text())["fitted"]
    assert record["models"]["base"]["file"] == "base.gguf" and len(record["models"]["helper"]["sha256"]) == 16
    assert record["problems"]["ids"] == [f"t{i}" for i in range(6)] and record["budgets"] == [48, 64]
    problem = problems(5000, 1)[0].text
    solved = CliRunner().invoke(main, ["solve", "--preset", str(out), "-t", "1", "--json", str(tmp_path / "t.json"),
                                       problem])
    assert solved.exit_code == 0, solved.output
    assert f"rule: {printed_rule} (the {out} preset's default" in solved.output
    config = json.loads((tmp_path / "t.json").read_text())["config"]
    assert config["rule"] == printed_rule
    assert config["detector"]["tau_entropy"] == float(entropy)
    assert config["detector"]["tau_compression"] == float(zstd.split()[0])
    swept = CliRunner().invoke(main, ["bench", "run", "--preset", str(out), "--data", str(tmp_path / "train.jsonl"),
                                      "--limit", "1", "--modes", "kvrescue", "--ns", "1", "--budgets", "48", "-t", "1",
                                      "--results", str(tmp_path / "r.jsonl")])
    assert swept.exit_code == 0, swept.output
    row = json.loads((tmp_path / "r.jsonl").read_text())
    assert row["config"]["rule"] == printed_rule and row["config"]["tau_entropy"] == float(entropy)
    assert row["setup"]["models"]["prm"]["head_sha256"] == file_hash(out / "helper.head.npz")
    served = build_served(serve.make_context("serve", ["--preset", str(out), "-t", "1"]).params)
    try:
        assert served.has_prm and served.config.rule.spec == printed_rule
    finally:
        served.engine.close()
    other_pair = CliRunner().invoke(main, [*fit_args(tmp_path / "train.jsonl", out)[:3], "--helper", str(TOY / "prm.gguf"),
                                           *fit_args(tmp_path / "train.jsonl", out)[5:]])
    assert other_pair.exit_code != 0 and "holds another preset" in other_pair.output, other_pair.output
    moved = tmp_path / "moved"  # the folder names its models by path and fingerprint: another file is refused
    moved.mkdir()
    spec = json.loads((out / "preset.json").read_text())
    spec["fitted"]["models"]["helper"]["path"] = str(TOY / "prm.gguf")
    (moved / "preset.json").write_text(json.dumps(spec))
    refused = CliRunner().invoke(main, ["solve", "--preset", str(moved), "-t", "1", problem])
    assert refused.exit_code != 0 and refused.output.count("\n") == 1, refused.output
    assert refused.output.startswith(f"Error: the preset {moved} was fitted on the helper helper.gguf")
    assert "is another file now" in refused.output and "kvrescue-local fit" in refused.output
    shown = CliRunner().invoke(main, ["models", "list", "--preset", str(out)])
    assert shown.exit_code == 0 and "fitted on 6 train problems" in shown.output, shown.output
    assert record["models"]["base"]["sha256"] in shown.output


def test_fit_rows_rebuilds_the_coder_presets_commit_and_detector_files(tmp_path):
    results = ROOT / "results"
    out = tmp_path / "coder"
    ran = CliRunner().invoke(main, [
        "fit", "--out", str(out),
        *(f"--rows={results / name}" for name in ("coder-math500-train-regime.jsonl.zst", "coder-gsm8k-n1.jsonl.zst",
                                                   "coder-gsm8k-train120-both64.jsonl.zst")),
        *(f"--judge-rows={results / name}" for name in ("coder-gsm8k-n1.jsonl.zst", "coder-math500-train-full.jsonl.zst",
                                                         "coder-math500-train-regime.jsonl.zst")),
        "--detector-stats", str(results / "coder-math500-collect.jsonl")])
    assert ran.exit_code == 0, ran.output
    shipped = ROOT / "models" / "coder"
    assert (out / "detector.json").read_bytes() == (shipped / "detector.json").read_bytes()

    def close(a, b) -> bool:
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(map(close, a, b))
        if isinstance(a, str) and a.count(",") and isinstance(b, str):  # a rule spec: its numbers within 1e-6
            return close(a.replace(":", ",").split(","), b.replace(":", ",").split(","))
        if isinstance(a, str):
            try:
                return abs(float(a) - float(b)) <= 1e-6
            except ValueError:
                return a == b
        return a == b if not isinstance(a, float) else abs(a - b) <= 1e-6

    assert close(json.loads((out / "commit.json").read_text()), json.loads((shipped / "commit.json").read_text()))


@pytest.mark.parametrize("how, rows", [(signal.SIGINT, "rollouts.jsonl"), (signal.SIGKILL, "detector.jsonl")])
def test_a_fit_stopped_by_ctrl_c_or_a_crash_resumes_to_the_folder_of_an_uninterrupted_one(tmp_path, how, rows):
    data = toy_training_file(tmp_path / "train.jsonl")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert CliRunner().invoke(main, fit_args(data, whole)).exit_code == 0
    written = stopped / "rows" / rows
    proc = subprocess.Popen([sys.executable, "-m", "kvrescue_local", *fit_args(data, stopped)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and (not written.exists() or len(written.read_text().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(how)
    _, err = proc.communicate()
    if how == signal.SIGINT:
        assert proc.returncode == 130 and "the same command resumes" in err.decode()
    else:  # killed mid-sweep, maybe mid-line: the resumed run drops what it cut short
        assert proc.returncode == -signal.SIGKILL
    assert not (stopped / "commit.json").exists()
    resumed = CliRunner().invoke(main, fit_args(data, stopped))
    assert resumed.exit_code == 0 and "resuming from" in resumed.output, resumed.output
    for name in FITTED_FILES:
        assert (stopped / name).read_bytes() == (whole / name).read_bytes(), name
    assert (stopped / "rows" / "detector.jsonl").read_text() == (whole / "rows" / "detector.jsonl").read_text()


def test_a_pair_of_no_preset_gets_no_judge_of_another_pair(base_path, helper_path, tmp_path):
    args = ["solve", "--base", str(base_path), "--helper", str(helper_path), "--mode", "kvrescue", "-n", "1",
            "--budget", "32", "--buffer", "16", "--max-tokens", "24", "-t", "1", "What is 2 + 3?"]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code != 0
    assert refused.output.startswith("Error: --base") and refused.output.count("\n") == 1, refused.output
    assert "toy preset's" in refused.output
    assert all(way in refused.output for way in ("kvrescue-local fit", "--prm", "--rule random"))
    assert CliRunner().invoke(main, [*args, "--rule", "random"]).exit_code == 0
    # one model of the toy's and one not: the toy's judge, thresholds and rule do not apply either
    mixed = CliRunner().invoke(main, [*args[:2], str(TOY / "base.gguf"), *args[3:]])
    assert mixed.exit_code != 0 and "--helper" in mixed.output and "judge was fitted for its own pair" in mixed.output
    # the toy's base with another helper and a judge given: the toy's prompt and windows serve, its fitted
    # thresholds (models/toy/detector.json) do not
    other = CliRunner().invoke(main, ["solve", "--helper", str(TOY / "prm.gguf"), "--prm", str(TOY / "prm.gguf"), "-n",
                                      "1", "-t", "1", "--json", str(tmp_path / "m.json"), problems(5000, 1)[0].text])
    assert other.exit_code == 0 and "the helper is not its: they do not apply" in other.output, other.output
    detector = json.loads((tmp_path / "m.json").read_text())["config"]["detector"]
    toy = json.loads((TOY / "detector.json").read_text())
    assert detector["tau_entropy"] == 3.0 != toy["tau_entropy"] and detector["entropy_window"] == toy["entropy_window"]
    # a server, whose requests may not need a judge, starts without one rather than with the toy's
    served = build_served(serve.make_context("serve", ["--preset", "toy", "-t", "1", "--base", str(base_path),
                                                       "--helper", str(helper_path)]).params)
    try:
        assert not served.has_prm
    finally:
        served.engine.close()


def test_fit_refuses_evaluation_problems_and_datasets_without_a_training_split(tmp_path):
    from kvrescue_local.bench.datasets import load_dataset

    held = load_dataset("gsm8k", split="eval", limit=1).problems[0]
    data = tmp_path / "mixed.jsonl"
    data.write_text(json.dumps({"id": "x", "problem": held.problem, "answer": held.answer}) + "\n")
    ran = CliRunner().invoke(main, fit_args(data, tmp_path / "out"))
    assert ran.exit_code != 0 and ran.output.startswith("Error: --data") and "evaluation problem" in ran.output
    toy = CliRunner().invoke(main, [*fit_args(data, tmp_path / "out")[:5], "--dataset", "toy", "--out", "o"])
    assert toy.exit_code != 0 and "has no training split" in toy.output


def rows(dataset: str, mode: str, budget: int, solved: int, count: int = 10) -> list[dict]:
    return [{"dataset": dataset, "id": str(i), "correct": i < solved,
             "config": {"mode": mode, "n": 1, "budget": budget, "policy": "rkv" if mode == "bon" else "none"}}
            for i in range(count)]


@pytest.mark.parametrize("helper_solved, rule", [(2, BASE_FIRST), (9, "by-budget:64,lead:helper")])
def test_a_pair_the_helper_cannot_help_is_told_so_and_gets_base_first(helper_solved, rule):
    said = []
    found = {Path("r.jsonl"): rows("d", "bon", 32, 5) + rows("d", "bon", 64, 6) + rows("d", "helper", 0, helper_solved)}
    fitted = fit_rules(found, {}, say=said.append)
    assert fitted["rule"].startswith(rule) and fitted["datasets"]["d"].startswith(rule)
    assert any("KV-Rescue will not beat best-of-N" in line for line in said) == (rule == BASE_FIRST)


def test_the_detector_statistics_of_a_problem_a_crash_cut_short_are_dropped_before_a_resume(tmp_path):
    from kvrescue_local.prmtrain.detector import collect, complete_lines

    line = {"dataset": "d", "setting": "full", "text": "x", "tokens": 9, "max_mean_entropy": 0.1, "min_compression": 0.5}
    whole = [json.dumps({**line, "id": "1", "candidates": 2})] * 2
    cut = [json.dumps({**line, "id": "2", "candidates": 3})] * 2  # one of its three lines never written
    stats = tmp_path / "detector.jsonl"
    stats.write_text("\n".join([*whole, *cut]) + '\n{"dataset": "d", "id": "3", "sett')
    assert complete_lines(stats) == (whole, {("d", "1", "full")})
    collect(None, {}, [], stats, 0)
    assert stats.read_text() == "".join(line + "\n" for line in whole)
