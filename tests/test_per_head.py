"""Eviction per (layer, KV head): scores per KV head, compaction of the cells (patch 0004), the per-head map."""

import numpy as np
import pytest
from conftest import N_GPU_LAYERS
from decoding import greedy_evictions

from kvrescue_local.errors import KVRescueError
from kvrescue_local.eviction import BudgetedSequences, KVBudget, evicted_runs, reference
from kvrescue_local.gguf_export import Qwen2Shape, write_tiny_model
from kvrescue_local.runtime import Context, ContextParams, Model
from kvrescue_local.runtime.attention import (GraphCapture, cell_scores, enable_scores, head_scores, key_rows,
                                              observe_scores, span_scores)
from kvrescue_local.runtime.compaction import compact

PROMPT = "Q: Tom has 17 apples and buys 93 more, then eats 5. How many are left?\nA: 17+93=110, 110-5=105.\n"
# transposed V (flash attention off) and quantized caches (flash attention on)
CACHES = [pytest.param("f32", "off", id="f32-transposed-v"), pytest.param("q8_0", "on", id="q8_0-flash"),
          pytest.param("q4_0", "on", id="q4_0-flash")]
# Heads of 64 values: a q8_0 or q4_0 head is a whole number of 4-byte words, so a compaction moves it in a graph on
# the cache's backend; the tiny base's 32-value heads (34 and 18 bytes) move by host copies.
WIDE_HEADS = Qwen2Shape(n_embd=128, n_layer=2, n_head=2, n_head_kv=2, n_ff=128)
MODELS = ["base_model", "wide_head_model"]


@pytest.fixture(scope="module")
def wide_head_model(tiny_dir):
    return Model(write_tiny_model(tiny_dir / "wide-heads.gguf", WIDE_HEADS, seed=3), n_gpu_layers=N_GPU_LAYERS)


def tokens_of(model, n: int) -> np.ndarray:
    tokens = model.tokenize(PROMPT * 4)
    return tokens[:n]


def greedy(ctx: Context, seq: int, first: int, steps: int) -> list[int]:
    out, token = [], first
    for _ in range(steps):
        ctx.step([seq], [token])
        token = int(np.argmax(ctx.logits(0)))
        out.append(token)
    return out


def rotation_moves(ctx: Context, seq: int, cells: np.ndarray) -> list[list[int]]:
    """Every (layer, head) moves each of the sequence's cells but the first and last into another one,
    a cycle of a different length per head: the same tokens, in other cells."""
    moves = [[], [], [], []]
    inner = cells[1:-1]
    for layer in range(ctx.model.n_layer):
        for head in range(ctx.model.n_head_kv):
            shift = 1 + (layer * ctx.model.n_head_kv + head) % (len(inner) - 1)
            for src, dst in zip(inner, np.roll(inner, shift)):
                for column, value in zip(moves, (layer, head, src, dst)):
                    column.append(int(value))
    return moves


@pytest.mark.parametrize("kv_type, flash_attn", CACHES)
def test_a_relocation_of_the_same_tokens_gives_the_same_greedy_tokens_for_256_steps(base_model, kv_type, flash_attn):
    params = ContextParams(n_ctx=512, type_k=kv_type, type_v=kv_type, flash_attn=flash_attn)
    moved, still = Context(base_model, params), Context(base_model, params)
    prompt = tokens_of(base_model, 60)
    for ctx in (moved, still):
        ctx.prefill(0, prompt)
    cells, positions = moved.cells(0)
    compact(moved, 0, *rotation_moves(moved, 0, cells))
    np.testing.assert_array_equal(moved.cells(0)[1], positions)
    assert greedy(moved, 0, int(prompt[-1]), 256) == greedy(still, 0, int(prompt[-1]), 256)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_a_relocation_moves_each_head_s_k_rows_exactly(request, model, kv_type):
    base_model = request.getfixturevalue(model)
    ctx = Context(base_model, ContextParams(n_ctx=256, type_k=kv_type, type_v=kv_type, flash_attn="on"))
    ctx.prefill(0, tokens_of(base_model, 30))
    cells, _ = ctx.cells(0)
    width = base_model.n_embd_k_gqa // base_model.n_head_kv
    before = [key_rows(ctx, layer, cells).reshape(len(cells), -1, width) for layer in range(base_model.n_layer)]
    layer, head, src, dst = rotation_moves(ctx, 0, cells)
    compact(ctx, 0, layer, head, src, dst)
    index = {int(c): i for i, c in enumerate(cells)}
    after = [key_rows(ctx, l, cells).reshape(len(cells), -1, width) for l in range(base_model.n_layer)]
    for l, h, s, d in zip(layer, head, src, dst):
        assert np.array_equal(after[l][index[d], h], before[l][index[s], h])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kv_type, flash_attn", CACHES + [pytest.param("f16", "off", id="f16-transposed-v")])
