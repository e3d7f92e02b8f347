"""`--prm helper` on the tiny pair through llama.cpp: a reward head on the helper's own context scores as the
separate PRM on the same file does, reads a round where it was sampled as each candidate alone would be read,
refuses a head of another file or format in one Error line, decodes no committed step twice, and no score read
alone depends on the candidates beside it."""

import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner

from kvrescue_local.cli import main
from kvrescue_local.compose import helper_head, open_models, select_models
from kvrescue_local.errors import KVRescueError
from kvrescue_local.files import file_hash
from kvrescue_local.gguf_export import TINY_HELPER
from kvrescue_local.prm import PRM, PRMParams, RewardHead, head_path, prm_format
from kvrescue_local.rescue import Generator, Rescue
from kvrescue_local.rescue.generator import Draft, Request
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


def read_alone(judge: HelperJudge, problem: str, pieces: list[list[int]]) -> np.ndarray:
    """The reference: each candidate's tokens decoded alone on the problem's prompt, in a context of its own."""
    gen, ctx = judge.gen, judge.gen.ctx
    gen.start(0, gen.model.tokenize(judge.prompt.format(problem=problem)))
    gen.flush()
    rows = []
    with ctx.hidden_states():
        for tokens in pieces:
            ctx.fork(0, gen.scoring(0)[0])
            rows.append(ctx.embedding(ctx.prefill(gen.scoring(0)[0], tokens)))
            ctx.drop(gen.scoring(0)[0])
    return judge.rewards(np.array(rows, np.float32))


def test_a_round_read_where_it_was_sampled_scores_as_each_candidate_alone(helper_model, head_file):
    """score_round reads the helper's candidates in their own sequences (one token each) and the base's in scoring
    sequences, another problem's round in the same decodes: each reward is the one of the candidate decoded alone
    (float rounding), and a base winner committed from where it was read leaves the helper as a step decoded anew."""
    head = RewardHead.load(head_file)
    judge = judge_on(helper_model, head, slots=2, n=4)
    gen = judge.gen
    for slot, problem in ((0, "another problem, first in the cache " * 3), (1, PROBLEM)):
        gen.start(slot, helper_model.tokenize(judge.prompt.format(problem=problem)))
    gen.flush()
    own = gen.propose([Request(slot, (slot, 0, 1)) for slot in (0, 1)])
    # the second begins as the first does (cells shared), the third is the first's beginning (decoded on its own),
    # the last one the helper sampled too: read once, where it is
    steps = [STEPS[0], "a is 71.\n\n", "a is 17.", STEPS[1], own[1][0].content]
    base = [Draft("base", i, -1, tokens=[int(t) for t in helper_model.tokenize(text, special=False)],
                  text=bytearray(text.encode()), finished="step") for i, text in enumerate(steps)]
    base[-1].tokens = list(own[1][0].tokens)
    assert base[0].tokens[:len(base[2].tokens)] == base[2].tokens and base[0].tokens[:5] == base[1].tokens[:5]
    rewards = judge.score_round({0: own[0], 1: [*base, *own[1]]}, lambda d: d.tokens)
    before = judge.decoded_tokens
    assert set(rewards[1]) == {d.content for d in [*base, *own[1]]}
    held = [[t for t in d.tokens if not helper_model.is_eog(t)] or [helper_model.eos] for d in own[1]]
    alone = read_alone(judge_on(helper_model, head), PROBLEM, [*(d.tokens for d in base[:-1]), *held])
    np.testing.assert_allclose([rewards[1][d.content] for d in [*base[:-1], *own[1]]], alone, atol=1e-5, rtol=0)
    assert np.ptp(alone) > 0.01, "the rewards are not all the same"
    common = next(i for i, (a, b) in enumerate(zip(base[0].tokens, base[1].tokens)) if a != b)
    own_texts = len({d.content for d in own[0]}) + len({d.content for d in own[1]})  # one token each
    assert before == own_texts + sum(len(d.tokens) for d in base[:-1]) - common, "a common beginning decoded once"

    assert judge.commit_held(1, STEPS[0]) and not judge.commit_held(1, STEPS[1]), "one commit per round"
    gen.flush()
    assert judge.decoded_tokens == before and gen.ctx.pos_max(gen.committed(1)) + 1 == (
        len(helper_model.tokenize(judge.prompt.format(problem=PROBLEM))) + len(base[0].tokens))
    fresh = judge_on(helper_model, head)
    fresh.gen.start(0, helper_model.tokenize(judge.prompt.format(problem=PROBLEM)))
    fresh.gen.flush()
    fresh.gen.commit_foreign(0, base[0].tokens)
    fresh.gen.flush()
    np.testing.assert_allclose(gen.ctx.logits(gen.rows[1]), fresh.gen.ctx.logits(fresh.gen.rows[0]), atol=1e-4)


