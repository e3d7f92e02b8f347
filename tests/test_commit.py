"""Commit rules (`--choice base-first | helper-first | calibrated | regime`): the picks, their parameters recorded
only where they matter, fitted on training problems only and stored with a preset; MATH500's split kept."""

import json

import pytest
from click.testing import CliRunner

from kvrescue_local.bench.datasets import load_dataset, split_of
from kvrescue_local.bench.results_file import read_rows
from kvrescue_local.cli import main
from kvrescue_local.errors import KVRescueError
from kvrescue_local.files import file_hash
from kvrescue_local.presets import preset_spec
from kvrescue_local.prmtrain.commit import fit
from kvrescue_local.rescue import RescueConfig
from kvrescue_local.rescue.generator import Draft
from kvrescue_local.rescue.loop import choose


def drafts(*pairs):
    return [Draft(side, i, -1, score=score) for i, (side, score) in enumerate(pairs)]


@pytest.mark.parametrize("choice, leader, other, margin", [("base-first", "base", "helper", "helper_margin"),
                                                         ("helper-first", "helper", "base", "base_margin")])
def test_a_leading_side_is_committed_unless_none_of_it_survives_or_the_other_wins_by_the_margin(choice, leader, other,
                                                                                                 margin):
    config = RescueConfig(n=2, choice=choice, **{margin: 0.05})
    round_ = drafts((leader, 0.40), (leader, 0.50), (other, 0.54), (other, 0.30))
    assert choose(round_, config, 0, 0) is round_[1], f"the {other}'s best is 0.04 above: within the margin"
    round_[3].score = 0.56
    assert choose(round_, config, 0, 0) is round_[3], f"0.06 above the {leader}'s best: over the margin"
    assert choose(round_[2:], config, 0, 0) is round_[3], f"no {leader} candidate survives"
    assert choose(round_, RescueConfig(n=2, choice=choice, **{margin: 1.0}), 0, 0) is round_[1]
    assert choose(round_, RescueConfig(n=2, choice="prm"), 0, 0) is round_[3]
    with pytest.raises(KVRescueError, match=f"--{margin.replace('_', '-')} must be in"):
        RescueConfig(**{margin: 1.5})


def test_the_calibrated_rule_picks_the_survivor_most_probably_right():
    round_ = drafts(("base", 0.50), ("helper", 0.60))
    # the helper's rewards run high: its 0.60 is less probably right than the base's 0.50
    calibrated = RescueConfig(n=1, choice="calibrated", calibration=(4.0, 0.0, 4.0, -1.0))
    assert choose(round_, calibrated, 0, 0) is round_[0]
    assert choose(round_, RescueConfig(n=1, choice="calibrated"), 0, 0) is round_[1], "the identity: the favourite"
    with pytest.raises(KVRescueError, match="four finite numbers"):
        RescueConfig(calibration=(1.0, 0.0))


def test_math500_train_and_eval_positions_are_disjoint_and_100_to_249_in_neither():
    train, evaluation = load_dataset("math500", split="train"), load_dataset("math500", split="eval")
    everything = load_dataset("math500").problems
    assert [p.id for p in train.problems] == [p.id for p in everything[250:]]
    assert [p.id for p in evaluation.problems] == [p.id for p in everything[:100]]
    assert not {p.id for p in train.problems} & {p.id for p in evaluation.problems}
    assert {split_of("math500", p.id) for p in everything[100:250]} == {None}


def row(problem_id, correct, rounds, mode="kvrescue"):
    """A results row whose rounds are (committed source, base reward, helper reward)."""
    steps = [{"round": i, "text": "x", "source": source, "score": base if source == "base" else helper,
              "finished": "step", "candidates": [{"side": "base", "text": "x", "score": base, "finished": "step"},
                                                 {"side": "helper", "text": "y", "score": helper, "finished": "step"}]}
             for i, (source, base, helper) in enumerate(rounds)]
    return {"dataset": "math500", "id": problem_id, "config_key": f"{mode}-b32-n1-rkv", "config": {"mode": mode},
            "correct": correct, "trajectory": {"steps": steps, "config": {"mode": mode}}}


