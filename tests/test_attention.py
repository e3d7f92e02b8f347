"""Per-sequence attention scores and K rows from llama.cpp's graph (patch 0002), on the tiny models.

The reference is llama.cpp's own attention: the `kq_soft_max-<il>` (and `Kcur-<il>`) tensors
captured through the `cb_eval` context parameter with flash attention off.
"""

import numpy as np
import pytest

from kvrescue_local.errors import KVRescueError
from kvrescue_local.runtime import Context, ContextParams
from kvrescue_local.runtime.attention import (GraphCapture, cell_scores, copy_scores, enable_scores, key_rows,
                                              n_embd_k_gqa, observe_scores, reset_scores)

PROMPT = "<|im_start|>user\nCompute a+b where a=17 and b=25.<|im_end|>\n<|im_start|>assistant\n"
EXACT = dict(type_k="f32", type_v="f32", flash_attn="off")
N_OBS = 4


# --- cb_eval reference --------------------------------------------------------------------

class Capture(GraphCapture):
    def __init__(self, prefixes=("kq_soft_max-", "Kcur-")):
        super().__init__(prefixes)

    def softmax(self, il: int) -> np.ndarray:
        """[n_head, n_tokens, n_kv] attention probabilities of layer il in the last decode."""
        return self.tensors[f"kq_soft_max-{il}"]


def observation_rows(seq_ids, n_obs: int) -> dict[int, list[int]]:
    """Batch rows observed per sequence: its last n_obs tokens of the batch."""
    rows: dict[int, list[int]] = {}
    for i, s in enumerate(seq_ids):
        rows.setdefault(int(s), []).append(i)
    return {s: r[-n_obs:] for s, r in rows.items()}


class Reference:
    """Scores accumulated in numpy from the captured softmax, per (layer, sequence), indexed by cell."""

    def __init__(self, ctx: Context, n_layer: int):
        self.ctx = ctx
        self.n_layer = n_layer
        self.scores = np.zeros((n_layer, ctx.n_seq_max, ctx.n_ctx))

    def after_decode(self, capture: Capture, seq_ids, new_positions: dict[int, list[int]]) -> None:
        # cells that received a token in this decode restart from zero for every sequence
        for s, positions in new_positions.items():
            cells, pos = self.ctx.cells(s)
            self.scores[:, :, cells[np.isin(pos, positions)]] = 0.0
        for il in range(self.n_layer):
            probs = capture.softmax(il)  # [n_head, n_tokens, n_kv]
            for s, rows in observation_rows(seq_ids, N_OBS).items():
                self.scores[il, s, :probs.shape[2]] += probs[:, rows, :].sum(axis=(0, 1))


def decode_and_track(ctx, ref, capture, tokens, seq_ids):
    """ctx.decode one batch (new tokens at each sequence's next positions) and update the reference."""
    seq_ids = np.asarray(seq_ids, np.int32)
    start = {int(s): ctx.pos_max(int(s)) + 1 for s in set(seq_ids.tolist())}
    positions, new_positions = [], {}
    for s in seq_ids:
        p = start[int(s)] + len(new_positions.get(int(s), []))
        new_positions.setdefault(int(s), []).append(p)
        positions.append(p)
    ctx.decode(np.asarray(tokens, np.int32), np.asarray(positions, np.int32), seq_ids, np.ones(len(tokens), np.int8))
    ref.after_decode(capture, seq_ids, new_positions)


def relative_error(actual, expected) -> float:
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


# --- tests --------------------------------------------------------------------------------

def test_scores_match_the_softmax_of_llama_cpp_across_decodes_and_eviction(base_model):
    capture = Capture()
    ctx = capture.context(base_model, ContextParams(n_ctx=256, **EXACT))
    enable_scores(ctx, N_OBS)
    ref = Reference(ctx, base_model.n_layer)
    prompt = base_model.tokenize(PROMPT)

    decode_and_track(ctx, ref, capture, prompt, np.zeros(len(prompt)))
    for token in b"x=42":
        decode_and_track(ctx, ref, capture, [token], [0])
    # evict a middle range: the next tokens reuse the freed cells, whose old scores must not survive
    ctx.remove(0, 5, 15)
    for token in b"so a+b":
        decode_and_track(ctx, ref, capture, [token], [0])
    reused = ctx.cells(0)[0][-6:]
    assert (reused < len(prompt)).any(), "the test expects freed cells to be reused"
    decode_and_track(ctx, ref, capture, list(b" is 42.\n\n"), np.zeros(9))

    assert not capture.skipped
    for il in range(base_model.n_layer):
        assert relative_error(cell_scores(ctx, 0, il), ref.scores[il, 0]) <= 1e-5
    assert relative_error(cell_scores(ctx, 0), ref.scores[:, 0].sum(axis=0)) <= 1e-5