def test_no_committed_step_is_decoded_twice(base_model, helper_model, head_file):
    """The helper context decodes the prompt, the candidates as it samples them, each scored candidate once (a
    helper candidate's last token; a base candidate in the tokens it is committed in, what several begin with in
    common once) and of each committed step only what is not there yet: a step read whole is committed from
    where it was read, its last token decoded again for the next round's logits; a base step no one scored is
    decoded whole."""
    judge = helper_head(head_file, helper_model, "tiny")
    engine = Rescue(config(n=3, seed=4, **EXACT_RUN), base_model, helper_model, judge)
    costs, score_round = [], engine.scorer.score_round

    def counted(survivors, as_committed):
        costs.append(read_cost(survivors, as_committed, "helper", helper_model.eos))
        return score_round(survivors, as_committed)

    engine.scorer.score_round = counted
    trajectory = engine.solve(PROBLEM)
    ctx = engine.sides["helper"].ctx
    sources = [s.source for s in trajectory.steps]
    assert trajectory.n_steps > 4 and {"base", "helper"} <= set(sources[:-1]), sources
    assert all(s.score is not None for s in trajectory.steps)
    prompt = len(helper_model.tokenize(engine.config.prompt.format(problem=PROBLEM)))
    sampled = sum(c.tokens - 1 for s in trajectory.steps for c in s.candidates if c.side == "helper")
    scored = sum(costs)
    assert len(costs) == sum(s.score is not None for s in trajectory.steps)
    committed = sum(1 if s.source == "helper" or s.score is not None else winner(s).tokens
                    for s in trajectory.steps[:-1])
    assert engine.scorer.decoded_tokens == scored
    assert ctx.decoded_tokens == prompt + sampled + committed + scored
    assert engine.prm is None and set(engine.peak_kv_bytes()) == {"base", "helper"}, "no context of a PRM's own"
    with pytest.raises(KVRescueError, match="to score the base's candidates in; use --concurrency 1 to 85"):
        Rescue(config(n=1, **EXACT_RUN), base_model, helper_model, judge, concurrency=86)


def test_a_problem_is_charged_all_its_llama_time_and_a_read_winner_is_the_helpers_commit(base_model, helper_model,
                                                                                          head_file):
    """Each context's llama.cpp time solving a problem is in its timings, its prompt and commits included. A base
    winner read whole is committed from where it was read: the decode of its tokens before the last is work that
    a commit of its text does with any choice, so it is charged to the helper, not to the PRM."""
    judge = helper_head(head_file, helper_model, "tiny")
    engine = Rescue(config(n=3, seed=4, **EXACT_RUN), base_model, helper_model, judge)
    scorer, moved, commit_held = engine.scorer, [], engine.scorer.commit_held

    def counted(slot, text):
        held = scorer.held.get(slot, {}).get(text)
        moved.append(held.body_tokens * scorer.body_seconds_per_token if held else 0.0)
        return commit_held(slot, text)

    scorer.commit_held = counted
    before = {name: gen.ctx.llama_seconds for name, gen in engine.sides.items()}
    trajectory = engine.solve(PROBLEM)
    spent = {name: gen.ctx.llama_seconds - before[name] for name, gen in engine.sides.items()}
    t = trajectory.timings
    assert sum(s.source == "base" and s.score is not None for s in trajectory.steps[:-1]) > 0
    assert scorer.committed_seconds == pytest.approx(sum(moved)) and scorer.committed_seconds > 0
    assert t["llama_base"] == pytest.approx(spent["base"], abs=1e-3)
    assert t["llama_helper"] == pytest.approx(spent["helper"] - scorer.llama_seconds + scorer.committed_seconds,
                                              abs=1e-3)
    assert t["prm"] == pytest.approx(engine.prm_seconds - scorer.committed_seconds, abs=1e-3)
    assert 0 < scorer.llama_seconds - scorer.committed_seconds < t["prm"]


