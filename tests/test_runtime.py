"""The runtime layer through llama.cpp on the tiny models."""

import numpy as np
import pytest

from kvrescue_local.runtime import Context, ContextParams, Sampler, SamplingParams, llama

PROMPT = "<|im_start|>user\nCompute a+b where a=17 and b=25.<|im_end|>\n<|im_start|>assistant\n"
EXACT = dict(type_k="f32", type_v="f32", flash_attn="off")


def greedy_continue(ctx, seq, token, n):
    """Decode `token` then n-1 greedy tokens on seq; returns the tokens and their logits."""
    tokens, logits = [], []
    for _ in range(n):
        ctx.step([seq], [token])
        row = ctx.logits(0)
        logits.append(row)
        token = int(np.argmax(row))
        tokens.append(token)
    return tokens, np.array(logits)


def test_tokenize_round_trip_with_special_tokens(base_model):
    ids = base_model.tokenize(PROMPT)
    im_start = base_model.tokenize("<|im_start|>")
    assert len(im_start) == 1 and im_start[0] >= 256, "a control token is one id beyond the bytes"
    assert (ids == im_start[0]).sum() == 2
    assert base_model.detokenize(ids) == PROMPT
    as_text = base_model.tokenize(PROMPT, special=False)
    assert im_start[0] not in as_text and len(as_text) > len(ids)
    assert base_model.detokenize(base_model.tokenize("naïve ∑ 日本\n\n")) == "naïve ∑ 日本\n\n"
    assert len(base_model.tokenize("step one.\n\n")) == len("step one.") + 1, "\\n\\n is one merged token"


def test_eight_sequences_batched_equal_sequential(base_model):
    prompt = base_model.tokenize(PROMPT)
    candidates = [ord(c) for c in "abcdefgh"]
    batched = Context(base_model, ContextParams(n_ctx=512, n_seq_max=8, **EXACT))
    batched.prefill(0, prompt)
    for seq in range(1, 8):
        batched.fork(0, seq)
    tokens = np.array(candidates, np.int32)
    batched_rows = []
    for _ in range(4):  # the first step shares the prompt, later ones have diverged
        batched.step(np.arange(8), tokens)
        rows = np.array([batched.logits(i) for i in range(8)])
        batched_rows.append(rows)
        tokens = rows.argmax(axis=1).astype(np.int32)

    for seq, first in enumerate(candidates):
        alone = Context(base_model, ContextParams(n_ctx=512, n_seq_max=1, **EXACT))
        alone.prefill(0, prompt)
        _, logits = greedy_continue(alone, 0, first, 4)
        for step in range(4):
            np.testing.assert_allclose(batched_rows[step][seq], logits[step], atol=1e-4, rtol=0)


def test_fork_decode_keep_winner_continues_like_a_straight_decode(base_model):
    prompt = base_model.tokenize(PROMPT)
    forked = Context(base_model, ContextParams(n_ctx=512, n_seq_max=4, **EXACT))
    forked.prefill(0, prompt)
    for seq in range(1, 4):
        forked.fork(0, seq)
    assert forked.used_cells(range(4)) == len(prompt), "forks share the prompt's cells"
    forked.step([0, 1, 2, 3], [ord("w"), ord("x"), ord("y"), ord("z")])
    assert forked.used_cells(range(4)) == len(prompt) + 4 and forked.used_cells([1, 3]) == len(prompt) + 2
    winner = 2
    forked.keep(winner)
    for loser in (0, 1, 3):
        assert forked.pos_max(loser) == -1 and forked.n_cells(loser) == 0
    next_token = int(np.argmax(forked.logits(winner)))
    tokens_forked, logits_forked = greedy_continue(forked, winner, next_token, 12)

    straight = Context(base_model, ContextParams(n_ctx=512, n_seq_max=1, **EXACT))
    row = straight.prefill(0, np.append(prompt, ord("y")))
    assert int(np.argmax(straight.logits(row))) == next_token
    tokens_straight, logits_straight = greedy_continue(straight, 0, next_token, 12)
    assert tokens_forked == tokens_straight
    np.testing.assert_allclose(logits_forked, logits_straight, atol=1e-4, rtol=0)
    assert forked.n_cells(winner) == len(prompt) + 1 + 12


def test_llama_seconds_count_memory_calls_beside_decoding(base_model):
    """Cost reports charge llama.cpp's memory calls (fork, remove, the cell map) to llama.cpp, not to the engine."""
    ctx = Context(base_model, ContextParams(n_ctx=512, n_seq_max=4))
    ctx.prefill(0, base_model.tokenize(PROMPT))
    decoded = ctx.decode_seconds
    assert decoded > 0 and ctx.llama_seconds >= decoded
    before = ctx.memory_seconds
    for seq in range(1, 4):
        ctx.fork(0, seq)
    ctx.remove(1, 2, 5)
    ctx.cells(2)
    assert ctx.memory_seconds > before and ctx.decode_seconds == decoded
    assert ctx.llama_seconds == pytest.approx(ctx.decode_seconds + ctx.sample_seconds + ctx.memory_seconds)


