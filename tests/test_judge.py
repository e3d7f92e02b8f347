"""`--prm helper` on the tiny pair through llama.cpp: a reward head on the helper's own context scores as the
separate PRM on the same file does, refuses a head of another file or format in one Error line, decodes
no committed step twice, and no candidate's score depends on the candidates beside it."""

import numpy as np
import pytest
from click.testing import CliRunner

from kvrescue_local.bench.results_file import file_hash
from kvrescue_local.cli import main
from kvrescue_local.compose import helper_head, open_models, select_models
from kvrescue_local.errors import KVRescueError
from kvrescue_local.gguf_export import TINY_HELPER
from kvrescue_local.prm import PRM, PRMParams, RewardHead, prm_format
from kvrescue_local.rescue import Generator, Rescue
from kvrescue_local.rescue.config import cache_fields
from kvrescue_local.rescue.judge import HelperJudge
from kvrescue_local.runtime import Model, SamplingParams

from test_rescue import PROBLEM, config

EXACT = dict(type_k="f32", type_v="f32", flash_attn="off")
EXACT_RUN = dict(**cache_fields("f32", "f32"), flash_attn="off")  # the same, as a RescueConfig's
STEPS = ["a is 17.\n\n", "b is 25, so 17+25=42", " and so\n\n", "\\boxed{42}"]
OTHERS = ["a is 71.\n\n", "", "zz\n\n"]


def value_head(backbone, seed: int = 7) -> RewardHead:
    rng = np.random.default_rng(seed)
    d = TINY_HELPER.n_embd
    weight = (rng.standard_normal((1, d)) / np.sqrt(d)).astype(np.float32)
    return RewardHead([weight], [np.zeros(1, np.float32)], "helper-value", backbone=backbone)


@pytest.fixture(scope="module")
def head_file(helper_path, tmp_path_factory):
    return value_head(file_hash(helper_path)).save(tmp_path_factory.mktemp("judge") / "helper.head.npz")


def judge_on(model, head=None, slots: int = 1, n: int = 2) -> HelperJudge:
    gen = Generator("helper", model, n, 4096, None, SamplingParams(), 64, n_batch=128, slots=slots, scores=True,
                    **EXACT)
    return HelperJudge(gen, prm_format("helper-value"), head)


def test_the_head_in_the_helper_scores_a_trajectory_as_the_separate_prm_on_the_same_file(helper_model, helper_path,
                                                                                       head_file):
    head = RewardHead.load(head_file)
    judge = judge_on(helper_model, head)
    prm = PRM(helper_path, PRMParams(n_ctx=2048, max_candidates=8, kv_type="f32", flash_attn="off"), head=head_file)
    rows = judge.trajectory_hidden(PROBLEM, STEPS, [OTHERS] * len(STEPS))
    prm.start(PROBLEM)
    separate = []
    for step in STEPS:
        separate.append(prm.score([step, *OTHERS]))  # the PRM decodes a round's candidates together
        prm.commit(step)
    in_helper = head.rewards(rows)
    np.testing.assert_allclose(in_helper, np.concatenate(separate), atol=1e-4, rtol=0)
    assert np.ptp(in_helper) > 0.05, "the rewards are not all the same"
    # the state of a step cut without its blank line, and of an empty one (read at the end-of-generation token)
    assert judge.format.step_tokens(helper_model, "")[0] == helper_model.eos
    assert len(judge.format.step_tokens(helper_model, STEPS[1])) == len(STEPS[1].encode())


def test_a_score_does_not_depend_on_the_candidates_beside_it_or_other_problems(helper_model, head_file):
    head = RewardHead.load(head_file)
    alone = judge_on(helper_model, head)
    alone.gen.start(0, helper_model.tokenize(alone.prompt.format(problem=PROBLEM)))
    alone.gen.flush()
    singles = [alone.score_many({0: [text]})[0][0] for text in [STEPS[0], *OTHERS]]
    crowded = judge_on(helper_model, head, slots=2)
    for slot, problem in ((0, "another problem, first in the cache " * 3), (1, PROBLEM)):
        crowded.gen.start(slot, helper_model.tokenize(crowded.prompt.format(problem=problem)))
    crowded.gen.flush()
    together = crowded.score_many({0: OTHERS, 1: [STEPS[0], *OTHERS]})[1]
    # what is left is the prefix's own layout: the two prompts shared a decode (float rounding, 6e-8 here)
    np.testing.assert_allclose(together, singles, atol=1e-6, rtol=0)


