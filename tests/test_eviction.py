"""KV budgets and eviction policies on the tiny models through llama.cpp."""

import numpy as np
import pytest

from kvrescue_local.errors import KVRescueError
from kvrescue_local.eviction import POLICIES, BudgetedSequences, EvictionInputs, KVBudget, evicted_runs, make_policy
from kvrescue_local.runtime import Context, ContextParams

PROMPT = "<|im_start|>user\nLedger: a=17 b=42 c=5 d=93. Compute a+d-c.<|im_end|>\n<|im_start|>assistant\n"


def synthetic_inputs(n=200, seed=0):
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.choice(1000, n, replace=False)).astype(np.int32)
    return EvictionInputs(positions=positions, window_attention=rng.random(n), cumulative_attention=rng.random(n) * 5,
                          keys=rng.standard_normal((n, 32)))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_exactly_the_budget_with_sinks_and_window(name):
    inputs = synthetic_inputs()
    budget = KVBudget(budget=64, buffer=128, n_sink=4, window=8, policy=name)
    scores = make_policy(name).score(inputs)
    assert scores.shape == inputs.positions.shape and np.all(np.isfinite(scores))
    kept = budget.keep(inputs.positions, scores, n_prompt=0)
    assert kept.sum() == 64
    assert kept[:4].all() and kept[-8:].all()
    free = np.flatnonzero(~np.r_[np.ones(4, bool), np.zeros(len(kept) - 12, bool), np.ones(8, bool)])
    chosen = free[kept[free]]
    rejected = free[~kept[free]]
    assert scores[chosen].min() >= scores[rejected].max(), "the policy's best scores are the ones kept"


def test_streaming_keeps_sinks_and_the_most_recent():
    positions = np.arange(300, dtype=np.int32)
    budget = KVBudget(budget=64, n_sink=4, window=8)
    kept = budget.keep(positions, make_policy("streaming").score(EvictionInputs(positions)), 0)
    np.testing.assert_array_equal(positions[kept], np.r_[0:4, 240:300])


def test_protected_prompt_is_kept():
    positions = np.arange(300, dtype=np.int32)
    budget = KVBudget(budget=64, n_sink=4, window=8, protect_prompt=True)
    kept = budget.keep(positions, positions.astype(float), n_prompt=30)
    np.testing.assert_array_equal(positions[kept], np.r_[0:30, 266:300])
    with pytest.raises(KVRescueError, match="protected prompt"):
        budget.keep(positions, positions.astype(float), n_prompt=100)


def test_evicted_runs_cover_exactly_the_dropped_positions():
    positions = np.array([0, 1, 2, 5, 6, 9, 10, 11, 15])
    kept = np.array([1, 0, 0, 0, 1, 0, 0, 1, 1], bool)
    assert evicted_runs(positions, kept) == [(1, 6), (9, 11)]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("budget_size", [64, 256])
def test_resident_cells_stay_within_budget_over_2000_tokens(base_model, budget_size, policy):
    """Two candidates decode together; each is budgeted on its own, exactly as its policy chose."""
    budget = KVBudget(budget=budget_size, buffer=128, n_sink=4, window=8, policy=policy)
    n_seq = 2
    ctx = Context(base_model, ContextParams(n_ctx=budget.context_cells(n_seq, 512), n_seq_max=n_seq, flash_attn="off"))
    seqs = BudgetedSequences(ctx, budget)
    prompt = base_model.tokenize(PROMPT)
    ctx.prefill(0, prompt)
    seqs.fork(0, 1)
    tokens = np.array([ord("w"), ord("x")], np.int32)
    fired = 0
    for _ in range(2000):
        ctx.step(range(n_seq), tokens)
        tokens = np.array([int(np.argmax(ctx.logits(i))) for i in range(n_seq)], np.int32)
        for s in range(n_seq):
            if seqs.enforce(s):
                fired += 1
                inputs, kept = seqs.last_choice
                again = budget.keep(inputs.positions, make_policy(policy).score(inputs), seqs.n_prompt)
                np.testing.assert_array_equal(kept, again)
                np.testing.assert_array_equal(ctx.cells(s)[1], inputs.positions[kept])
                assert kept[-1], "the newest position is always kept"
            assert ctx.n_cells(s) <= budget.limit
    assert fired >= n_seq * (2000 + len(prompt) - budget.limit) // budget.buffer
    assert all(ctx.pos_max(s) == len(prompt) + 1999 for s in range(n_seq))