def read_cost(survivors, as_committed, side: str, eos: int) -> int:
    """Tokens the judge decodes to read a round's survivors: one per text the helper sampled; the base's other
    texts in the tokens they are committed in, the tokens several begin with in common once, but whole a text
    that another one begins with."""
    total = 0
    for drafts in survivors.values():
        own = {d.content for d in drafts if d.side == side}
        pieces = {tuple(as_committed(d) or [eos]) for d in drafts if d.side != side and d.content not in own}
        begun = {p for p in pieces if any(len(q) > len(p) and q[:len(p)] == p for q in pieces)}
        prefixes = {p[:k] for p in pieces - begun for k in range(1, len(p) + 1)}
        total += len(own) + len(prefixes) + sum(len(p) for p in begun)
    return total


def winner(step):
    """The committed candidate (the pair shares one vocabulary: a base step is committed as it was sampled)."""
    return next(c for c in step.candidates if c.side == step.source and c.text == step.text)


def test_a_model_given_beside_a_preset_is_named_after_the_preset_note(tiny_prm_path):
    """The preset's note describes its own models: one given in place of the preset's is named after it."""
    notes = []
    options = {"preset": "tiny", "base": None, "helper": None, "prm": str(tiny_prm_path)}
    select_models(options, True, True, note=notes.append)
    assert notes[0].startswith("preset tiny: ")
    assert notes[1:] == [f"prm: {tiny_prm_path} (--prm), in place of the preset's"]
    for same in (None, str(select_models({**options, "prm": None}, True, True).paths["prm"])):
        notes.clear()
        select_models({**options, "prm": same}, True, True, note=notes.append)
        assert len(notes) == 1, "the preset's own PRM is not named again"


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


def test_a_separate_prm_refuses_a_head_trained_on_another_model_before_any_model_loads(base_path, helper_path,
                                                                                       tiny_prm_path, tmp_path,
                                                                                       monkeypatch):
    own = RewardHead.load(head_path(tiny_prm_path))
    foreign = dataclasses.replace(own, backbone=file_hash(base_path)).save(tmp_path / "foreign.head.npz")
    recorded = dataclasses.replace(own, backbone=file_hash(tiny_prm_path)).save(tmp_path / "recorded.head.npz")
    loaded = []
    monkeypatch.setattr("kvrescue_local.compose.Model", lambda path, **kw: loaded.append(path) or Model(path, **kw))
    common = ["solve", "--base", str(base_path), "--helper", str(helper_path), "-n", "2", "--max-tokens", "24", PROBLEM]
    result = CliRunner().invoke(main, [*common, "--prm", f"{tiny_prm_path}:{foreign}"])
    assert result.exit_code != 0 and "Traceback" not in result.output and not loaded
    (line,) = [x for x in result.output.splitlines() if x.startswith("Error:")]
    assert "trained on the hidden states of another model file" in line and tiny_prm_path.name in line, line
    for head in (recorded, head_path(tiny_prm_path)):  # its own file recorded, or none (as a converted checkpoint has)
        result = CliRunner().invoke(main, [*common, "--prm", f"{tiny_prm_path}:{head}"])
        assert result.exit_code == 0, result.output


def test_a_judge_needs_a_context_made_to_score_and_a_head_read_as_held(helper_model):
    gen = Generator("helper", helper_model, 2, 1024, None, SamplingParams(), 16, n_batch=128)
    with pytest.raises(KVRescueError, match="scores=True"):
        HelperJudge(gen, prm_format("helper-value"))
    with pytest.raises(KVRescueError, match="--format helper-value"):
        HelperJudge(judge_on(helper_model).gen, prm_format("chat-value"))