def test_no_committed_step_is_decoded_twice(base_model, helper_model, head_file):
    """The helper context decodes the prompt, the candidates as it samples them, each committed step once (its own
    winner's last token, or the base's whole step) and each scored candidate once: nothing else."""
    judge = helper_head(head_file, helper_model, "tiny")
    engine = Rescue(config(n=3, **EXACT_RUN), base_model, helper_model, judge)
    trajectory = engine.solve(PROBLEM)
    ctx, fmt = engine.sides["helper"].ctx, judge.format
    assert trajectory.n_steps > 2 and any(s.score is not None for s in trajectory.steps)
    prompt = len(helper_model.tokenize(engine.config.prompt.format(problem=PROBLEM)))
    sampled = sum(c.tokens - 1 for s in trajectory.steps for c in s.candidates if c.side == "helper")
    committed = sum(1 if s.source == "helper" else winner(s).tokens for s in trajectory.steps[:-1])
    scored = sum(len(fmt.step_tokens(helper_model, text)) for s in trajectory.steps
                 for text in dict.fromkeys(c.text for c in s.candidates if c.score is not None))
    assert engine.scorer.decoded_tokens == scored
    assert ctx.decoded_tokens == prompt + sampled + committed + scored
    assert engine.prm is None and set(engine.peak_kv_bytes()) == {"base", "helper"}, "no context of a PRM's own"
    with pytest.raises(KVRescueError, match="one to score in; use --concurrency 1 to 127"):
        Rescue(config(n=1, **EXACT_RUN), base_model, helper_model, judge, concurrency=128)


def winner(step):
    """The committed candidate (the pair shares one vocabulary: a base step is committed as it was sampled)."""
    return next(c for c in step.candidates if c.side == step.source and c.text == step.text)


def test_two_models_load_and_a_head_of_another_file_or_format_is_refused(base_path, helper_path, tiny_prm_path,
                                                                        head_file, tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr("kvrescue_local.compose.Model", lambda path, **kw: loaded.append(path) or Model(path, **kw))
    options = {"preset": "tiny", "base": str(base_path), "helper": str(helper_path), "prm": f"helper:{head_file}"}
    selection = select_models(options, True, True)
    _, models = open_models(selection, selection.config(options), True, True, 6, [PROBLEM])
    assert loaded == [base_path, helper_path] and models.prm.model is models.helper

    foreign = value_head(file_hash(base_path)).save(tmp_path / "foreign.head.npz")
    unrecorded = value_head(None).save(tmp_path / "unrecorded.head.npz")
    chat = RewardHead([np.zeros((1, TINY_HELPER.n_embd), np.float32)], [np.zeros(1, np.float32)], "chat-value",
                      backbone=file_hash(helper_path)).save(tmp_path / "chat.head.npz")
    common = ["solve", "--base", str(base_path), "--helper", str(helper_path), "-n", "2", "--max-tokens", "40", PROBLEM]
    for head, message in ((foreign, "trained on the hidden states of another model file"),
                          (unrecorded, "an unrecorded model file"),
                          (chat, "is of format chat-value"),
                          (tmp_path / "none.head.npz", "none.head.npz is missing")):
        result = CliRunner().invoke(main, [*common, "--prm", f"helper:{head}"])
        assert result.exit_code != 0 and "Traceback" not in result.output
        (line,) = [x for x in result.output.splitlines() if x.startswith("Error:")]
        assert message in line, result.output
    result = CliRunner().invoke(main, ["solve", "--preset", "tiny", "--prm", "helper", "-n", "2", PROBLEM])
    assert result.exit_code != 0 and "the tiny preset has none" in result.output
    result = CliRunner().invoke(main, [*common, "--prm", f"helper:{head_file}", "--mode", "bon"])
    assert result.exit_code != 0 and "has no helper: use mode kvrescue or helper" in result.output
    result = CliRunner().invoke(main, [*common, "--prm", f"helper:{head_file}", "--prompt-template", "Q: {problem}\nA:"])
    assert result.exit_code != 0 and "prompted otherwise" in result.output
    result = CliRunner().invoke(main, [*common, "--prm", f"helper:{head_file}"])
    assert result.exit_code == 0, result.output
    results = tmp_path / "r.jsonl"
    swept = CliRunner().invoke(main, ["bench", "run", "--dataset", "toy", "--limit", "2", "--modes", "kvrescue", "--ns",
                                      "2", "--base", str(base_path), "--helper", str(helper_path), "--prm",
                                      f"helper:{head_file}", "--max-tokens", "40", "--results", str(results)])
    assert swept.exit_code == 0 and "2 new results" in swept.output, swept.output


def test_a_judge_needs_a_context_made_to_score_and_a_head_read_as_held(helper_model):
    gen = Generator("helper", helper_model, 2, 1024, None, SamplingParams(), 16, n_batch=128)
    with pytest.raises(KVRescueError, match="scores=True"):
        HelperJudge(gen, prm_format("helper-value"))
    with pytest.raises(KVRescueError, match="--format helper-value"):
        HelperJudge(judge_on(helper_model).gen, prm_format("chat-value"))