def test_removing_a_middle_range_is_exact_and_shown_by_the_cell_map(one_layer_model):
    """Removed cells get exactly zero attention: the continuation equals a context that never held them."""
    tokens = one_layer_model.tokenize("The ledger: a=17 b=42 c=5 d=93 e=11 f=64 g=30 h=8. Compute a+d-c+g step by step.\n\n")
    n = len(tokens)
    ctx = Context(one_layer_model, ContextParams(n_ctx=512, n_seq_max=1, **EXACT))
    ctx.prefill(0, tokens)
    ctx.remove(0, 10, 50)
    cells, positions = ctx.cells(0)
    expected = np.r_[0:10, 50:n]
    np.testing.assert_array_equal(positions, expected)
    assert len(set(cells.tolist())) == len(cells), "each position has its own cell"
    assert ctx.pos_max(0) == n - 1
    evicted_tokens, evicted_logits = greedy_continue(ctx, 0, ord("S"), 6)
    _, positions = ctx.cells(0)
    np.testing.assert_array_equal(positions, np.r_[0:10, 50:n + 6])

    # Reference: a fresh context that only ever saw the kept tokens, decoded contiguously and then
    # shifted to their original positions (llama.cpp re-ropes shifted K), so it never held the range.
    ref = Context(one_layer_model, ContextParams(n_ctx=512, n_seq_max=1, **EXACT))
    ref.prefill(0, tokens[np.r_[0:10, 50:n]])
    llama().llama_memory_seq_add(ref.memory, 0, 10, -1, 40)
    assert ref.pos_max(0) == n - 1
    ref_tokens, ref_logits = greedy_continue(ref, 0, ord("S"), 6)
    assert evicted_tokens == ref_tokens
    np.testing.assert_allclose(evicted_logits, ref_logits, atol=1e-4, rtol=0)


def test_freed_cells_are_reused(base_model):
    ctx = Context(base_model, ContextParams(n_ctx=256, n_seq_max=1))
    tokens = base_model.tokenize("x" * 200)
    ctx.prefill(0, tokens)
    ctx.remove(0, 0, 150)
    ctx.prefill(0, base_model.tokenize("y" * 150))  # only fits in the freed cells
    cells, positions = ctx.cells(0)
    assert len(cells) == 200 and positions[-1] == 349
    assert not np.all(np.diff(cells) > 0), "cell order no longer follows position order"


def test_sampler_chains_are_seeded_and_greedy_is_argmax(base_model):
    prompt = base_model.tokenize(PROMPT)
    ctx = Context(base_model, ContextParams(n_ctx=512, n_seq_max=1))

    def draw(params, n=16):
        ctx.drop(0)
        row = ctx.prefill(0, prompt)
        sampler, out = Sampler(params), []
        for _ in range(n):
            token = sampler.sample(ctx, row)
            out.append(token)
            ctx.step([0], [token])
            row = 0
        return out

    hot = dict(temperature=1.5, top_p=0.95, top_k=50, min_p=0.01)
    assert draw(SamplingParams(seed=7, **hot)) == draw(SamplingParams(seed=7, **hot))
    assert draw(SamplingParams(seed=7, **hot)) != draw(SamplingParams(seed=8, **hot))
    ctx.drop(0)
    ctx.prefill(0, prompt)
    expected = int(np.argmax(ctx.logits(-1)))
    assert draw(SamplingParams(temperature=0), n=1) == [expected]


def test_embeddings_context_returns_hidden_states(base_model):
    ctx = Context(base_model, ContextParams(n_ctx=256, n_seq_max=2, embeddings=True, **EXACT))
    tokens = base_model.tokenize("hello\n\n")
    ctx.decode(tokens, np.arange(len(tokens), dtype=np.int32), np.zeros(len(tokens), np.int32),
               np.ones(len(tokens), np.int8))
    states = np.array([ctx.embedding(i) for i in range(len(tokens))])
    assert states.shape == (len(tokens), base_model.n_embd)
    assert np.all(np.isfinite(states)) and np.abs(states[0] - states[-1]).max() > 1e-3


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_flash_attention_on_and_off_agree(base_model, kv_type):
    prompt = base_model.tokenize(PROMPT)
    rows = []
    for fa in ("on", "off"):
        ctx = Context(base_model, ContextParams(n_ctx=512, type_k=kv_type, type_v=kv_type, flash_attn=fa))
        rows.append(ctx.logits(ctx.prefill(0, prompt)))
    np.testing.assert_allclose(rows[0], rows[1], atol=5e-3, rtol=0)