def test_compacting_one_sequence_leaves_every_other_sequence_byte_identical(request, model, kv_type, flash_attn):
    """Seq 1 is a fork of seq 0 and shares its cells with seqs 0 and 2: its compaction moves it to free cells.
    The other context moves each head into its own cell, so that both lay their cells out alike."""
    base_model = request.getfixturevalue(model)
    params = ContextParams(n_ctx=512, n_seq_max=3, type_k=kv_type, type_v=kv_type, flash_attn=flash_attn)
    moved, still = Context(base_model, params), Context(base_model, params)
    prompt = tokens_of(base_model, 40)
    for ctx in (moved, still):
        ctx.prefill(0, prompt)
        ctx.fork(0, 1)
        ctx.fork(0, 2)
        ctx.step([0, 1, 2], [ord("a"), ord("b"), ord("c")])
    cells, positions = moved.cells(1)
    layer, head, src, dst = rotation_moves(moved, 1, cells)
    compact(moved, 1, layer, head, src, dst)
    compact(still, 1, layer, head, dst, dst)
    np.testing.assert_array_equal(moved.cells(1)[1], positions)
    np.testing.assert_array_equal(moved.cells(1)[0], still.cells(1)[0])
    assert len(set(moved.cells(1)[0][1:-1]) & set(moved.cells(0)[0])) == 0, "shared cells are never written"
    for ctx in (moved, still):
        ctx.step([0, 1, 2], [ord("x"), ord("y"), ord("z")])
    for row in (0, 2):
        assert moved.logits(row).tobytes() == still.logits(row).tobytes()
    np.testing.assert_allclose(moved.logits(1), still.logits(1), rtol=0.05, atol=0.05)


def test_every_head_keeping_the_same_set_is_byte_identical_to_the_shared_set(base_model):
    budget = KVBudget(budget=24, buffer=16, window=8)
    params = ContextParams(n_ctx=256, type_k="f32", type_v="f32", flash_attn="off")
    per_head, shared = BudgetedSequences(Context(base_model, params), budget), Context(base_model, params)
    prompt = tokens_of(base_model, 40)
    for ctx in (per_head.ctx, shared):
        ctx.prefill(0, prompt)
    cells, positions = shared.cells(0)
    forced = budget.forced(positions, 0)
    kept = forced.copy()
    kept[np.random.default_rng(0).choice(np.flatnonzero(~forced), budget.budget - int(forced.sum()), replace=False)] = True
    held = np.broadcast_to(kept, (base_model.n_layer, base_model.n_head_kv, len(kept))).copy()
    per_head.apply_heads(0, cells, positions, per_head.entries(0, positions), held, forced)
    for p0, p1 in evicted_runs(positions, kept):
        shared.remove(0, p0, p1)
    assert per_head.moved_heads == 0 and per_head.head_maps[0] == {}
    for token in tokens_of(base_model, 20):
        for ctx in (per_head.ctx, shared):
            ctx.step([0], [int(token)])
        assert per_head.ctx.logits(0).tobytes() == shared.logits(0).tobytes()


def test_each_head_keeps_exactly_what_the_reference_selects(base_model):
    """At every eviction, compactions before it included, each (layer, KV head) keeps what
    eviction/reference.py selects from the same keys and window attention, and then holds it."""
    budget = KVBudget(budget=48, buffer=32, window=8)
    ctx = Context(base_model, ContextParams(n_ctx=1024, n_seq_max=2, flash_attn="off"))
    seqs = BudgetedSequences(ctx, budget)
    checked = 0
    for inputs, kept in greedy_evictions(ctx, seqs, ctx.prefill(0, tokens_of(base_model, 40)), 200):
        attention = inputs.window_attention[..., :-budget.window]
        attention = attention / attention.sum(axis=-1, keepdims=True)
        np.testing.assert_array_equal(kept, reference.select(inputs.keys, attention, budget.budget, budget.window))
        held = np.sort(seqs.entries(0, ctx.cells(0)[1]), axis=-1)
        np.testing.assert_array_equal(held, inputs.head_positions[kept].reshape(held.shape))
        checked += 1
        if checked == 2:
            seqs.fork(0, 1)  # the map follows the fork
            np.testing.assert_array_equal(seqs.entries(1, ctx.cells(1)[1]), seqs.entries(0, ctx.cells(0)[1]))
    assert checked >= 4 and seqs.moved_heads > 0


