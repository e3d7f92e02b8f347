"""KV budgets and eviction policies on the tiny models through llama.cpp."""

import dataclasses
import re

import numpy as np
import pytest
from decoding import greedy_evictions

from kvrescue_local.errors import KVRescueError
from kvrescue_local.eviction import (POLICIES, BudgetedSequences, EvictionInputs, KVBudget, evicted_runs, make_policy,
                                     policy_specs)
from kvrescue_local.eviction import reference
from kvrescue_local.eviction.base import max_pool
from kvrescue_local.eviction.rkv import redundancy
from kvrescue_local.runtime import Context, ContextParams
from kvrescue_local.runtime.attention import cell_scores, enable_scores, reset_scores

PROMPT = "<|im_start|>user\nLedger: a=17 b=42 c=5 d=93. Compute a+d-c.<|im_end|>\n<|im_start|>assistant\n"


def synthetic_inputs(budget: KVBudget, n=200, seed=0, n_layer=2, n_head_kv=2):
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.choice(1000, n, replace=False)).astype(np.int32)
    forced = budget.forced(positions, 0)
    return EvictionInputs(positions=positions, forced=forced, n_choose=budget.budget - int(forced.sum()),
                          window_attention=rng.random((n_layer, n)), cumulative_attention=rng.random(n) * 5,
                          keys=rng.standard_normal((n_layer, n_head_kv, n, 16)))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_exactly_the_budget_with_sinks_and_window(name):
    budget = KVBudget(budget=64, buffer=128, n_sink=4, window=8, policy=name)
    inputs = synthetic_inputs(budget)
    scores = make_policy(name).score(inputs)
    assert scores.shape == inputs.positions.shape and np.all(np.isfinite(scores))
    kept = budget.keep(inputs.positions, scores, n_prompt=0)
    assert kept.sum() == 64
    assert kept[:4].all() and kept[-8:].all()
    free = np.flatnonzero(~inputs.forced)
    chosen = free[kept[free]]
    rejected = free[~kept[free]]
    assert scores[chosen].min() >= scores[rejected].max(), "the policy's best scores are the ones kept"


def test_sinks_default_to_what_each_policy_s_reference_keeps():
    assert {name: KVBudget(policy=name).sinks for name in POLICIES} == {"h2o": 0, "rkv": 0, "snapkv": 0, "streaming": 4}
    assert KVBudget(policy="streaming", n_sink=2).sinks == 2
    assert KVBudget().policy == "rkv"


def test_streaming_keeps_sinks_and_the_most_recent():
    positions = np.arange(300, dtype=np.int32)
    budget = KVBudget(budget=64, window=8, policy="streaming")
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


def test_policy_specs_set_options_and_refuse_bad_ones():
    policy = make_policy("rkv:lam=0.1,kernel=5,similar=0.6")
    assert (policy.lam, policy.kernel, policy.similar) == (0.1, 5, 0.6)
    assert make_policy("snapkv:kernel=3").kernel == 3
    assert KVBudget(policy="rkv:lam=0.2").policy == "rkv:lam=0.2"
    for spec, message in [("lru", "unknown eviction policy 'lru'.*streaming"),
                          ("rkv:gamma=1", "policy rkv has no option 'gamma': its options are lam, kernel, similar"),
                          ("rkv:lam=high", r"rkv:lam='high' is not a float"),
                          ("rkv:kernel", "needs a value: write rkv:kernel=VALUE"),
                          ("rkv:lam=2", "lam=2.0 is out of range: rkv's lam takes 0.0 to 1.0; write e.g. rkv:lam=0.07"),
                          ("streaming:kernel=3", "policy streaming has no option 'kernel': its options are none")]:
        with pytest.raises(KVRescueError, match=message):
            KVBudget(policy=spec)