def test_the_fit_reads_training_rows_only_and_learns_that_the_helper_misleads():
    ids = [p.id for p in load_dataset("math500", split="train").problems]
    rows = []
    for i, problem_id in enumerate(ids[:40]):
        helper_first = i % 2 == 0  # trajectories that committed the helper's confident steps end wrong
        rounds = [("helper", 0.5, 0.7), ("base", 0.55, 0.5)] if helper_first else [("base", 0.5, 0.6), ("base", 0.6, 0.5)]
        rows.append(row(problem_id, not helper_first, rounds))
    fitted = fit(rows, "rows")
    assert fitted.problems == 40 and fitted.rounds == 80 and fitted.steps == {"base": (60, 40), "helper": (20, 0)}
    base_slope, base_bias, helper_slope, helper_bias = fitted.calibration
    assert base_slope * 0.5 + base_bias > helper_slope * 0.7 + helper_bias, "the helper's high rewards mean less"
    assert fitted.helper_margin > 0.2, "the base's step is kept over every helper step the training rounds saw"
    evaluation = row(load_dataset("math500", split="eval").problems[0].id, True, [("base", 0.5, 0.6)])
    with pytest.raises(KVRescueError, match="is an evaluation problem"):
        fit([*rows, evaluation], "rows")
    with pytest.raises(KVRescueError, match="all come from trajectories that ended wrong"):
        fit([r for r in rows if not r["correct"]], "rows")
    scored_by = [{**r, "setup": {"models": {"prm": {"head_sha256": "head-a" if i else "head-b"}}}} for i, r in enumerate(rows)]
    with pytest.raises(KVRescueError, match="scored by 2 reward heads"):
        fit(scored_by, "rows")
    assert fit(scored_by[1:], "rows").head == "head-a" and fitted.head is None
    unscored = row(ids[40], True, [("base", None, None)])  # a random choice's row: nothing scored, no PRM recorded
    assert fit([*scored_by[1:], unscored], "rows").head == "head-a", "a row the fit does not read names no head"


def test_a_preset_carries_its_fitted_rule_and_rows_record_each_rules_parameters(base_path, helper_path, tiny_prm_path,
                                                                                tmp_path):
    (tmp_path / "preset.json").write_text(json.dumps({"recipe": {"pick_margin": 0.005}}))
    (tmp_path / "commit.json").write_text(json.dumps({"rule": {"helper_margin": 0.1, "calibration": [1, 0, 2, -1]},
                                                      "fit": {"problems": 3}}))
    recipe = preset_spec(tmp_path)["recipe"]
    assert RescueConfig().with_overrides(recipe).calibration == (1.0, 0.0, 2.0, -1.0)
    (tmp_path / "commit.json").write_text(json.dumps({"rule": {"margin": 0.1}}))
    with pytest.raises(KVRescueError, match="perf/fit_commit.py"):
        preset_spec(tmp_path)
    results = tmp_path / "rules.jsonl"
    args = ["bench", "run", "--dataset", "gsm8k", "--limit", "1", "--modes", "bon,kvrescue", "--budgets", "32",
            "--buffer", "16", "--max-tokens", "40", "--max-step-tokens", "16", "--ns", "1", "--base", str(base_path),
            "--helper", str(helper_path), "--prm", str(tiny_prm_path), "--results", str(results),
            "--choice", "prm,base-first,calibrated,random", "--helper-margin", "0.2"]
    ran = CliRunner().invoke(main, args)
    assert ran.exit_code == 0, ran.output
    settings = {r["config_key"]: r["setup"]["settings"] for r in read_rows(results)}
    recorded = {key: {k for k in ("pick_margin", "helper_margin", "calibration") if k in s} for key, s in settings.items()}
    assert recorded == {"bon-b32-n1-rkv": set(), "kvrescue-b32-n1-rkv": {"pick_margin"},
                        "kvrescue-b32-n1-rkv-base-first": {"pick_margin", "helper_margin"},
                        "kvrescue-b32-n1-rkv-calibrated": {"calibration"}, "kvrescue-b32-n1-rkv-random": set()}
    assert settings["kvrescue-b32-n1-rkv-base-first"]["helper_margin"] == 0.2
    report = CliRunner().invoke(main, ["report", str(results)])
    assert report.exit_code == 0 and "kvrescue/base-first" in report.output, report.output
    assert "kvrescue/base-first b32 n1 rkv vs bon b32 n1 rkv, on the 1 problems both ran" in report.output
    assert "kvrescue/base-first b32 n1 rkv vs the judge's pick, kvrescue b32 n1 rkv, on the 1 problems" in report.output
    assert "kvrescue/random b32 n1 rkv vs the judge's pick" not in report.output, "random has its own line"
    assert "helper kills" not in report.output, "no row watched the helper: no such column"
    watched = tmp_path / "watched.jsonl"
    ran = CliRunner().invoke(main, [*args[:args.index("--results") + 1], str(watched), "--choice", "base-first",
                                    "--helper-tau-entropy", "50", "--helper-tau-compression", "0.35"])
    assert ran.exit_code == 0, ran.output
    assert read_rows(watched)[-1]["setup"]["settings"]["helper_tau_compression"] == 0.35
    assert "helper kills" in CliRunner().invoke(main, ["report", str(watched)]).output
    resumed = CliRunner().invoke(main, [*args[:-1], "0.3", "--resume"])
    assert resumed.exit_code != 0 and "helper_margin 0.2 vs 0.3" in resumed.output, resumed.output