def test_per_head_scores_are_the_reference_s_window_attention(base_model):
    """Max-pooled query groups, softmax over the keys before the window, summed over the window queries:
    against eviction/reference.py's window_attention on the q.k logits captured through cb_eval."""
    window = 8
    capture = GraphCapture(("kq-",))
    ctx = capture.context(base_model, ContextParams(n_ctx=256, type_k="f32", type_v="f32", flash_attn="off"))
    enable_scores(ctx, window, per_head=True)
    observe_scores(ctx, 0, False)
    tokens = tokens_of(base_model, 40)
    ctx.prefill(0, tokens[:32])
    observe_scores(ctx, 0, True)
    capture.tensors.clear()
    ctx.prefill(0, tokens[32:])  # one ubatch: its 8 queries are the window
    cells, _ = ctx.cells(0)
    head_dim = base_model.n_embd // base_model.n_head
    for layer in range(base_model.n_layer):
        logits = capture.tensors[f"kq-{layer}"][:, :, cells] / np.sqrt(head_dim)  # [n_head, 8, n]
        expected = reference.window_attention(logits, base_model.n_head_kv, window) * window
        ours = head_scores(ctx, 0, layer)[:, cells]
        np.testing.assert_allclose(ours[:, :-window], expected, rtol=1e-4, atol=1e-6)
        assert not ours[:, -window:].any(), "the window's own keys are outside the softmax"


def test_the_scores_of_every_layer_read_at_once_are_each_layer_s_per_head(base_model):
    ctx = Context(base_model, ContextParams(n_ctx=256, n_seq_max=2))
    enable_scores(ctx, 8, per_head=True)
    tokens = tokens_of(base_model, 40)
    ctx.prefill(0, tokens[:20])
    ctx.prefill(1, tokens[20:])  # seq 1's cells start after seq 0's: a span not at cell 0
    for seq in (0, 1):
        cells = ctx.cells(seq)[0][::-1]
        expected = np.stack([head_scores(ctx, seq, layer)[:, cells] for layer in range(base_model.n_layer)])
        assert expected.any()
        np.testing.assert_array_equal(span_scores(ctx, seq, cells), expected)
    with pytest.raises(KVRescueError, match="cell index out of range"):
        span_scores(ctx, 0, [ctx.n_ctx])
    enable_scores(ctx, 8, per_head=False)
    ctx.prefill(0, tokens[:8])
    cells = ctx.cells(0)[0]
    expected = np.stack([cell_scores(ctx, 0, layer)[cells] for layer in range(base_model.n_layer)])[:, None]
    assert expected.any()
    np.testing.assert_array_equal(span_scores(ctx, 0, cells), expected)


def test_layer_0_attention_after_compaction_is_numpy_attention_over_each_head_s_kept_entries(base_model):
    capture = GraphCapture(("Qcur-0", "Kcur-0", "Vcur-0", "kqv_out-0"))
    ctx = capture.context(base_model, ContextParams(n_ctx=256, n_seq_max=1, type_k="f32", type_v="f32", flash_attn="off"))
    budget = KVBudget(budget=24, buffer=16, window=8)
    seqs = BudgetedSequences(ctx, budget)
    prompt = tokens_of(base_model, 40)
    ctx.prefill(0, prompt)
    values = capture.tensors["Vcur-0"]  # [n, n_head_kv, head_dim] by position
    cells, positions = ctx.cells(0)
    keys = key_rows(ctx, 0, cells).reshape(len(cells), base_model.n_head_kv, -1)  # read before compaction
    forced = budget.forced(positions, 0)
    rng = np.random.default_rng(5)
    held = np.zeros((base_model.n_layer, base_model.n_head_kv, len(cells)), bool)
    for layer, head in np.ndindex(held.shape[:2]):
        held[layer, head] = forced
        held[layer, head, rng.choice(np.flatnonzero(~forced), budget.budget - int(forced.sum()), replace=False)] = True
    seqs.apply_heads(0, cells, positions, seqs.entries(0, positions), held, forced)
    assert seqs.moved_heads > 0
    capture.tensors.clear()
    ctx.step([0], [int(prompt[-1])])
    q = capture.tensors["Qcur-0"][0]  # [n_head, head_dim]
    k_new, v_new = capture.tensors["Kcur-0"][0], capture.tensors["Vcur-0"][0]
    out = capture.tensors["kqv_out-0"].reshape(base_model.n_head, -1)
    group = base_model.n_head // base_model.n_head_kv
    for qh in range(base_model.n_head):
        h = qh // group
        kept = np.flatnonzero(held[0, h])
        k = np.vstack([keys[kept, h], k_new[h][None]])
        v = np.vstack([values[positions[kept], h], v_new[h][None]])
        logits = k @ q[qh] / np.sqrt(q.shape[-1])
        p = np.exp(logits - logits.max())
        np.testing.assert_allclose(out[qh], (p / p.sum()) @ v, rtol=1e-4, atol=1e-5)
