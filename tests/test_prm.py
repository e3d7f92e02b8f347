"""PRM conversion and scoring through llama.cpp against a direct numpy forward of the checkpoint."""

import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from hf_checkpoint import reference_rewards, write_prm_checkpoint
from kvrescue_local.cli import main
from kvrescue_local.errors import KVRescueError
from kvrescue_local.prm import PRM, PRMParams, RewardHead, aggregate, head_path, prm_format
from kvrescue_local.prm.convert import convert_prm

EXACT = dict(kv_type="f32", flash_attn="off")
PROBLEM = "Let a=17, b=42 and c=5. Compute a+b-c."
TRAJECTORIES = [
    ["a is 17.", "b is 42. total=17+42=59", "c is 5. total=59-5=54", "\\boxed{54}"],
    ["a is 17, so start at 17.\nThen add b.", "17+42=59\n\n", "\\boxed{59}"],
    ["I do not know."],
]
CANDIDATES = ["b is 42. total=59", "b is 24. total=41", "c is 5.", "\\boxed{54}", "zzzz", "total=17+42", "", "a=17\nb=42"]


@pytest.fixture(scope="module", params=[("qwen-prm", "F32"), ("value-head", "BF16")], ids=["qwen-prm", "value-head"])
def converted(request, tmp_path_factory):
    fmt, dtype = request.param
    root = tmp_path_factory.mktemp(fmt)
    weights = write_prm_checkpoint(root / "hf", fmt, seed=11, dtype=dtype)
    gguf = convert_prm(root / "hf", root / "prm.gguf", dtype="f32")
    return fmt, weights, gguf


def reference(prm, fmt, weights, problem, steps):
    """Token ids as the PRM lays them out (each segment tokenized alone) fed to the numpy model."""
    pieces = [prm.model.tokenize(prm.format.header(problem, prm.bos))]
    pieces += [prm.model.tokenize(prm.format.step_text(s)) for s in steps]
    ids = np.concatenate(pieces)
    ends = np.cumsum([len(p) for p in pieces])[1:] - 1
    flags = np.zeros(len(ids), bool)
    flags[ends] = True
    return reference_rewards(weights, fmt, ids, flags)


def test_rewards_equal_a_numpy_forward_of_the_checkpoint(converted):
    fmt, weights, gguf = converted
    prm = PRM(gguf, PRMParams(n_ctx=1024, **EXACT))
    assert prm.format.name == fmt
    for steps in TRAJECTORIES:
        got = prm.score_trajectory(PROBLEM, steps)
        want = reference(prm, fmt, weights, PROBLEM, steps)
        assert got.shape == (len(steps),)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.ptp(prm.score_trajectory(PROBLEM, CANDIDATES)) > 0.05, "the rewards are not all the same"


def test_eight_candidates_in_one_batch_equal_each_alone(converted):
    _, _, gguf = converted
    prm = PRM(gguf, PRMParams(n_ctx=1024, max_candidates=8, n_batch=64, **EXACT))
    prm.start(PROBLEM)
    prm.commit("a is 17.")
    together = prm.score(CANDIDATES)
    alone = [prm.score([c])[0] for c in CANDIDATES]
    np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)


def test_incremental_commits_equal_scoring_from_scratch(converted):
    _, _, gguf = converted
    prm = PRM(gguf, PRMParams(n_ctx=1024, max_candidates=4, **EXACT))
    steps = TRAJECTORIES[0]
    prm.start(PROBLEM)
    incremental = []
    for step in steps:
        rewards = prm.score([step, "a wrong step", "another one"])
        incremental.append(rewards[0])
        prm.commit(step)
    np.testing.assert_allclose(incremental, prm.score_trajectory(PROBLEM, steps), atol=1e-5, rtol=0)


def test_quantized_backbone_loads_and_stays_close(converted, tmp_path):
    fmt, _, gguf = converted
    hf = gguf.parent / "hf"
    q8 = convert_prm(hf, tmp_path / "prm-q8.gguf", quantize="q8_0")
    assert q8.stat().st_size < gguf.stat().st_size / 2
    # flash attention on, as when this tolerance was set (the random-weight PRM amplifies the rounding)
    exact = PRM(gguf, PRMParams(n_ctx=512, flash_attn="on")).score_trajectory(PROBLEM, TRAJECTORIES[0])
    approx = PRM(q8, PRMParams(n_ctx=512, flash_attn="on")).score_trajectory(PROBLEM, TRAJECTORIES[0])
    np.testing.assert_allclose(approx, exact, atol=0.05)


def test_aggregation():
    rewards = [0.9, 0.5, 0.8]
    assert aggregate(rewards, "last") == 0.8
    assert aggregate(rewards, "min") == 0.5
    assert aggregate(rewards, "prod") == pytest.approx(0.36)
    with pytest.raises(KVRescueError, match="unknown aggregation"):
        aggregate(rewards, "mean-ish")


def test_missing_head(converted, tmp_path):
    _, _, gguf = converted
    lonely = tmp_path / "lonely.gguf"
    shutil.copy(gguf, lonely)
    with pytest.raises(KVRescueError, match="reward head not found.*convert-prm"):
        PRM(lonely)