def test_a_calibration_is_read_only_with_the_head_it_was_fitted_on(tmp_path, monkeypatch):
    """A preset's dataset calibration names its head (commit.json's fit); a sweep whose rule would commit by it with
    another head is one Error line before any model loads, and runs with the fitted head, at a budget where the rule
    reads no calibration, or where one side's candidates alone are chosen between."""
    import dataclasses
    import importlib

    import numpy as np

    from kvrescue_local import presets
    from kvrescue_local.prm import RewardHead, head_path

    (tmp_path / "preset.json").write_text("{}")
    commit = {"rule": {}, "datasets": {"gsm8k": {"calibration": [1, 0, 2, -1]}, "math500": {"choice": "regime"}},
              "fit": {"calibration": {"gsm8k": {"head_sha256": "0123456789abcdef"}, "math500": {"head_sha256": "x"}}}}
    (tmp_path / "commit.json").write_text(json.dumps(commit))
    assert preset_spec(tmp_path)["calibration_heads"] == {"gsm8k": "0123456789abcdef"}, "only a calibration's head"
    commit["fit"]["calibration"]["gsm8k"]["head_sha256"] = 7
    (tmp_path / "commit.json").write_text(json.dumps(commit))
    with pytest.raises(KVRescueError, match="perf/fit_commit.py"):
        preset_spec(tmp_path)
    toy = presets.load_preset("toy")
    fitted = head_path(toy.prm)
    calibration = [2.0, -1.0, 1.0, 0.0]
    monkeypatch.setitem(presets.PRESETS, "toy", lambda: dataclasses.replace(toy, dataset_recipes={"toy": {
        "choice": "regime", "judge_max_budget": 32, "weak_base_choice": "calibrated", "calibration": calibration}},
        calibration_heads={"toy": file_hash(fitted)}))
    other = RewardHead.load(fitted)
    other = dataclasses.replace(other, weights=[w + np.float32(0.5) for w in other.weights]).save(tmp_path / "o.npz")
    args = ["bench", "run", "--dataset", "toy", "--preset", "toy", "--limit", "1", "--ns", "1", "--max-tokens", "40",
            "--max-step-tokens", "16"]
    with_other = ["--prm", f"{toy.prm}:{other}"]
    bench = importlib.import_module("kvrescue_local.cli.bench")  # the module, not the `bench` command group
    opened = bench.open_models

    def refused_before_loading(*_args, **_kwargs):
        raise AssertionError("a model was opened")

    monkeypatch.setattr(bench, "open_models", refused_before_loading)
    refused = CliRunner().invoke(main, [*args, *with_other, "--modes", "kvrescue", "--budgets", "32,64", "--results",
                                        str(tmp_path / "r.jsonl")])
    errors = [line for line in refused.output.splitlines() if line.startswith("Error:")]
    assert refused.exit_code == 1 and len(errors) == 1 and "Traceback" not in refused.output, refused.output
    assert f"head {file_hash(fitted)[:8]}" in errors[0] and f"{other} ({file_hash(other)[:8]})" in errors[0]
    assert "--choice regime at budget 32" in errors[0] and "--choice prm" in errors[0]
    monkeypatch.setattr(bench, "open_models", opened)
    for results, given in (("fitted.jsonl", ["--modes", "kvrescue", "--budgets", "32"]),
                           ("above.jsonl", [*with_other, "--modes", "kvrescue", "--budgets", "64"]),
                           ("prm.jsonl", [*with_other, "--modes", "kvrescue", "--budgets", "32", "--choice", "prm"]),
                           ("bon.jsonl", [*with_other, "--modes", "bon", "--budgets", "32", "--ns", "2"])):
        ran = CliRunner().invoke(main, [*args, *given, "--results", str(tmp_path / results)])
        assert ran.exit_code == 0, ran.output
    row, = read_rows(tmp_path / "fitted.jsonl")
    assert row["config"]["choice"] == "regime" and row["setup"]["settings"]["calibration"] == calibration
    assert row["setup"]["models"]["prm"]["head_sha256"] == file_hash(fitted)
    assert read_rows(tmp_path / "bon.jsonl")[0]["setup"]["models"]["prm"]["head_sha256"] == file_hash(other)


