"""Training a value-head PRM (`kvrescue-local prm train | eval`) on the toy world through llama.cpp: rollouts,
hidden states read by the scorer's own code and cached, a numpy head that separates held-out steps and
scores them in serving as it did in training; the split kept; KV-Rescue choosing at random."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from kvrescue_local.bench.results_file import read_rows
from kvrescue_local.cli import main
from kvrescue_local.compose import Selection, open_models
from kvrescue_local.errors import KVRescueError
from kvrescue_local.files import file_hash
from kvrescue_local.prm import PRM, PRMParams, RewardHead
from kvrescue_local.prmtrain.evaluate import pair_scores
from kvrescue_local.prmtrain.examples import LabelledStep, check_split, killed_texts, labelled_steps
from kvrescue_local.presets import load_preset
from kvrescue_local.prmtrain.features import FeatureCache, row_hidden
from kvrescue_local.prmtrain.fit import auc, fit_head, to_head
from kvrescue_local.prmtrain.pipeline import (JUDGE_CTX, Rollouts, evaluate, features, labelled_rows, open_backbone,
                                              run_rollouts, train)
from kvrescue_local.rescue import Candidate, Rescue, RescueConfig, Trajectory
from kvrescue_local.rescue.judge import HelperJudge
from kvrescue_local.rescue.generator import Draft
from kvrescue_local.rescue.loop import problem_key
from kvrescue_local.rescue.rules import Judge, Random

from test_rescue import PROBLEM, config, without_timings

TOY_PROBLEM = "a=7 b=4 c=5 d=9 e=6 f=2 g=8 h=3\nCompute 4 terms: a+d-c+g."
HELD_OUT = 30  # toy problems toy-30 and above are kept out of training


@pytest.fixture(scope="module")
def toy_rollouts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prm") / "toy-rollouts.jsonl"
    plan = Rollouts(dataset="toy", limit=40, budgets=(48,))
    assert run_rollouts("toy", plan, path) == 120  # 40 problems x full, bon@48, helper
    assert run_rollouts("toy", plan, path) == 0, "a second run resumes: nothing left to do"
    return path


@pytest.fixture(scope="module")
def toy_backbone():
    return open_backbone("toy", threads=1, features_only="toy-prm")


def held_out(steps):
    return np.array([int(s.problem.rsplit("-", 1)[1]) >= HELD_OUT for s in steps])


def test_a_head_trained_on_toy_rollouts_separates_held_out_steps(toy_rollouts, toy_backbone, tmp_path):
    rows, steps, left_out = labelled_rows([toy_rollouts, toy_rollouts], "train")
    assert len(rows) == 120 and left_out == 0 and len(steps) == sum(r["n_steps"] for r in rows), "each row once"
    hidden = features(toy_backbone, rows, cache_dir=tmp_path)
    assert hidden.shape == (len(steps), toy_backbone.model.n_embd)
    held = held_out(steps)
    fit = train(hidden[~held], [s for s, h in zip(steps, held) if not h], "toy-prm")
    assert fit.validation, "hyper-parameters were chosen on the validation problems"
    trained_on = [s for s, h in zip(steps, held) if not h]
    assert evaluate(fit.out_of_fold, trained_on).auc > 0.6, "each fold scored by a fit without its problems"
    result = evaluate(fit.head.rewards(hidden[held]), [s for s, h in zip(steps, held) if h])
    assert result.auc > 0.6
    pairs = {p.origin: p for p in result.pairs}
    assert pairs["evicted base"].pairs > 20 and pairs["evicted base"].accuracy > 0.6
    assert pairs["all"].accuracy > 0.6

    # serving reads the same numbers: the saved head on the backbone scores a row as training saw it
    head_file = fit.head.save(tmp_path / "value.head.npz")
    served = PRM(toy_backbone.model.path, PRMParams(n_ctx=1024), head=head_file)
    row = next(r for r in rows if int(r["id"].rsplit("-", 1)[1]) >= HELD_OUT)
    trajectory = Trajectory.from_json(row["trajectory"])
    cached, was_cached = FeatureCache(toy_backbone, tmp_path).hidden(trajectory)
    assert was_cached
    np.testing.assert_allclose(served.score_trajectory(trajectory.problem, [s.text for s in trajectory.steps]),
                               fit.head.rewards(cached), atol=1e-4)


def test_features_are_cached_per_row_and_a_killed_run_continues(toy_rollouts, toy_backbone, tmp_path):
    rows = read_rows(toy_rollouts)[:6]
    seen = []
    first = features(toy_backbone, rows, seen.append, cache_dir=tmp_path)
    assert seen == [False] * 6
    files = sorted(tmp_path.rglob("*.npy"))
    assert len(files) == 6 and files[0].parent.name.endswith("-toy-prm")
    files[2].unlink()  # as if the run had been killed before this row
    seen.clear()
    again = features(toy_backbone, rows, seen.append, cache_dir=tmp_path)
    assert seen.count(False) == 1 and seen.count(True) == 5
    np.testing.assert_array_equal(first, again)


def test_killed_candidates_are_read_where_the_loop_scored_them(toy_rollouts, toy_backbone):
    """A killed candidate's hidden state, read as the loop's PRM reads a candidate (a fork of the committed
    prefix), equals the last step of the prefix and that candidate encoded from scratch; it is labelled wrong."""
    row = next(r for r in read_rows(toy_rollouts) if r["n_steps"] >= 3 and r["correct"])
    trajectory = Trajectory.from_json(row["trajectory"])
    trajectory.steps[1].candidates.append(Candidate("base", 1, "1:a=1000", 4, "killed"))
    row = {**row, "trajectory": trajectory.to_json()}
    steps = labelled_steps(row)
    hidden = row_hidden(toy_backbone, trajectory)
    assert len(steps) == len(hidden) == trajectory.n_steps + 1
    killed = steps[2]
    assert (killed.label, killed.origin, killed.committed, killed.round) == (0, "degenerate", False, 1)
    assert steps[1].label == 1 and steps[1].committed
    scratch = toy_backbone.trajectory_hidden(trajectory.problem, [trajectory.steps[0].text, "1:a=1000"])
    np.testing.assert_allclose(hidden[2], scratch[-1], atol=1e-3)


def test_pairs_are_right_vs_wrong_steps_of_one_problem_and_round():
    steps = [LabelledStep("p", 0, "right", "helper", 1, True), LabelledStep("p", 0, "wrong", "helper", 0, True),
             LabelledStep("p", 0, "right", "evicted base", 0, True),  # same text as the right step: no pair
             LabelledStep("p", 0, "loop", "degenerate", 0, False), LabelledStep("p", 1, "later", "helper", 0, True),
             LabelledStep("q", 0, "other problem", "evicted base", 0, True)]
    rewards = np.array([0.9, 0.1, 0.9, 0.95, 0.0, 0.0])
    scores = {p.origin: p for p in pair_scores(steps, rewards)}
    assert set(scores) == {"helper", "degenerate", "all"}
    assert (scores["helper"].pairs, scores["helper"].accuracy) == (1, 1.0)
    assert (scores["degenerate"].pairs, scores["degenerate"].accuracy) == (1, 0.0)
    assert (scores["all"].pairs, scores["all"].accuracy, scores["all"].problems) == (2, 0.5, 1)


def test_auc_and_the_folded_head():
    rng = np.random.default_rng(0)
    scores, labels = rng.standard_normal(200).round(1), rng.random(200) < 0.4
    brute = np.mean([(p > n) + 0.5 * (p == n) for p in scores[labels] for n in scores[~labels]])
    assert auc(scores, labels) == pytest.approx(brute)
    x = rng.standard_normal((300, 12)) * rng.uniform(0.1, 5, 12) + rng.standard_normal(12)
    y = (x @ rng.standard_normal(12) > 0).astype(float)
    problems = [f"p{i // 3}" for i in range(300)]
    fit = fit_head(x, y, problems, "value-head")
    assert fit.train_auc > 0.95 and len(fit.head.weights[0]) in (1, 32)
    two_way = to_head([(np.ones((1, 3)), np.zeros(1))], np.zeros(12), np.ones(12), np.eye(12)[:, :3], "qwen-prm")
    one_way = to_head([(np.ones((1, 3)), np.zeros(1))], np.zeros(12), np.ones(12), np.eye(12)[:, :3], "value-head")
    np.testing.assert_allclose(two_way.rewards(x), one_way.rewards(x), atol=1e-6)
    with pytest.raises(KVRescueError, match="right and wrong steps"):
        fit_head(x, np.ones(300), problems, "value-head")


def gsm8k_row(problem_id):
    return {"dataset": "gsm8k", "id": str(problem_id), "config_key": "helper-b0-n1-none", "config": {"mode": "helper", "n": 1},
            "correct": True, "trajectory": Trajectory("q", {"mode": "helper"}).to_json()}


def test_training_refuses_evaluation_problems_and_evaluation_everything_else(tmp_path):
    check_split([gsm8k_row(5), {**gsm8k_row(0), "dataset": "toy", "id": "toy-1"}], "train", "f")
    check_split([gsm8k_row(900)], "eval", "f")
    with pytest.raises(KVRescueError, match="problem 950 is an evaluation problem.*--split train"):
        check_split([gsm8k_row(5), gsm8k_row(950)], "train", "f")
    with pytest.raises(KVRescueError, match="problem 899 is not an evaluation problem.*--split eval"):
        check_split([gsm8k_row(899)], "eval", "f")
    eval_rows, train_rows = tmp_path / "eval.jsonl", tmp_path / "train.jsonl"
    eval_rows.write_text(json.dumps(gsm8k_row(1000)) + "\n")
    train_rows.write_text(json.dumps(gsm8k_row(3)) + "\n")
    for args in (["prm", "train", "--preset", "toy", "--no-rollouts", "--rollouts", str(eval_rows)],
                 ["prm", "eval", "--preset", "toy", "--rollouts", str(train_rows)]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code != 0 and result.output.startswith("Error: ") and result.output.count("\n") == 1


def test_head_errors_are_one_line(toy_backbone, tiny_prm_path, base_path, helper_path, tmp_path):
    with pytest.raises(KVRescueError, match="reads hidden states only"):
        toy_backbone.score(["1:a=7"])
    with pytest.raises(KVRescueError, match="reward head not found.*prm train"):
        PRM(toy_backbone.model.path, head=tmp_path / "nowhere.head.npz")
    missing = Selection({"base": base_path, "helper": helper_path, "prm": tiny_prm_path,
                         "prm_head": tmp_path / "prm.head.npz"}, None)
    with pytest.raises(KVRescueError, match="reward head .*prm.head.npz is missing.*prm train"):
        open_models(missing, RescueConfig(), True, True, 4, ["1+1?"])
    wrong_width = RewardHead([np.zeros((1, 7), np.float32)], [np.zeros(1, np.float32)], "chat-value")
    with pytest.raises(KVRescueError, match="expects hidden size 7"):
        PRM(toy_backbone.model.path, head=wrong_width.save(tmp_path / "narrow.head.npz"))


def test_random_choice_needs_no_prm_is_reproducible_and_recorded(base_model, helper_model, base_path, helper_path,
                                                                 tiny_prm_path, tmp_path):
    cfg = config(mode="kvrescue", n=2, rule="random")
    engine = Rescue(cfg, base_model, helper_model, None)
    first = engine.solve(PROBLEM)
    assert without_timings(first) == without_timings(Rescue(cfg, base_model, helper_model, None).solve(PROBLEM))
    assert all(s.score is None for s in first.steps)
    assert first.config["rule"] == "random"
    drafts = list(range(4))
    picks = {Random().choose(drafts, (0, problem_key(f"problem {p}"), r)) for p in range(5) for r in range(5)}
    assert picks == set(drafts), "every survivor gets drawn"
    assert Random().choose(drafts, (0, problem_key("x"), 3)) == Random().choose(drafts, (0, problem_key("x"), 3))
    with pytest.raises(KVRescueError, match="unknown rule 'best'"):
        RescueConfig(rule="best")

    results = tmp_path / "both.jsonl"
    args = ["bench", "run", "--dataset", "gsm8k", "--limit", "2", "--modes", "kvrescue", "--ns", "1", "--budgets", "32",
            "--buffer", "16", "--max-tokens", "40", "--max-step-tokens", "16", "--tau-entropy", "50",
            "--rule", "judge", "--rule", "random", "--base", str(base_path), "--helper", str(helper_path), "--prm", str(tiny_prm_path),
            "--results", str(results)]
    ran = CliRunner().invoke(main, args)
    assert ran.exit_code == 0, ran.output
    rows = read_rows(results)
    assert {r["config_key"] for r in rows} == {"kvrescue-b32-n1-rkv", "kvrescue-b32-n1-rkv-random"}
    assert {r["config"]["rule"] for r in rows} == {"judge", "random"}
    report = CliRunner().invoke(main, ["report", str(results)])
    assert report.exit_code == 0 and "kvrescue/random" in report.output


def test_a_pick_margin_takes_the_first_survivor_near_the_best_and_is_recorded_where_a_prm_picks(
        base_path, helper_path, tiny_prm_path, tmp_path):
    drafts = [Draft("base", i, -1, score=s) for i, s in enumerate([0.500, 0.512, 0.509, 0.2])]
    assert Judge().choose(drafts, (0, 0, 0)) is drafts[1], "margin 0: the favourite"
    assert Judge(0.005).choose(drafts, (0, 0, 0)) is drafts[1]
    assert Judge(0.02).choose(drafts, (0, 0, 0)) is drafts[0], "the first within 0.02 of the best"
    with pytest.raises(KVRescueError, match="judge's margin must be in"):
        RescueConfig(rule="judge:margin=1.5")
    results = tmp_path / "margin.jsonl"
    common = ["bench", "run", "--dataset", "gsm8k", "--limit", "1", "--modes", "kvrescue", "--budgets", "32",
              "--buffer", "16", "--max-tokens", "40", "--max-step-tokens", "16", "--base", str(base_path),
              "--helper", str(helper_path), "--prm", str(tiny_prm_path), "--results", str(results)]
    ran = CliRunner().invoke(main, [*common, "--ns", "2", "--rule", "judge:margin=0.01", "--rule", "random"])
    assert ran.exit_code == 0, ran.output
    settings = {r["config_key"]: r["setup"]["settings"] for r in read_rows(results)}
    assert settings["kvrescue-b32-n2-rkv"]["rule"] == "judge:margin=0.01"
    assert "rule" not in settings["kvrescue-b32-n2-rkv-random"], "no PRM picks: the rule is no setting"
    report = CliRunner().invoke(main, ["report", str(results)])
    assert "PRM vs random choice, kvrescue b32 n2 rkv, on the 1 problems" in report.output, report.output
    # a row from before the margin was a setting was picked by the favourite, and reads so
    legacy = tmp_path / "legacy.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    for row in rows:  # as written before rules were specs, and before the margin was a setting
        row["setup"]["settings"].pop("rule", None)
        row["config"]["choice"] = row["config"].pop("rule").replace("judge:margin=0.01", "prm")
    legacy.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert {r["config_key"]: r["setup"]["settings"].get("rule") for r in read_rows(legacy)} == {
        "kvrescue-b32-n2-rkv": "judge", "kvrescue-b32-n2-rkv-random": None}
    refused = CliRunner().invoke(main, [*common[:-1], str(legacy), "--ns", "2", "--rule", "judge:margin=0.01",
                                        "--resume"])
    assert refused.exit_code != 0 and "rule 'judge' vs 'judge:margin=0.01'" in refused.output, refused.output


def test_prm_train_command_end_to_end_on_the_toy_preset(toy_rollouts, tmp_path, monkeypatch):
    monkeypatch.setattr("kvrescue_local.prmtrain.pipeline.FEATURES_CACHE", tmp_path / "features")
    rollouts = tmp_path / "rollouts.jsonl"
    shutil.copy(toy_rollouts, rollouts)
    out = tmp_path / "toy-value.head.npz"
    args = ["prm", "train", "--preset", "toy", "--dataset", "toy", "--limit", "40", "--budgets", "48",
            "--format", "toy-prm", "--rollouts", str(rollouts), "--out", str(out), "-t", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "stage 1, rollouts: 0 new rows" in result.output and "stage 3, train" in result.output
    assert "cross-validated on the training problems" in result.output and "evicted base" in result.output
    trained = RewardHead.load(out)
    assert (trained.format, trained.backbone) == ("toy-prm", file_hash(load_preset("toy").prm))
    assert open_backbone("toy", threads=1, head=out).head_file == out  # `prm eval` reads it on the model it records
    elsewhere = dataclasses.replace(trained, backbone=file_hash(load_preset("toy").base))
    with pytest.raises(KVRescueError, match="trained on the hidden states of another model file"):
        open_backbone("toy", threads=1, head=elsewhere.save(tmp_path / "elsewhere.head.npz"))
    again = CliRunner().invoke(main, args + ["--no-rollouts"])
    assert "0 rows read, 120 cached" in again.output
    two = CliRunner().invoke(main, args + ["--rollouts", str(toy_rollouts)])
    assert two.exit_code != 0 and "stage 1 extends one rollouts file" in two.output


def test_a_head_on_the_helpers_own_context_trains_and_serves_on_the_states_it_was_trained_on(toy_rollouts, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setattr("kvrescue_local.prmtrain.pipeline.FEATURES_CACHE", tmp_path / "features")
    out = tmp_path / "helper.head.npz"
    args = ["prm", "train", "--preset", "toy", "--format", "helper-value", "--no-rollouts", "--rollouts",
            str(toy_rollouts), "--out", str(out), "-t", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    preset = load_preset("toy")
    head = RewardHead.load(out)
    assert (head.format, head.backbone, head.prompt) == ("helper-value", file_hash(preset.helper), preset.prompt)

    # the judge that serves it reads the states training read (the same code, the cached features)
    trajectory = Trajectory.from_json(read_rows(toy_rollouts)[0]["trajectory"])
    judge = open_backbone("toy", threads=1, head=out)
    cached, was_cached = FeatureCache(judge, tmp_path / "features").hidden(trajectory)
    assert was_cached and isinstance(judge, HelperJudge)
    served = judge.rewards(judge.trajectory_hidden(trajectory.problem, [s.text for s in trajectory.steps],
                                                   killed_texts(trajectory)))
    np.testing.assert_allclose(served, head.rewards(cached), atol=1e-5)
    solved = CliRunner().invoke(main, ["solve", "--preset", "toy", "--prm", f"helper:{out}", "-n", "2", "-t", "1",
                                       "--budget", "48", TOY_PROBLEM])
    assert solved.exit_code == 0 and "answer:" in solved.output, solved.output


def test_the_helpers_context_is_sized_for_the_longest_trajectory_it_reads(toy_rollouts, tmp_path):
    """A trajectory longer than the judge's least context (MATH500's run to 4,096 tokens) is read whole, every
    labelled step of it, where a context of JUDGE_CTX cells would be full."""
    row = read_rows(toy_rollouts)[0]
    judge = open_backbone("toy", threads=1, features_only="helper-value", rows=[row])
    steps = row["trajectory"]["steps"]
    per_copy = sum(len(judge.model.tokenize(step["text"], special=False)) for step in steps)
    long = json.loads(json.dumps(row))
    long["trajectory"]["steps"] = [{**step, "round": i} for i, step in
                                   enumerate(steps * (JUDGE_CTX // max(per_copy, 1) + 2))]
    assert sum(len(judge.model.tokenize(s["text"], special=False)) for s in long["trajectory"]["steps"]) > JUDGE_CTX
    sized = open_backbone("toy", threads=1, features_only="helper-value", rows=[row, long])
    assert sized.gen.ctx.n_ctx > JUDGE_CTX == judge.gen.ctx.n_ctx
    hidden = features(sized, [long], cache_dir=tmp_path / "features")
    assert len(hidden) == len(labelled_steps(long)) and np.isfinite(hidden).all()
    with pytest.raises(KVRescueError, match="the KV cache is full"):
        features(judge, [long], cache_dir=tmp_path / "unsized")


def test_a_head_on_another_models_context_is_trained_and_evaluated_on_that_model(toy_rollouts, tmp_path, monkeypatch):
    monkeypatch.setattr("kvrescue_local.prmtrain.pipeline.FEATURES_CACHE", tmp_path / "features")
    base = load_preset("toy").base
    out = tmp_path / "base-judge.head.npz"
    train = ["prm", "train", "--preset", "toy", "--format", "helper-value", "--no-rollouts", "--rollouts",
             str(toy_rollouts), "--helper", str(base), "-t", "1"]
    no_out = CliRunner().invoke(main, train)
    assert no_out.exit_code != 0 and "needs --out" in no_out.output and "Traceback" not in no_out.output
    result = CliRunner().invoke(main, train + ["--out", str(out)])
    assert result.exit_code == 0, result.output
    assert RewardHead.load(out).backbone == file_hash(base) != file_hash(load_preset("toy").helper)

    with pytest.raises(KVRescueError, match="trained on the hidden states of another model file"):
        open_backbone("toy", threads=1, head=out)  # `prm eval` on the preset's own helper
    judge = open_backbone("toy", threads=1, head=out, helper=base)  # `prm eval --helper BASE`: the model it was trained on
    assert judge.model.path == base
    trajectory = Trajectory.from_json(read_rows(toy_rollouts)[0]["trajectory"])
    cached, was_cached = FeatureCache(judge, tmp_path / "features").hidden(trajectory)
    assert was_cached
    served = judge.rewards(judge.trajectory_hidden(trajectory.problem, [s.text for s in trajectory.steps],
                                                   killed_texts(trajectory)))
    np.testing.assert_allclose(served, RewardHead.load(out).rewards(cached), atol=1e-5)
    other_format = CliRunner().invoke(main, ["prm", "train", "--preset", "toy", "--format", "toy-prm", "--no-rollouts",
                                             "--rollouts", str(toy_rollouts), "--helper", str(base), "--out",
                                             str(tmp_path / "x.npz")])
    assert other_format.exit_code != 0 and "format helper-value" in other_format.output