def test_head_of_the_wrong_hidden_size(converted, tmp_path):
    fmt, _, gguf = converted
    write_prm_checkpoint(tmp_path / "wide", fmt, seed=3, hidden=96)
    wide = convert_prm(tmp_path / "wide", tmp_path / "wide.gguf")
    mixed = tmp_path / "mixed.gguf"
    shutil.copy(gguf, mixed)
    shutil.copy(head_path(wide), head_path(mixed))
    with pytest.raises(KVRescueError, match="hidden size 96 but the backbone has 64"):
        PRM(mixed)


def test_unknown_format_name():
    with pytest.raises(KVRescueError, match="unknown PRM format 'shepherd'.*qwen-prm"):
        prm_format("shepherd")
    with pytest.raises(KVRescueError, match="unknown PRM format"):
        RewardHead([np.zeros((2, 4), np.float32)], [np.zeros(2, np.float32)], "shepherd")


def test_prm_context_grows_with_the_trajectory_up_to_its_training_context(converted):
    _, _, gguf = converted
    small, roomy = PRM(gguf, PRMParams(n_ctx=256, **EXACT)), PRM(gguf, PRMParams(n_ctx=2048, **EXACT))
    for prm in (small, roomy):
        prm.start(PROBLEM)
        prm.commit("step. " * 40)  # past 256 tokens: the small one grows and re-encodes its prefix
    np.testing.assert_allclose(small.score(CANDIDATES[:3]), roomy.score(CANDIDATES[:3]), atol=1e-5)
    assert small.ctx.n_ctx > 256
    np.testing.assert_allclose(small.score_trajectory(PROBLEM, ["x" * 300] * 3),
                               roomy.score_trajectory(PROBLEM, ["x" * 300] * 3), atol=1e-5)
    with pytest.raises(KVRescueError, match="trained on a context of 4096: lower --max-tokens"):
        small.score(["x" * 5000])


def test_conversion_refuses_unknown_architectures_and_missing_tensors(tmp_path):
    write_prm_checkpoint(tmp_path / "no-head", "qwen-prm", seed=1, drop=("score.2.weight",))
    with pytest.raises(KVRescueError, match="no reward-head tensors score.2.weight"):
        convert_prm(tmp_path / "no-head", tmp_path / "x.gguf")
    write_prm_checkpoint(tmp_path / "holes", "qwen-prm", seed=1, drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(KVRescueError, match="missing 1 backbone tensors, e.g. model.layers.1.mlp.up_proj.weight"):
        convert_prm(tmp_path / "holes", tmp_path / "x.gguf")
    write_prm_checkpoint(tmp_path / "lm", "value-head", seed=1, drop=("v_head.summary.weight", "v_head.summary.bias"))
    with pytest.raises(KVRescueError, match="unknown PRM architecture"):
        convert_prm(tmp_path / "lm", tmp_path / "x.gguf")
    with pytest.raises(KVRescueError, match="not a checkpoint directory"):
        convert_prm(tmp_path / "nowhere", tmp_path / "x.gguf")


def test_convert_prm_command(tmp_path):
    write_prm_checkpoint(tmp_path / "hf", "qwen-prm", seed=5)
    result = CliRunner().invoke(main, ["models", "convert-prm", str(tmp_path / "hf"), str(tmp_path / "out.gguf")])
    assert result.exit_code == 0, result.output
    assert "qwen-prm" in result.output and head_path(tmp_path / "out.gguf").exists()
    bad = CliRunner().invoke(main, ["models", "convert-prm", str(tmp_path / "missing"), str(tmp_path / "o.gguf")])
    assert bad.exit_code != 0 and "Error: " in bad.output and "Traceback" not in bad.output


def test_a_separate_prm_takes_a_head_that_is_not_beside_it(tiny_prm_path, base_path, helper_path, tmp_path):
    import json

    lonely, head = tmp_path / "backbone" / "prm.gguf", tmp_path / "heads" / "its.head.npz"
    lonely.parent.mkdir()
    head.parent.mkdir()
    shutil.copy(tiny_prm_path, lonely)
    shutil.copy(head_path(tiny_prm_path), head)
    common = ["solve", "--preset", "tiny", "--base", str(base_path), "--helper", str(helper_path), "-n", "2",
              "--max-tokens", "40", "-t", "1", "--seed", "3", PROBLEM, "--json"]
    beside = CliRunner().invoke(main, [*common, str(tmp_path / "beside.json"), "--prm", str(tiny_prm_path)])
    apart = CliRunner().invoke(main, [*common, str(tmp_path / "apart.json"), "--prm", f"{lonely}:{head}"])
    assert beside.exit_code == 0 and apart.exit_code == 0, apart.output
    scores = [[c["score"] for step in json.loads((tmp_path / f"{name}.json").read_text())["steps"]
               for c in step["candidates"]] for name in ("beside", "apart")]
    assert scores[0] == scores[1] and len(scores[0]) > 1
    missing = CliRunner().invoke(main, [*common, str(tmp_path / "none.json"), "--prm", str(lonely)])
    assert missing.exit_code == 1 and "its.head.npz" not in missing.output and "prm.head.npz" in missing.output