@pytest.mark.parametrize("choice", ["base-first", "calibrated"])
def test_a_rule_that_reads_rewards_loads_the_presets_prm_when_none_is_given(base_path, helper_path, choice):
    ran = CliRunner().invoke(main, ["solve", "--mode", "kvrescue", "-n", "1", "--budget", "32", "--buffer", "16",
                                    "--max-tokens", "40", "--base", str(base_path), "--helper", str(helper_path),
                                    "--choice", choice, "1+1?"])
    assert ran.exit_code == 0, ran.output


def test_the_regime_rule_is_the_judge_up_to_its_budget_and_base_first_above():
    from kvrescue_local.eviction import KVBudget

    round_ = drafts(("base", 0.40), ("helper", 0.60))
    small, large = (RescueConfig(n=1, choice="regime", judge_max_budget=32, kv=KVBudget(budget=b)) for b in (32, 64))
    assert (small.rule, large.rule) == ("prm", "base-first")
    assert choose(round_, small, 0, 0) is round_[1], "at 32 the judge's favourite, the helper's step"
    assert choose(round_, large, 0, 0) is round_[0], "at 64 the base's step"
    assert RescueConfig(choice="regime").rule == "base-first", "nothing fitted: the base's step first everywhere"
    assert RescueConfig(choice="random", judge_max_budget=512).rule == "random"
    led = RescueConfig(n=1, choice="regime", judge_max_budget=32, weak_base_choice="helper-first", kv=KVBudget(budget=32))
    assert led.rule == "helper-first" and choose(drafts(("base", 0.60), ("helper", 0.40)), led, 0, 0).side == "helper"
    with pytest.raises(KVRescueError, match="--judge-max-budget must be 0 or more"):
        RescueConfig(judge_max_budget=-1)
    with pytest.raises(KVRescueError, match="unknown weak-base choice 'random'"):
        RescueConfig(weak_base_choice="random")


def sweep_row(dataset, problem_id, mode, correct, budget=0, n=1, policy="rkv"):
    return {"dataset": dataset, "id": problem_id, "correct": correct,
            "config": {"mode": mode, "budget": budget, "n": n, "policy": policy if budget else "none"}}