def test_every_numeric_policy_option_has_a_range_that_its_spec_is_held_to():
    """A size that would drive a loop or an array (rkv:kernel=1000000000 pooled once per kernel step) is refused
    when the spec is parsed: one line naming the option, its range and a value to write."""
    checked = 0
    for name, cls in POLICIES.items():
        for option in dataclasses.fields(cls):
            if type(option.default) not in (int, float):
                continue
            low, high = option.metadata["range"]
            assert low <= option.default <= high, (name, option.name)
            floats = ["1e300", "nan", "-inf"] if type(option.default) is float else []
            extremes = ["1000000000", "-1000000000", *floats]
            for text in extremes:
                with pytest.raises(KVRescueError, match=re.escape(f"is out of range: {name}'s {option.name} takes "
                                                                  f"{low:,} to {high:,}; write e.g. "
                                                                  f"{name}:{option.name}={option.default}")):
                    KVBudget(policy=f"{name}:{option.name}={text}")
            checked += 1
    assert checked == 4  # rkv's lam, kernel and similar, snapkv's kernel


def test_a_list_of_specs_splits_where_a_new_policy_starts():
    assert policy_specs("rkv:lam=0.1,kernel=5,snapkv, h2o") == ["rkv:lam=0.1,kernel=5", "snapkv", "h2o"]
    assert policy_specs("streaming") == ["streaming"]
    with pytest.raises(KVRescueError, match="policy rkv has no option 'snapkv'"):
        policy_specs("rkv:lam=0.1,snapkv=1")
    with pytest.raises(KVRescueError, match="no eviction policy"):
        policy_specs(" , ")


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
                if make_policy(policy).per_head:
                    # each (layer, head) now holds exactly the entries it chose, in budget cells
                    held = np.sort(seqs.entries(s, ctx.cells(s)[1]), axis=-1)
                    np.testing.assert_array_equal(held, inputs.head_positions[kept].reshape(held.shape))
                    assert kept[..., -1].all() and ctx.n_cells(s) == budget_size
                    continue
                again = budget.keep(inputs.positions, make_policy(policy).score(inputs), seqs.n_prompt)
                np.testing.assert_array_equal(kept, again)
                np.testing.assert_array_equal(ctx.cells(s)[1], inputs.positions[kept])
                assert kept[-1], "the newest position is always kept"
            assert ctx.n_cells(s) <= budget.limit
    assert fired >= n_seq * (2000 + len(prompt) - budget.limit) // budget.buffer
    assert seqs.fallback_evictions == 0
    assert all(ctx.pos_max(s) == len(prompt) + 1999 for s in range(n_seq))


def ingest(seqs: BudgetedSequences, seq_id: int, tokens, most: int, on_eviction=lambda: None) -> None:
    """What the generator does with a prompt or a committed step: chunks from next_chunk, enforce after each."""
    offset = 0
    while offset < len(tokens):
        size = seqs.next_chunk(seq_id, len(tokens) - offset, most)
        seqs.ctx.prefill(seq_id, tokens[offset:offset + size])
        offset += size
        if seqs.enforce(seq_id):
            on_eviction()


def token_stream(model, n: int) -> np.ndarray:
    text = (PROMPT + "a=17, d=93: 17+93=110, 110-5=105. The answer is 105.\n\n") * 4
    tokens = model.tokenize(text)
    assert len(tokens) >= n
    return tokens[:n]


@pytest.mark.parametrize("policy", ["rkv:heads=shared", "snapkv:heads=shared"])
def test_a_40_token_chunk_across_the_limit_ranks_by_the_last_window_queries(base_model, policy):
    """The window attention an eviction sees is exactly that of the `window` queries before it, however
    the tokens arrive: checked against a second context that only ever observes those queries."""
    budget = KVBudget(budget=24, buffer=16, window=8, policy=policy)  # limit 40
    tokens = token_stream(base_model, 60)
    params = ContextParams(n_ctx=256, type_k="f32", type_v="f32", flash_attn="off")
    seqs = BudgetedSequences(Context(base_model, params), budget)
    ingest(seqs, 0, tokens[:20], most=512)
    seen = []
    ingest(seqs, 0, tokens[20:60], most=512, on_eviction=lambda: seen.append(seqs.last_choice))
    assert len(seen) == 2 and seqs.fallback_evictions == 0
    inputs, _ = seen[0]  # the first eviction: 40 entries, positions 0..39
    np.testing.assert_array_equal(inputs.positions, np.arange(40))

    alone = Context(base_model, params)
    enable_scores(alone, budget.window)
    alone.prefill(0, tokens[:32])
    reset_scores(alone, 0)
    alone.prefill(0, tokens[32:40])
    cells, _ = alone.cells(0)
    expected = np.stack([cell_scores(alone, 0, layer)[cells] for layer in range(base_model.n_layer)])
    np.testing.assert_allclose(inputs.window_attention, expected, rtol=1e-4, atol=1e-6)
    assert seqs.ctx.n_cells(0) == 24 + 4


