"""Commit rules as specs (`--rule lead:base | lead:helper | calibrated | by-budget | arith:...`): the picks, their
specs recorded only where a judge scores for them, fitted on training problems only and stored with a preset;
MATH500's split kept."""

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
from kvrescue_local.rescue.rules import parse_rule


def drafts(*pairs):
    return [Draft(side, i, -1, score=score) for i, (side, score) in enumerate(pairs)]


def choose(round_, spec, budget=0):
    return parse_rule(spec).at_budget(budget).choose(round_, (0, 0, 0))


@pytest.mark.parametrize("leader, other", [("base", "helper"), ("helper", "base")])
def test_a_leading_side_is_committed_unless_none_of_it_survives_or_the_other_wins_by_the_margin(leader, other):
    rule = f"lead:{leader},margin=0.05"
    round_ = drafts((leader, 0.40), (leader, 0.50), (other, 0.54), (other, 0.30))
    assert choose(round_, rule) is round_[1], f"the {other}'s best is 0.04 above: within the margin"
    round_[3].score = 0.56
    assert choose(round_, rule) is round_[3], f"0.06 above the {leader}'s best: over the margin"
    assert choose(round_[2:], rule) is round_[3], f"no {leader} candidate survives"
    assert choose(round_, f"lead:{leader}") is round_[1], "margin 1 by default: only when none survives"
    assert choose(round_, "judge") is round_[3]
    with pytest.raises(KVRescueError, match="lead's margin must be in"):
        RescueConfig(rule=f"lead:{leader},margin=1.5")


def test_the_calibrated_rule_picks_the_survivor_most_probably_right():
    round_ = drafts(("base", 0.50), ("helper", 0.60))
    # the helper's rewards run high: its 0.60 is less probably right than the base's 0.50
    assert choose(round_, "calibrated:4,0,4,-1") is round_[0]
    assert choose(round_, "calibrated:1,0,1,0") is round_[1], "the identity: the favourite"
    with pytest.raises(KVRescueError, match="four numbers"):
        RescueConfig(rule="calibrated:1,0")
    with pytest.raises(KVRescueError, match="must be finite"):
        RescueConfig(rule="calibrated:1,0,nan,0")


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