def test_the_regime_budget_is_fitted_per_dataset_on_training_rows_where_the_evicted_base_is_the_weaker():
    from kvrescue_local.prmtrain.regime import default_rule, fit_regime

    math_ids = [p.id for p in load_dataset("math500", split="train").problems[:10]]
    rows = [sweep_row("math500", i, "helper", k < 3) for k, i in enumerate(math_ids)]
    rows += [sweep_row("math500", i, "bon", k < 1, 32) for k, i in enumerate(math_ids)]  # 1 against the helper's 3
    rows += [sweep_row("math500", i, "bon", k < 3, 64) for k, i in enumerate(math_ids)]  # a tie: the base's step first
    rows += [sweep_row("math500", i, "bon", k < 1, 128) for k, i in enumerate(math_ids)]  # not reached past 64's tie
    rows += [sweep_row("math500", i, "bon", True, 64, n=4) for i in math_ids]  # N = 4: not the rule's evidence
    rows += [sweep_row("gsm8k", str(i), "helper", i < 4) for i in range(10)]
    rows += [sweep_row("gsm8k", str(i), "bon", i < 2, 64) for i in range(10)]
    rows += [sweep_row("gsm8k", str(i), "bon", i < 6, 128) for i in range(10)]
    fits = {f.dataset: f for f in fit_regime(rows, "rows", judged={"gsm8k"}, calibrated={"gsm8k"})}
    assert {d: f.judge_max_budget for d, f in fits.items()} == {"gsm8k": 64, "math500": 32}
    assert [(s.budget, s.problems, s.evicted, s.helper) for s in fits["math500"].scores] == [
        (32, 10, 1, 3), (64, 10, 3, 3), (128, 10, 1, 3)]
    # the judge was trained and calibrated on GSM8K's steps, not MATH500's: there the helper, the stronger writer, leads
    assert {d: f.weak_base_choice for d, f in fits.items()} == {"gsm8k": "calibrated", "math500": "helper-first"}
    assert default_rule(f.rule() for f in fits.values()) == {
        "choice": "regime", "judge_max_budget": 32, "weak_base_choice": "helper-first"}
    assert default_rule([fits["gsm8k"].rule()])["weak_base_choice"] == "helper-first", "no dataset: no calibration"
    assert {f.weak_base_choice for f in fit_regime(rows, "rows")} == {"helper-first"}, "no judge rows: no dataset judged"
    uncalibrated = {f.weak_base_choice for f in fit_regime(rows, "rows", {"gsm8k", "math500"})}
    assert uncalibrated == {"helper-first"}, "a judge trained on a dataset's steps picks there once calibrated on it"
    calibrated = {f.dataset: f.weak_base_choice for f in fit_regime(rows, "rows", {"gsm8k"}, calibrated={"gsm8k", "math500"})}
    assert calibrated == {"gsm8k": "calibrated", "math500": "helper-first"}, "a calibration serves a judged dataset only"
    stronger = [r for r in rows if not (r["dataset"] == "math500" and r["config"]["budget"] == 32)]
    assert {f.dataset: f.judge_max_budget for f in fit_regime(stronger, "rows")}["math500"] == 0
    with pytest.raises(KVRescueError, match="is an evaluation problem"):
        fit_regime([*rows, sweep_row("gsm8k", "950", "helper", True)], "rows")
    with pytest.raises(KVRescueError, match="no dataset has both"):
        fit_regime([r for r in rows if r["config"]["mode"] != "helper"], "rows")
    with pytest.raises(KVRescueError, match="evict by 2 policies"):
        fit_regime([*rows, sweep_row("gsm8k", "1", "bon", True, 64, policy="snapkv")], "rows")