@pytest.mark.parametrize("policy, always", [("rkv:heads=shared", False), ("snapkv:heads=shared", False), ("h2o", True)])
def test_window_policies_pay_for_scores_only_inside_the_window(base_model, policy, always):
    """A window policy's sequence is observed from `window` tokens before the limit (its scores start from
    zero there); H2O, which reads attention since arrival, observes every query."""
    budget = KVBudget(budget=24, buffer=16, window=8, policy=policy)  # limit 40: the window opens at 32
    tokens = token_stream(base_model, 40)
    seqs = BudgetedSequences(Context(base_model, ContextParams(n_ctx=256, flash_attn="off")), budget)
    ingest(seqs, 0, tokens[:20], most=512)
    for token in tokens[20:31]:
        seqs.ctx.step([0], [int(token)])
        assert not seqs.enforce(0)
    unobserved = cell_scores(seqs.ctx, 0)  # 31 cells: outside the window
    assert (unobserved.sum() > 0) == always
    for token in tokens[31:33]:  # the first opens the window (32 cells), the second is its first query
        seqs.ctx.step([0], [int(token)])
        assert not seqs.enforce(0)
    cells = seqs.ctx.cells(0)[0]
    # each observed query adds n_head (4) per layer; a window policy's scores restarted at the window
    expected = unobserved[cells].sum() + 2 * 4 * base_model.n_layer if always else 4 * base_model.n_layer
    assert cell_scores(seqs.ctx, 0)[cells].sum() == pytest.approx(expected, rel=1e-3)


def test_a_chunk_past_the_window_start_is_counted_as_a_fallback(base_model):
    budget = KVBudget(budget=24, buffer=16, window=8)
    seqs = BudgetedSequences(Context(base_model, ContextParams(n_ctx=256, flash_attn="off")), budget)
    seqs.ctx.prefill(0, token_stream(base_model, 44))  # one decode from 0 to 44: no decode ended at 32
    assert seqs.enforce(0) and seqs.fallback_evictions == 1


def test_a_prompt_longer_than_the_budget_is_compressed_once_read(base_model):
    budget = KVBudget(budget=24, buffer=64, window=8)
    seqs = BudgetedSequences(Context(base_model, ContextParams(n_ctx=256, flash_attn="off")), budget)
    prompt = token_stream(base_model, 50)
    seqs.n_prompt = len(prompt)
    ingest(seqs, 0, prompt, most=16)
    assert seqs.ctx.n_cells(0) == 24 and seqs.evictions == 1 and seqs.fallback_evictions == 0
    assert seqs.last_choice[1][..., -8:].all()
    seqs.ctx.step([0], [int(prompt[0])])
    assert not seqs.enforce(0), "after the prompt, eviction waits for budget + buffer"


def test_max_pool_takes_the_max_of_each_position_s_existing_neighbours():
    x = np.random.default_rng(3).normal(size=(2, 11))
    for kernel in [*range(1, 26), 10**9]:  # wider than the sequence: each entry takes the max of all
        left, right = kernel // 2, (kernel - 1) // 2
        expected = np.stack([x[:, max(0, i - left): i + right + 1].max(axis=-1) for i in range(11)], axis=-1)
        assert np.array_equal(max_pool(x, kernel), expected), kernel