def test_several_rows_of_several_sequences_in_one_batch(base_model):
    """A batch where two sequences have several observation rows each (the one-hot path), then one
    where each has one (the gather path): each column matches the reference on the cells it holds,
    and the idle third sequence's column does not move."""
    capture = Capture()
    ctx = capture.context(base_model, ContextParams(n_ctx=256, n_seq_max=3, **EXACT))
    enable_scores(ctx, N_OBS)
    ref = Reference(ctx, base_model.n_layer)
    prompt = base_model.tokenize(PROMPT)
    decode_and_track(ctx, ref, capture, prompt, np.zeros(len(prompt)))
    for seq in (1, 2):
        ctx.fork(0, seq)
        copy_scores(ctx, 0, seq)
        ref.scores[:, seq] = ref.scores[:, 0]
    idle = cell_scores(ctx, 2)
    decode_and_track(ctx, ref, capture, list(b"abcdefgh"), [0, 1, 0, 1, 0, 1, 1, 1])
    decode_and_track(ctx, ref, capture, list(b"xy"), [1, 0])

    assert not capture.skipped
    for seq in (0, 1):
        cells = ctx.cells(seq)[0]
        for il in range(base_model.n_layer):
            assert relative_error(cell_scores(ctx, seq, il)[cells], ref.scores[il, seq, cells]) <= 1e-5, (seq, il)
    held = ctx.cells(2)[0]
    np.testing.assert_array_equal(cell_scores(ctx, 2)[held], idle[held])


def test_flash_attention_on_and_off_agree(base_model):
    prompt = base_model.tokenize(PROMPT)
    scores = {}
    for fa in ("off", "on"):
        ctx = Context(base_model, ContextParams(n_ctx=256, flash_attn=fa, type_k="f16", type_v="f16"))
        enable_scores(ctx, N_OBS)
        ctx.prefill(0, prompt)
        for token in b"a+b=42":
            ctx.step([0], [token])
        scores[fa] = [cell_scores(ctx, 0, il) for il in range(base_model.n_layer)] + [cell_scores(ctx, 0)]
        ctx.free()
    for on, off in zip(scores["on"], scores["off"]):
        assert relative_error(on, off) <= 5e-3


def test_eight_candidates_decoded_together_score_like_each_alone(base_model):
    prompt = base_model.tokenize(PROMPT)
    batched = Context(base_model, ContextParams(n_ctx=512, n_seq_max=8, **EXACT))
    enable_scores(batched, N_OBS)
    batched.prefill(0, prompt)
    for seq in range(1, 8):
        batched.fork(0, seq)
        copy_scores(batched, 0, seq)
    tokens = np.array([ord(c) for c in "abcdefgh"], np.int32)
    history = [tokens]
    for _ in range(4):
        batched.step(np.arange(8), tokens)
        tokens = np.array([np.argmax(batched.logits(i)) for i in range(8)], np.int32)
        history.append(tokens)
    history = np.array(history[:-1])  # [step, seq]: the tokens each candidate decoded

    held = {seq: batched.cells(seq) for seq in range(8)}
    for seq in range(8):
        mine = cell_scores(batched, seq)
        others = np.setdiff1d(np.concatenate([held[s][0] for s in range(8)]), held[seq][0])
        assert len(others) == 7 * 4
        assert np.all(mine[others] == 0.0), "another candidate's attention landed in this candidate's column"

        alone = Context(base_model, ContextParams(n_ctx=512, n_seq_max=1, **EXACT))
        enable_scores(alone, N_OBS)
        alone.prefill(0, prompt)
        for token in history[:, seq]:
            alone.step([0], [token])
        for layer in [*range(base_model.n_layer), -1]:
            cells_b, pos_b = held[seq]
            cells_a, pos_a = alone.cells(0)
            np.testing.assert_array_equal(pos_a, pos_b)
            expected = cell_scores(alone, 0, layer)[cells_a]
            actual = cell_scores(batched, seq, layer)[cells_b]
            assert relative_error(actual, expected) <= 1e-5, (seq, layer)
        alone.free()