def test_a_preset_holds_a_rule_per_dataset_and_the_regime_rule_runs_the_judge_or_base_first_by_budget(
        base_path, helper_path, tiny_prm_path, tmp_path):
    from kvrescue_local.compose import preset_config
    from kvrescue_local.presets import Preset

    (tmp_path / "preset.json").write_text(json.dumps({"recipe": {"pick_margin": 0.005}}))
    (tmp_path / "commit.json").write_text(json.dumps({
        "rule": {"choice": "regime", "judge_max_budget": 32},
        "datasets": {"gsm8k": {"choice": "regime", "judge_max_budget": 64}}}))
    preset = Preset("p", base_path, helper_path, tiny_prm_path, **preset_spec(tmp_path))
    assert [preset_config(preset, d).judge_max_budget for d in (None, "math500", "gsm8k")] == [32, 32, 64]
    assert preset_config(preset, "gsm8k", judge_max_budget=16).judge_max_budget == 16, "the command line wins"
    (tmp_path / "commit.json").write_text(json.dumps({"rule": {}, "datasets": {"gsm8k": {"budget": 3}}}))
    with pytest.raises(KVRescueError, match="perf/fit_commit.py"):
        preset_spec(tmp_path)
    results = tmp_path / "regime.jsonl"
    ran = CliRunner().invoke(main, [
        "bench", "run", "--dataset", "toy", "--preset", "toy", "--limit", "2", "--modes", "kvrescue", "--ns", "1",
        "--budgets", "32,64", "--results", str(results), "--choice", "prm,base-first,helper-first,regime",
        "--judge-max-budget", "32"])
    assert ran.exit_code == 0, ran.output
    led = tmp_path / "led.jsonl"
    ran = CliRunner().invoke(main, [
        "bench", "run", "--dataset", "toy", "--preset", "toy", "--limit", "2", "--modes", "kvrescue", "--ns", "1",
        "--budgets", "32", "--results", str(led), "--choice", "regime", "--judge-max-budget", "32",
        "--weak-base-choice", "helper-first"])
    assert ran.exit_code == 0, ran.output
    sources, led_sources = ({(r["id"], r["config_key"]): "".join(s["source"][0] for s in r["trajectory"]["steps"])
                             for r in read_rows(path)} for path in (results, led))
    settings = {r["config_key"]: r["setup"]["settings"] for r in read_rows(results)}
    assert settings["kvrescue-b64-n1-rkv-regime"]["judge_max_budget"] == 32
    assert settings["kvrescue-b32-n1-rkv-helper-first"]["base_margin"] == 1.0
    assert "judge_max_budget" not in settings["kvrescue-b64-n1-rkv-base-first"]
    assert read_rows(led)[0]["setup"]["settings"]["weak_base_choice"] == "helper-first"
    for problem in ("toy-0", "toy-1"):
        helper_led = sources[problem, "kvrescue-b32-n1-rkv-helper-first"]
        assert set(helper_led) == {"h"}, "no helper candidate died: every step is the helper's"
        assert led_sources[problem, "kvrescue-b32-n1-rkv-regime"] == helper_led
    for problem in ("toy-0", "toy-1"):
        assert sources[problem, "kvrescue-b32-n1-rkv-regime"] == sources[problem, "kvrescue-b32-n1-rkv"]
        assert sources[problem, "kvrescue-b64-n1-rkv-regime"] == sources[problem, "kvrescue-b64-n1-rkv-base-first"]
        # the two rules commit other sources on these problems (b: base, h: helper), so the agreement says which ran
        assert sources[problem, "kvrescue-b32-n1-rkv"] != sources[problem, "kvrescue-b32-n1-rkv-base-first"]
        assert sources[problem, "kvrescue-b64-n1-rkv"] != sources[problem, "kvrescue-b64-n1-rkv-base-first"]