def test_redundancy_is_the_reference_s_and_spares_the_newest_copy():
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((2, 3, 40, 64))
    copies = [5, 17, 30]
    for c in copies[1:]:
        keys[:, :, c] = keys[:, :, copies[0]] + 0.01 * rng.standard_normal((2, 3, 64))
    ours = redundancy(keys)
    for layer in range(2):
        for head in range(3):
            theirs = reference.similarity_scores(keys[layer, head])
            np.testing.assert_allclose(ours[layer, head], theirs, rtol=1e-6)
            assert theirs[copies[0]] > theirs[copies[1]] > theirs[copies[2]], "oldest copy most redundant"
    budget = KVBudget(budget=39, window=8)  # one of the 32 candidates must go: a copy, the oldest
    positions = np.arange(40, dtype=np.int32)
    forced = budget.forced(positions, 0)
    inputs = EvictionInputs(positions, forced, budget.budget - int(forced.sum()),
                            window_attention=np.ones((2, 40)), keys=keys)
    kept = budget.keep(positions, make_policy("rkv").score(inputs), 0)
    assert np.flatnonzero(~kept).tolist() == [copies[0]]


def test_rkv_keeps_what_most_reference_heads_keep_on_captured_inputs(base_model):
    """On keys and window attention read from llama.cpp, the kept set is the top of the votes of the
    reference's per-(layer, head) selections, given the same (per-layer) attention."""
    budget = KVBudget(budget=64, buffer=128, window=8, policy="rkv:heads=shared")
    ctx = Context(base_model, ContextParams(n_ctx=1024, flash_attn="off"))
    seqs = BudgetedSequences(ctx, budget)
    checked = 0
    for inputs, kept in greedy_evictions(ctx, seqs, ctx.prefill(0, base_model.tokenize(PROMPT)), 600):
        n_layer, n_head_kv, n, _ = inputs.keys.shape
        assert (n_layer, n_head_kv * inputs.keys.shape[3]) == (base_model.n_layer, base_model.n_embd // 2)
        attention = inputs.window_attention[:, :-budget.window]
        attention = np.repeat((attention / attention.sum(axis=1, keepdims=True))[:, None], n_head_kv, axis=1)
        per_head = reference.select(inputs.keys, attention, budget.budget, budget.window)
        votes = per_head[..., :-budget.window].sum(axis=(0, 1))
        ours = np.flatnonzero(kept[:-budget.window])
        assert votes[ours].min() >= np.delete(votes, ours).max()
        assert reference.overlap(kept, per_head, budget.window) > 0.5
        checked += 1
    assert checked >= 3 and seqs.fallback_evictions == 0


def test_a_budget_larger_than_the_generation_changes_nothing(base_model):
    prompt = base_model.tokenize(PROMPT)

    def greedy(budgeted):
        ctx = Context(base_model, ContextParams(n_ctx=2048, type_k="f32", type_v="f32", flash_attn="off"))
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
    with pytest.raises(KVRescueError, match="kv.window 8 exceeds kv.buffer 4"):
        KVBudget(buffer=4, window=8)
    budget = KVBudget(budget=64, buffer=128)
    small = Context(base_model, ContextParams(n_ctx=512, n_seq_max=9))
    with pytest.raises(KVRescueError, match="too small for 9 sequences.*raise the base context"):
        budget.check_context(small, 9)


def test_a_fork_outside_the_observation_window_does_not_copy_its_stale_scores(base_model):
    """A window policy's scores outside an open window are reset when the next one opens: a fork then leaves the
    fork's scores as they were (on a GPU or an RPC server a copy costs a read and a write per layer)."""
    budget = KVBudget(budget=24, buffer=16, window=8)
    ctx = Context(base_model, ContextParams(n_ctx=256, n_seq_max=3))
    seqs = BudgetedSequences(ctx, budget)
    ctx.prefill(0, base_model.tokenize(PROMPT)[:20])
    while not seqs.enforce(0):
        ctx.step([0], [ord("x")])
    assert seqs.tracks[0].observed_from is None and cell_scores(ctx, 0).any(), "stale scores of the last window"
    seqs.fork(0, 1)
    assert not cell_scores(ctx, 1).any()
    while seqs.tracks[0].observed_from is None:
        ctx.step([0], [ord("x")])
        seqs.enforce(0)
    ctx.step([0], [ord("x")])
    seqs.fork(0, 2)  # inside the window: the fork's eviction ranks by the same queries
    np.testing.assert_array_equal(cell_scores(ctx, 2), cell_scores(ctx, 0))