def test_a_preset_carries_its_fitted_rule_and_rows_record_each_rules_spec(base_path, helper_path, tiny_prm_path,
                                                                          tmp_path):
    (tmp_path / "preset.json").write_text("{}")
    (tmp_path / "commit.json").write_text(json.dumps({"rule": "lead:base,margin=0.1", "fit": {"problems": 3}}))
    assert RescueConfig().with_overrides(preset_spec(tmp_path)["recipe"]).rule == parse_rule("lead:base,margin=0.1")
    (tmp_path / "commit.json").write_text(json.dumps({"rule": {"helper_margin": 0.1}}))
    with pytest.raises(KVRescueError, match="kvrescue-local fit"):
        preset_spec(tmp_path)
    results = tmp_path / "rules.jsonl"
    args = ["bench", "run", "--dataset", "gsm8k", "--limit", "1", "--modes", "bon,kvrescue", "--budgets", "32",
            "--buffer", "16", "--max-tokens", "40", "--max-step-tokens", "16", "--ns", "1", "--base", str(base_path),
            "--helper", str(helper_path), "--prm", str(tiny_prm_path), "--results", str(results),
            "--rule", "judge:margin=0.005", "--rule", "calibrated:1,0,2,-1", "--rule", "random",
            "--rule", "lead:base,margin=0.2"]
    ran = CliRunner().invoke(main, args)
    assert ran.exit_code == 0, ran.output
    rows = read_rows(results)
    recorded = {r["config_key"]: r["setup"]["settings"].get("rule") for r in rows}
    assert recorded == {"bon-b32-n1-rkv": None, "kvrescue-b32-n1-rkv": "judge:margin=0.005",
                        "kvrescue-b32-n1-rkv-base-first": "lead:base,margin=0.2",
                        "kvrescue-b32-n1-rkv-calibrated": "calibrated:1,0,2,-1", "kvrescue-b32-n1-rkv-random": None}
    assert {r["config_key"]: r["config"]["rule"] for r in rows}["kvrescue-b32-n1-rkv-random"] == "random"
    report = CliRunner().invoke(main, ["report", str(results)])
    assert report.exit_code == 0 and "kvrescue/base-first" in report.output, report.output
    assert "kvrescue/base-first b32 n1 rkv vs bon b32 n1 rkv, on the 1 problems both ran" in report.output
    assert "kvrescue/base-first b32 n1 rkv vs the judge's pick, kvrescue b32 n1 rkv, on the 1 problems" in report.output
    assert "kvrescue/random b32 n1 rkv vs the judge's pick" not in report.output, "random has its own line"
    assert "helper kills" not in report.output, "no row watched the helper: no such column"
    watched = tmp_path / "watched.jsonl"
    ran = CliRunner().invoke(main, [*args[:args.index("--results") + 1], str(watched), "--rule", "lead:base",
                                    "--helper-tau-entropy", "50", "--helper-tau-compression", "0.35"])
    assert ran.exit_code == 0, ran.output
    assert read_rows(watched)[-1]["setup"]["settings"]["helper_tau_compression"] == 0.35
    assert "helper kills" in CliRunner().invoke(main, ["report", str(watched)]).output
    resumed = CliRunner().invoke(main, [*args[:-1], "lead:base,margin=0.3", "--resume"])
    assert resumed.exit_code != 0 and "rule 'lead:base,margin=0.2' vs 'lead:base,margin=0.3'" in resumed.output, \
        resumed.output
    assert CliRunner().invoke(main, [*args[:-2], "--resume"]).exit_code == 0, "a sweep of fewer rules resumes"


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
    commit = {"rule": "judge", "datasets": {"gsm8k": "by-budget:32,calibrated:1,0,2,-1,lead:base",
                                            "math500": "by-budget:32,judge,lead:base"},
              "fit": {"calibration": {"gsm8k": {"head_sha256": "0123456789abcdef"}, "math500": {"head_sha256": "x"}}}}
    (tmp_path / "commit.json").write_text(json.dumps(commit))
    assert preset_spec(tmp_path)["calibration_heads"] == {"gsm8k": "0123456789abcdef"}, "only a calibration's head"
    commit["fit"]["calibration"]["gsm8k"]["head_sha256"] = 7
    (tmp_path / "commit.json").write_text(json.dumps(commit))
    with pytest.raises(KVRescueError, match="kvrescue-local fit"):
        preset_spec(tmp_path)
    toy = presets.load_preset("toy")
    fitted = head_path(toy.prm)
    spec = "by-budget:32,calibrated:2,-1,1,0,lead:base"
    monkeypatch.setitem(presets.PRESETS, "toy", lambda: dataclasses.replace(toy, dataset_recipes={"toy": {"rule": spec}},
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
    assert f"--rule {spec} at budget 32" in errors[0] and "a --rule without calibrated" in errors[0]
    monkeypatch.setattr(bench, "open_models", opened)
    for results, given in (("fitted.jsonl", ["--modes", "kvrescue", "--budgets", "32"]),
                           ("above.jsonl", [*with_other, "--modes", "kvrescue", "--budgets", "64"]),
                           ("prm.jsonl", [*with_other, "--modes", "kvrescue", "--budgets", "32", "--rule", "judge"]),
                           ("bon.jsonl", [*with_other, "--modes", "bon", "--budgets", "32", "--ns", "2"])):
        ran = CliRunner().invoke(main, [*args, *given, "--results", str(tmp_path / results)])
        assert ran.exit_code == 0, ran.output
    row, = read_rows(tmp_path / "fitted.jsonl")
    assert row["config"]["rule"] == spec and row["setup"]["settings"]["rule"] == spec and row["config_key"].endswith("regime")
    assert row["setup"]["models"]["prm"]["head_sha256"] == file_hash(fitted)
    assert read_rows(tmp_path / "bon.jsonl")[0]["setup"]["models"]["prm"]["head_sha256"] == file_hash(other)


@pytest.mark.parametrize("rule", ["lead:base", "calibrated:1,0,1,0"])
def test_a_rule_that_reads_rewards_loads_the_presets_prm_for_its_own_pair_only(base_path, helper_path, rule):
    solve = ["solve", "--mode", "kvrescue", "-n", "1", "--budget", "32", "--buffer", "16", "--max-tokens", "40",
             "--rule", rule, "1+1?"]
    ran = CliRunner().invoke(main, solve)
    assert ran.exit_code == 0, ran.output
    assert f"rule: {rule} (--rule)" in ran.output
    other = CliRunner().invoke(main, [*solve, "--base", str(base_path), "--helper", str(helper_path)])
    assert other.exit_code != 0 and other.output.startswith("Error: --base") and "--prm" in other.output


def test_the_rule_by_budget_is_its_first_rule_up_to_its_budget_and_its_second_above():
    round_ = drafts(("base", 0.40), ("helper", 0.60))
    rule = parse_rule("by-budget:32,judge,lead:base")
    assert (rule.at_budget(32).spec, rule.at_budget(64).spec) == ("judge", "lead:base")
    assert choose(round_, rule.spec, 32) is round_[1], "at 32 the judge's favourite, the helper's step"
    assert choose(round_, rule.spec, 64) is round_[0], "at 64 the base's step"
    assert parse_rule("by-budget:0,judge,lead:base").at_budget(1).spec == "lead:base", "0: the second everywhere"
    led = parse_rule("by-budget:32,lead:helper,lead:base")
    assert led.at_budget(32).choose(drafts(("base", 0.60), ("helper", 0.40)), (0, 0, 0)).side == "helper"
    nested = parse_rule("arith:by-budget:32,by-budget:16,random,judge,lead:base,margin=0")
    assert [nested.at_budget(b).spec for b in (16, 32, 64)] == ["arith:random", "arith:judge", "arith:lead:base,margin=0"]
    assert nested.key_name == "regime" and nested.checks_arithmetic and nested.needs_judge
    assert not parse_rule("by-budget:32,random,random").needs_judge
    with pytest.raises(KVRescueError, match="by-budget's budget is 0 or more"):
        RescueConfig(rule="by-budget:-1,judge,judge")
    with pytest.raises(KVRescueError, match="unknown rule 'prm'"):
        RescueConfig(rule="by-budget:32,prm,judge")


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
    assert default_rule(f.rule() for f in fits.values()) == {"judge_max_budget": 32, "weak_base_choice": "helper-first"}
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


def test_a_preset_holds_a_rule_per_dataset_and_the_rule_by_budget_runs_the_judge_or_the_base_first(
        base_path, helper_path, tiny_prm_path, tmp_path):
    from kvrescue_local.compose import preset_config
    from kvrescue_local.presets import Preset

    (tmp_path / "preset.json").write_text("{}")
    (tmp_path / "commit.json").write_text(json.dumps({
        "rule": "by-budget:32,judge,lead:base", "datasets": {"gsm8k": "by-budget:64,calibrated:1,0,2,-1,lead:base"}}))
    preset = Preset("p", base_path, helper_path, tiny_prm_path, **preset_spec(tmp_path))
    assert [preset_config(preset, d).rule.budget for d in (None, "math500", "gsm8k")] == [32, 32, 64]
    assert preset_config(preset, "gsm8k", rule="judge").rule.spec == "judge", "the command line wins"
    assert preset_config(preset, "gsm8k", rule="calibrated").rule.spec == "calibrated:1,0,2,-1", \
        "a calibrated rule without numbers takes the preset's for the dataset"
    assert preset_config(preset, None, rule="calibrated").rule.spec == "calibrated", "none fitted: as given"
    (tmp_path / "commit.json").write_text(json.dumps({"rule": "judge", "datasets": {"gsm8k": "by-budget:3"}}))
    with pytest.raises(KVRescueError, match="kvrescue-local fit"):
        preset_spec(tmp_path)
    results = tmp_path / "regime.jsonl"
    sweep = ["bench", "run", "--dataset", "toy", "--preset", "toy", "--limit", "2", "--modes", "kvrescue", "--ns", "1"]
    ran = CliRunner().invoke(main, [*sweep, "--budgets", "32,64", "--results", str(results), "--rule", "judge",
                                    "--rule", "lead:base", "--rule", "lead:helper", "--rule", "by-budget:32,judge,lead:base"])
    assert ran.exit_code == 0, ran.output
    assert ran.output.count("rule: by-budget:32,judge,lead:base (--rule)") == 1, "said once"
    led = tmp_path / "led.jsonl"
    ran = CliRunner().invoke(main, [*sweep, "--budgets", "32", "--results", str(led),
                                    "--rule", "by-budget:32,lead:helper,lead:base"])
    assert ran.exit_code == 0, ran.output
    sources, led_sources = ({(r["id"], r["config_key"]): "".join(s["source"][0] for s in r["trajectory"]["steps"])
                             for r in read_rows(path)} for path in (results, led))
    settings = {r["config_key"]: r["setup"]["settings"] for r in read_rows(results)}
    assert settings["kvrescue-b64-n1-rkv-regime"]["rule"] == "by-budget:32,judge,lead:base"
    assert settings["kvrescue-b32-n1-rkv-helper-first"]["rule"] == "lead:helper"
    assert read_rows(led)[0]["setup"]["settings"]["rule"] == "by-budget:32,lead:helper,lead:base"
    for problem in ("toy-0", "toy-1"):
        helper_led = sources[problem, "kvrescue-b32-n1-rkv-helper-first"]
        assert set(helper_led) == {"h"}, "no helper candidate died: every step is the helper's"
        assert led_sources[problem, "kvrescue-b32-n1-rkv-regime"] == helper_led
    for problem in ("toy-0", "toy-1"):  # the composition's trajectory is its part's at each budget
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
    math500, gsm8k = (parse_rule(fitted["datasets"][d]) for d in ("math500", "gsm8k"))
    assert math500.up_to.name == "calibrated" and len(math500.up_to.fit) == 4 and math500.above.name == "lead"
    assert gsm8k.up_to.spec == "lead:helper,pick=0.005" and "calibrated" not in fitted["datasets"]["gsm8k"]
    assert "calibrated" not in fitted["rule"] and parse_rule(fitted["rule"]).up_to.spec == "lead:helper,pick=0.005"
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


OLD_ROWS = [  # the rule fields of rows written before rules were specs, and the spec each reads as
    ({"choice": "prm", "pick_margin": 0.005}, "judge:margin=0.005"),
    ({}, "judge"),
    ({"choice": "random"}, "random"),
    ({"choice": "base-first", "pick_margin": 0.005, "helper_margin": 1.0, "judge_max_budget": 0}, "lead:base,pick=0.005"),
    ({"choice": "helper-first", "base_margin": 0.3}, "lead:helper,margin=0.3"),
    ({"choice": "calibrated", "calibration": [2.0, -1.0, 1.0, 0.0]}, "calibrated:2,-1,1,0"),
    ({"choice": "regime", "pick_margin": 0.005, "helper_margin": 1.0, "judge_max_budget": 64},
     "by-budget:64,judge:margin=0.005,lead:base,pick=0.005"),
    ({"choice": "regime", "pick_margin": 0.005, "helper_margin": 0.0, "base_margin": 1.0, "judge_max_budget": 64,
      "calibration": [1.5, -2.0, 2.5, -3.0], "weak_base_choice": "calibrated", "check_arithmetic": True},
     "arith:by-budget:64,calibrated:1.5,-2,2.5,-3,lead:base,margin=0,pick=0.005"),
    ({"choice": "regime", "judge_max_budget": 32, "weak_base_choice": "helper-first", "check_arithmetic": False},
     "by-budget:32,lead:helper,lead:base"),
]


@pytest.mark.parametrize("fields, spec", OLD_ROWS)
def test_a_row_written_before_rules_were_specs_reads_as_its_rule(fields, spec):
    from kvrescue_local.bench.results_file import upgrade

    row = {"config": {"mode": "kvrescue", "n": 1, "budget": 32, **fields},
           "setup": {"settings": {"seed": 0, **{k: v for k, v in fields.items() if k not in ("choice", "check_arithmetic")}}}}
    upgraded = upgrade(row)
    assert upgraded["config"]["rule"] == spec and not set(fields) & set(upgraded["config"])
    assert upgraded["setup"]["settings"].get("rule") == (None if spec == "random" else spec)
    assert not set(fields) & set(upgraded["setup"]["settings"])


def test_rows_written_before_rules_were_specs_resume_and_merge_with_the_rule_they_ran(tmp_path):
    """Rows of the old fields (a by-budget rule written as choice regime with judge_max_budget, and no
    weak_base_choice, from before that was recorded: the judge's pick) resume under the spec they read as, and are
    refused, naming both specs, under another; merged with rows the spec wrote, they are one configuration."""
    def sweep(results, rule, limit="1"):
        return CliRunner().invoke(main, [
            "bench", "run", "--dataset", "toy", "--preset", "toy", "--limit", limit, "--modes", "full,kvrescue",
            "--ns", "1", "--budgets", "32", "--results", str(results), "--rule", rule, "--resume"])

    old = tmp_path / "old.jsonl"
    assert sweep(old, "by-budget:32,judge,lead:base").exit_code == 0
    rows = [json.loads(line) for line in old.read_text().splitlines()]
    for row in rows:  # as the version before rule specs wrote them
        row["config"].pop("rule")
        row["config"].update({"choice": "regime" if row["config"]["mode"] == "kvrescue" else "prm",
                              "check_arithmetic": False})
        if row["setup"]["settings"].pop("rule", None):
            row["config"].update({"pick_margin": 0.0, "helper_margin": 1.0, "judge_max_budget": 32})
            row["setup"]["settings"].update({"pick_margin": 0.0, "helper_margin": 1.0, "judge_max_budget": 32})
    old.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert {r["config"]["rule"] for r in read_rows(old)} == {"judge", "by-budget:32,judge,lead:base"}
    refused = sweep(old, "by-budget:32,calibrated:1,0,1,0,lead:base", limit="2")
    assert refused.exit_code != 0 and "'by-budget:32,judge,lead:base' vs 'by-budget:32,calibrated:1,0,1,0,lead:base'" \
        in refused.output, refused.output
    assert len(read_rows(old)) == len(rows), "nothing written"
    resumed = sweep(old, "by-budget:32,judge,lead:base", limit="2")
    assert resumed.exit_code == 0, resumed.output
    assert len(read_rows(old)) == 2 * len(rows)
    new = tmp_path / "new.jsonl"
    assert sweep(new, "by-budget:32,judge,lead:base", limit="2").exit_code == 0
    merged = CliRunner().invoke(main, ["bench", "merge", str(old), str(new), "--out", str(tmp_path / "m.jsonl")])
    assert merged.exit_code == 0, merged.output
    other = tmp_path / "other.jsonl"
    assert sweep(other, "by-budget:32,lead:helper,lead:base").exit_code == 0
    refused = CliRunner().invoke(main, ["bench", "merge", str(old), str(other), "--out", str(tmp_path / "o.jsonl")])
    assert refused.exit_code != 0 and "rule 'by-budget:32,judge,lead:base'" in refused.output, refused.output


SPECS = ["judge", "judge:margin=0.005", "random", "lead:base", "lead:helper,margin=0.2,pick=0.005", "calibrated:1,0,1,0",
         "by-budget:32,judge,lead:base", "arith:by-budget:32,random,lead:helper"]


def test_every_registered_rule_solves_through_llama_cpp_on_the_toy_preset():
    from kvrescue_local.rescue.rules import RULES

    assert {parse_rule(spec).name for spec in SPECS} | {"arith"} >= set(RULES), "a spec of every registered rule"
    for spec in SPECS:
        ran = CliRunner().invoke(main, ["solve", "--preset", "toy", "-t", "1", "-n", "2", "--budget", "32",
                                        "--rule", spec, "a=3 b=4\nCompute 2 terms: a+b."])
        assert ran.exit_code == 0, (spec, ran.output)
        assert f"rule: {spec} (--rule)" in ran.output and "answer:" in ran.output, ran.output


def test_the_old_rule_options_and_a_bad_spec_are_one_error_line_each():
    for args, says in ((["--choice", "prm"], "--choice is gone: commit rules are specs now, pass --rule judge"),
                       (["--choice", "regime"], "pass --rule by-budget:BUDGET,judge,lead:base"),
                       (["--pick-margin", "0.005"], "pass --rule judge:margin=0.005"),
                       (["--helper-margin", "0.3"], "pass --rule lead:base,margin=0.3"),
                       (["--judge-max-budget", "32"], "pass --rule by-budget:32,judge,lead:base"),
                       (["--weak-base-choice", "calibrated"], "pass --rule by-budget:BUDGET,calibrated,lead:base"),
                       (["--check-arithmetic"], "pass --rule arith:RULE"),
                       (["--rule", "bogus"], "--rule 'bogus' is not a rule spec (unknown rule 'bogus'): write one of "
                                             "judge[:margin=M]"),
                       (["--rule", "lead:base,margin=2"], "lead's margin must be in [0, 1]")):
        for command in (["solve"], ["bench", "run", "--results", "x.jsonl"], ["serve"]):
            ran = CliRunner().invoke(main, [*command, *args, "1+1?"] if command == ["solve"] else [*command, *args])
            errors = [line for line in ran.output.splitlines() if line.startswith("Error:")]
            assert ran.exit_code != 0 and len(errors) == 1 and says in errors[0], (command, args, ran.output)
            assert "Traceback" not in ran.output and len(ran.output.strip().splitlines()) == 1, ran.output
    listing = CliRunner().invoke(main, ["solve", "--rule", "bogus", "x"]).output
    for usage in ("random", "lead:SIDE[,margin=M,pick=P]", "calibrated[:BS,BB,HS,HB]", "by-budget:B,RULE,RULE",
                  "arith:RULE"):
        assert usage in listing, "a bad spec lists every rule and its parameters"
    for command in (["solve"], ["bench", "run"], ["serve"]):
        shown = CliRunner().invoke(main, [*command, "--help"]).output
        assert "--rule" in shown and not any(old in shown for old in ("--choice", "--pick-margin", "--helper-margin",
                                                                      "--base-margin", "--judge-max-budget",
                                                                      "--weak-base-choice", "--check-arithmetic"))


def test_the_coder_presets_specs_say_what_its_rule_fields_said():
    """The coder preset's rules, written as fields before rules were specs (its preset.json's pick margin laid under
    its commit.json's rule settings), read as the specs it now ships: its trajectories are the ones they were."""
    from kvrescue_local.bench.results_file import old_rule
    from kvrescue_local.paths import SHIPPED_MODELS

    before = {"rule": {"choice": "regime", "judge_max_budget": 32, "weak_base_choice": "helper-first"},
              "gsm8k": {"choice": "regime", "judge_max_budget": 64, "weak_base_choice": "calibrated",
                        "helper_margin": 0.0, "calibration": [1.959263, -2.365101, 2.66623, -2.798793],
                        "check_arithmetic": True},
              "math500": {"choice": "regime", "judge_max_budget": 32, "weak_base_choice": "helper-first"}}
    spec = preset_spec(SHIPPED_MODELS / "coder")
    now = {"rule": spec["recipe"]["rule"], **{d: r["rule"] for d, r in spec["dataset_recipes"].items()}}
    assert now == {name: old_rule({"pick_margin": 0.005, **fields}).spec for name, fields in before.items()}


def test_a_data_file_takes_the_rule_fitted_for_the_dataset_it_names(tmp_path, monkeypatch):
    """`bench run --data FILE` holds problems of no named dataset: the preset's default rule applies, and says so
    with the datasets it fitted others for; `--fitted-for NAME` applies NAME's, and names it; an unknown NAME is one
    Error line."""
    import dataclasses

    from kvrescue_local import presets

    toy = presets.load_preset("toy")
    monkeypatch.setitem(presets.PRESETS, "toy", lambda: dataclasses.replace(
        toy, recipe={**toy.recipe, "rule": "judge"}, dataset_recipes={"toy": {"rule": "lead:helper"}}))
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n"
                            for p in load_dataset("toy").problems[:1]))
    args = ["bench", "run", "--data", str(data), "--preset", "toy", "-t", "1", "--modes", "kvrescue", "--ns", "1",
            "--budgets", "32"]
    plain = CliRunner().invoke(main, [*args, "--results", str(tmp_path / "plain.jsonl")])
    assert plain.exit_code == 0, plain.output
    assert "rule: judge (the toy preset's default; --fitted-for NAME takes the one fitted for toy)" in plain.output
    fitted = CliRunner().invoke(main, [*args, "--fitted-for", "toy", "--results", str(tmp_path / "fitted.jsonl")])
    assert fitted.exit_code == 0, fitted.output
    assert fitted.output.count("rule: lead:helper (the toy preset's, fitted for toy: --fitted-for toy)") == 1
    assert read_rows(tmp_path / "fitted.jsonl")[0]["config"]["rule"] == "lead:helper"
    named = CliRunner().invoke(main, [*args[:2], "--dataset", "toy", *args[4:], "--results", str(tmp_path / "n.jsonl")])
    assert "rule: lead:helper (the toy preset's, fitted for toy: --dataset toy)" in named.output, named.output
    solved = CliRunner().invoke(main, ["solve", "--preset", "toy", "-t", "1", "--fitted-for", "toy", "1+1?"])
    assert "rule: lead:helper (the toy preset's, fitted for toy: --fitted-for toy)" in solved.output, solved.output
    unknown = CliRunner().invoke(main, [*args, "--fitted-for", "gsm8k", "--results", str(tmp_path / "u.jsonl")])
    errors = [line for line in unknown.output.splitlines() if line.startswith("Error:")]
    assert unknown.exit_code == 1 and errors == ["Error: --fitted-for gsm8k: the toy preset fitted rules for toy only; "
                                                 "pass one of those, or --rule SPEC"], unknown.output