def test_the_shipped_regime_rules_are_refitted_from_the_committed_training_rows(tmp_path):
    """perf/fit_commit.py on the committed training rows writes the coder preset's commit.json again; evaluation rows
    and rows with nothing to fit are one Error line each."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = [sys.executable, str(root / "perf/fit_commit.py")]
    training = [str(root / f"results/{name}.jsonl.zst")
                for name in ("coder-math500-train-regime", "coder-gsm8k-n1", "coder-gsm8k-train120-both64")]
    judged = [str(root / f"results/{name}.jsonl.zst")  # the rollouts the shipped head was trained on
              for name in ("coder-gsm8k-n1", "coder-math500-train-full", "coder-math500-train-regime")]
    ran = subprocess.run([*script, *training, "--judge-rows", *judged, "--write", str(tmp_path / "commit.json")],
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    shipped = json.loads((root / "models/coder/commit.json").read_text())
    refitted = json.loads((tmp_path / "commit.json").read_text())
    assert (refitted["rule"], refitted["datasets"]) == (shipped["rule"], shipped["datasets"])
    # a calibration maps one head's rewards: the shipped ones were fitted on rows the shipped head scored
    head = file_hash(root / "models/coder/helper.head.npz")
    assert {fit["head_sha256"] for fit in shipped["fit"]["calibration"].values()} == {head}
    assert refitted["fit"]["calibration"] == shipped["fit"]["calibration"]
    assert "math500: helper-first up to budget 32" in ran.stdout and "gsm8k: calibrated up to budget 64" in ran.stdout
    for rows, says in ((root / "results/coder-gsm8k-regime.jsonl.zst", "is an evaluation problem"),
                       (root / "results/coder-math500-train-prm32.jsonl", "all come from trajectories that ended wrong")):
        failed = subprocess.run([*script, str(rows)], capture_output=True, text=True)
        errors = [line for line in failed.stderr.splitlines() if line.startswith("Error:")]
        assert failed.returncode == 1 and len(errors) == 1 and says in errors[0], failed.stderr
        assert "Traceback" not in failed.stderr
    # KV-Rescue rows of MATH500's training problems: a calibration for MATH500 alone, and where the judge's training
    # steps were MATH500's, its weak-base rule is calibrated; GSM8K's, with no KV-Rescue rows of its own here to
    # calibrate the judge on, is the helper's step first, and so is the rule's, which stays uncalibrated
    ids = [p.id for p in load_dataset("math500", split="train").problems[:20]]
    kvrescue = tmp_path / "kvrescue.jsonl"
    kvrescue.write_text("".join(json.dumps(row(i, k % 2 == 0, [("base", 0.5, 0.6), ("helper", 0.4, 0.7)])) + "\n"
                                for k, i in enumerate(ids)))
    judge_rows = tmp_path / "judge.jsonl"
    judge_rows.write_text("".join(json.dumps(r) + "\n" for r in read_rows(Path(training[1])) + read_rows(Path(training[0]))))
    ran = subprocess.run([*script, *training[:2], str(kvrescue), "--judge-rows", str(judge_rows),
                          "--write", str(tmp_path / "calibrated.json")], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    fitted = json.loads((tmp_path / "calibrated.json").read_text())
    assert fitted["datasets"]["math500"]["weak_base_choice"] == "calibrated"
    assert len(fitted["datasets"]["math500"]["calibration"]) == 4 and "helper_margin" in fitted["datasets"]["math500"]
    assert fitted["datasets"]["gsm8k"]["weak_base_choice"] == "helper-first"
    assert "calibration" not in fitted["datasets"]["gsm8k"]
    assert "calibration" not in fitted["rule"] and fitted["rule"]["weak_base_choice"] == "helper-first"
    assert fitted["fit"]["calibration"]["math500"]["rows"] == ["kvrescue.jsonl"]
    for missing in ([str(tmp_path / "nope.jsonl")], [*training, "--judge-rows", str(tmp_path / "nope.jsonl")]):
        failed = subprocess.run([*script, *missing], capture_output=True, text=True)
        assert failed.returncode == 1 and failed.stderr.startswith("Error:") and "nope.jsonl holds no rows" in failed.stderr
        assert "Traceback" not in failed.stderr
    helper_only = tmp_path / "helper.jsonl"
    helper_only.write_text("".join(json.dumps(r) + "\n" for r in read_rows(Path(training[1]))
                                   if r["config"]["mode"] == "helper"))
    failed = subprocess.run([*script, str(helper_only)], capture_output=True, text=True)
    assert failed.returncode == 1 and "no KV-Rescue or evicted best-of-N rows" in failed.stderr, failed.stderr


def test_rows_from_before_the_weak_base_rule_was_recorded_resume_and_merge_only_with_the_judges_pick(tmp_path):
    """Regime rows written before the weak-base rule was a setting ran the judge's pick: resuming or merging them with
    rows of another rule is refused, naming both; with the judge's pick they resume. The toy preset, two problems."""
    def sweep(results, rule, limit="1"):
        return CliRunner().invoke(main, [
            "bench", "run", "--dataset", "toy", "--preset", "toy", "--limit", limit, "--modes", "full,kvrescue",
            "--ns", "1", "--budgets", "32", "--results", str(results), "--choice", "regime", "--judge-max-budget",
            "32", "--weak-base-choice", rule, "--resume"])

    old = tmp_path / "old.jsonl"
    assert sweep(old, "prm").exit_code == 0
    rows = read_rows(old)
    for row in rows:
        row["setup"]["settings"].pop("weak_base_choice", None)
    old.write_text("".join(json.dumps(r) + "\n" for r in rows))
    refused = sweep(old, "calibrated", limit="2")
    assert refused.exit_code != 0 and "weak_base_choice 'prm' vs 'calibrated'" in refused.output, refused.output
    assert len(read_rows(old)) == len(rows), "nothing written"
    resumed = sweep(old, "prm", limit="2")
    assert resumed.exit_code == 0, resumed.output
    assert len(read_rows(old)) == 2 * len(rows)
    new = tmp_path / "new.jsonl"
    assert sweep(new, "calibrated").exit_code == 0
    merged = CliRunner().invoke(main, ["bench", "merge", str(old), str(new), "--out", str(tmp_path / "m.jsonl")])
    assert merged.exit_code != 0 and "weak_base_choice" in merged.output, merged.output
