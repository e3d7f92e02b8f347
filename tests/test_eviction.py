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


@pytest.mark.parametrize("budget_size", [64, 256])
def test_resident_cells_stay_within_budget_over_2000_tokens(base_model, budget_size):
    budget = KVBudget(budget=budget_size, buffer=128, n_sink=4, window=8, policy="streaming")
    n_seq = 4
    ctx = Context(base_model, ContextParams(n_ctx=budget.context_cells(n_seq, 512), n_seq_max=n_seq))
    seqs = BudgetedSequences(ctx, budget)
    prompt = base_model.tokenize(PROMPT)
    ctx.prefill(0, prompt)
    for s in range(1, n_seq):
        ctx.fork(0, s)
    tokens = np.array([ord(c) for c in "wxyz"], np.int32)
    for _ in range(2000):
        ctx.step(range(n_seq), tokens)
        tokens = np.array([int(np.argmax(ctx.logits(i))) for i in range(n_seq)], np.int32)
        for s in range(n_seq):
            fired = seqs.enforce(s)
            n = ctx.n_cells(s)
            assert n <= budget.limit
            if fired:
                _, positions = ctx.cells(s)
                top = ctx.pos_max(s)
                np.testing.assert_array_equal(positions, np.r_[0:4, top - budget_size + 5:top + 1])
    assert seqs.evictions >= n_seq * (2000 + len(prompt) - budget.limit) // budget.buffer
    assert all(ctx.pos_max(s) == len(prompt) + 1999 for s in range(n_seq))


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