def rkv_reference(inputs, budget, lam=0.1, kernel=7, similar=0.5):
    """R-KV's selection written out directly from its definition (docs/design.md §5), loop by loop."""
    n = len(inputs.positions)
    attention = np.array([max(inputs.window_attention[max(0, i - kernel // 2):i + kernel // 2 + 1]) for i in range(n)])
    importance = attention / attention.sum()
    keys = inputs.keys / np.linalg.norm(inputs.keys, axis=1, keepdims=True)
    mean_similarity = np.zeros(n)
    for i in range(n):
        similar_later = [j for j in range(i + 1, n) if keys[i] @ keys[j] > similar]
        exempt = similar_later[-1] if similar_later else None
        mean_similarity[i] = sum(keys[i] @ keys[j] for j in range(n) if j not in (i, exempt)) / (n - 1)
    redundancy = np.exp(mean_similarity - mean_similarity.max())
    redundancy /= redundancy.sum()
    score = lam * importance - (1 - lam) * redundancy
    forced = set(range(budget.n_sink)) | set(range(n - budget.window, n))
    free = sorted(set(range(n)) - forced, key=lambda i: (score[i], inputs.positions[i]), reverse=True)
    keep = forced | set(free[: budget.budget - len(forced)])
    return np.array([i in keep for i in range(n)])


def test_rkv_selection_equals_the_formula_on_captured_inputs(base_model):
    budget = KVBudget(budget=64, buffer=128, policy="rkv")
    ctx = Context(base_model, ContextParams(n_ctx=1024, flash_attn="off"))
    seqs = BudgetedSequences(ctx, budget)
    row = ctx.prefill(0, base_model.tokenize(PROMPT))
    checked = 0
    for _ in range(600):
        token = int(np.argmax(ctx.logits(row)))
        ctx.step([0], [token])
        row = 0
        if seqs.enforce(0):
            inputs, kept = seqs.last_choice
            assert inputs.keys.shape == (len(inputs.positions), base_model.n_embd // 2)  # n_head_kv * head_dim
            assert np.all(inputs.window_attention >= -1e-6) and inputs.window_attention.sum() > 0
            np.testing.assert_array_equal(kept, rkv_reference(inputs, budget))
            checked += 1
    assert checked >= 3


def test_a_budget_larger_than_the_generation_changes_nothing(base_model):
    prompt = base_model.tokenize(PROMPT)

    def greedy(budgeted):
        ctx = Context(base_model, ContextParams(n_ctx=2048, kv_type="f32", flash_attn="off"))
        seqs = BudgetedSequences(ctx, KVBudget(budget=1000, buffer=128)) if budgeted else None
        row = ctx.prefill(0, prompt)
        out = []
        for _ in range(300):
            token = int(np.argmax(ctx.logits(row)))
            out.append(token)
            ctx.step([0], [token])
            row = 0
            if seqs:
                assert not seqs.enforce(0)
        return out

    assert greedy(True) == greedy(False)


def test_refusals(base_model):
    with pytest.raises(KVRescueError, match="must exceed sinks"):
        KVBudget(budget=12, n_sink=4, window=8)
    with pytest.raises(KVRescueError, match="unknown eviction policy 'lru'.*streaming"):
        KVBudget(policy="lru")
    budget = KVBudget(budget=64, buffer=128)
    small = Context(base_model, ContextParams(n_ctx=512, n_seq_max=9))
    with pytest.raises(KVRescueError, match="too small for 9 sequences.*raise the base context"):
        budget.check_context(small, 9)