def test_reset_copy_and_disable(base_model):
    ctx = Context(base_model, ContextParams(n_ctx=256, n_seq_max=3, **EXACT))
    with pytest.raises(KVRescueError, match="enable_scores"):
        cell_scores(ctx, 0)
    enable_scores(ctx, N_OBS)
    prompt = base_model.tokenize(PROMPT)
    ctx.prefill(0, prompt)
    ctx.fork(0, 1)
    ctx.step([0, 1], [ord("x"), ord("y")])
    zero = np.zeros(ctx.n_ctx, np.float32)
    first, second = cell_scores(ctx, 0), cell_scores(ctx, 1)
    assert first.sum() > 0 and second.sum() > 0
    assert not np.array_equal(first, second)

    reset_scores(ctx, 1)
    np.testing.assert_array_equal(cell_scores(ctx, 1), zero)
    np.testing.assert_array_equal(cell_scores(ctx, 0), first)
    copy_scores(ctx, 0, 2)
    for layer in range(base_model.n_layer):
        np.testing.assert_array_equal(cell_scores(ctx, 2, layer), cell_scores(ctx, 0, layer))
    reset_scores(ctx)
    for seq in range(3):
        np.testing.assert_array_equal(cell_scores(ctx, seq), zero)

    # scores keep accumulating after a reset, and per layer they sum to n_head per observation row
    ctx.step([0], [ord("z")])
    assert cell_scores(ctx, 0, 1).sum() == pytest.approx(4, rel=1e-5)

    with pytest.raises(KVRescueError, match="n_seq_max"):
        cell_scores(ctx, 3)
    with pytest.raises(KVRescueError, match="layer 4 is out of range"):
        cell_scores(ctx, 0, base_model.n_layer)
    with pytest.raises(KVRescueError, match="n_obs"):
        enable_scores(ctx, -1)

    enable_scores(ctx, 0)  # off: buffers freed, the graph loses the extra nodes
    with pytest.raises(KVRescueError, match="enable_scores"):
        cell_scores(ctx, 0)
    ctx.step([0], [ord("w")])
    enable_scores(ctx, 2)  # back on: fresh zero scores
    np.testing.assert_array_equal(cell_scores(ctx, 0), zero)
    ctx.step([0], [ord("v")])
    assert cell_scores(ctx, 0, 0).sum() == pytest.approx(4, rel=1e-5)


def test_a_sequence_not_observed_adds_nothing(base_model):
    ctx = Context(base_model, ContextParams(n_ctx=256, n_seq_max=2, **EXACT))
    enable_scores(ctx, N_OBS)
    ctx.prefill(0, base_model.tokenize(PROMPT))
    ctx.fork(0, 1)
    copy_scores(ctx, 0, 1)
    observe_scores(ctx, 1, False)
    before = [cell_scores(ctx, seq, 0) for seq in (0, 1)]
    ctx.step([0, 1], [ord("x"), ord("y")])
    held = ctx.cells(1)[0]
    np.testing.assert_array_equal(cell_scores(ctx, 1, 0)[held], before[1][held])
    assert cell_scores(ctx, 0, 0).sum() == pytest.approx(before[0].sum() + 4, rel=1e-5)  # n_head per query

    observe_scores(ctx, -1, False)
    ctx.step([0, 1], [ord("x"), ord("y")])  # nobody observed: the graph has no accumulation at all
    observe_scores(ctx, 1, True)
    reset_scores(ctx, 1)
    ctx.step([0, 1], [ord("z"), ord("w")])
    for layer in range(base_model.n_layer):  # one observed query: n_head (4) per layer
        assert cell_scores(ctx, 1, layer).sum() == pytest.approx(4, rel=1e-5)


def test_key_rows_are_the_post_rope_keys(base_model):
    capture = Capture(prefixes=("Kcur-",))
    ctx = capture.context(base_model, ContextParams(n_ctx=256, **EXACT))
    prompt = base_model.tokenize(PROMPT)
    ctx.prefill(0, prompt)
    cells, pos = ctx.cells(0)
    width = n_embd_k_gqa(ctx)
    assert width == 64  # tiny base: 2 KV heads of 32
    pick = np.array([0, 7, 3, len(prompt) - 1])
    for il in range(base_model.n_layer):
        rows = key_rows(ctx, il, cells[pick])
        assert rows.shape == (len(pick), width)
        assert not capture.skipped
        kcur = capture.tensors[f"Kcur-{il}"]  # [n_tokens, n_head_kv, head_dim]
        expected = kcur.reshape(len(prompt), width)[pos[pick]]
        np.testing.assert_allclose(rows, expected, rtol=0, atol=1e-6)
    assert not np.allclose(rows[0], rows[1])
    assert key_rows(ctx, 0, []).shape == (0, width)
    with pytest.raises(KVRescueError, match="cell index out of range"):
        key_rows(ctx, 0, [ctx.n_ctx])
    with pytest.raises(KVRescueError, match="out of range"):
        key_rows(ctx, -1, [0])

    # an F16 cache gives the same keys to F16 precision
    half = Context(base_model, ContextParams(n_ctx=256, type_k="f16", type_v="f16", flash_attn="off"))
    half.prefill(0, prompt)
    np.testing.assert_allclose(key_rows(half, 2, half.cells(0)[0]), key_rows(ctx, 2, cells), rtol=0, atol=2e-2)


def test_enable_needs_a_unified_cache(base_model):
    ctx = Context(base_model, ContextParams(n_ctx=512, n_seq_max=2, kv_unified=False, **EXACT))
    with pytest.raises(KVRescueError, match="kv_unified=True"):
        enable_scores(ctx, N_OBS)
