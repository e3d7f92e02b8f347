"""Per-sequence attention scores and K rows, computed inside llama.cpp's graph (patch 0002).

Once `enable_scores(ctx, n_obs)` is on, every llama_decode adds, for each sequence in
the batch, the attention that its last `n_obs` tokens of that batch pay to each KV cell
(softmax over keys with the model's own mask and scale, summed over heads) into a
per-layer, per-sequence accumulator that lives on the device of that layer's K cache.
Scores are indexed by cell (see `Context.cells` for the cell -> position map); a cell's
scores restart from zero when a new token is written into it. `observe_scores` switches a
sequence's accumulation off (a decode then costs nothing for its tokens) and back on.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..errors import KVRescueError
from .context import Context, ContextParams
from .lib import ggml_base, llama, patched

_F32P = ctypes.POINTER(ctypes.c_float)
_I32P = ctypes.POINTER(ctypes.c_int32)


def enable_scores(ctx: Context, n_obs: int, per_head: bool = False) -> None:
    """Accumulate attention scores from the last n_obs tokens of each sequence per decode; 0 turns it off.

    per_head: one score per (cell, layer, KV head), as R-KV computes it: each KV head's query-group logits
    max-pooled before the softmax, which spans the keys before the sequence's observation window (the keys
    written since `observe_scores` switched it on are left out); read with `head_scores`."""
    if n_obs < 0:
        raise KVRescueError(f"n_obs must be >= 0 (0 turns attention scores off), got {n_obs}")
    rc = ctx.call(patched().llama_kvr_attn_enable, ctx.handle, int(n_obs), bool(per_head))
    if rc == -1:
        raise KVRescueError("attention scores need a plain attention KV cache, and this model's memory is recurrent, "
                            "hybrid or sliding-window: use a pure-attention model")
    if rc == -2:
        raise KVRescueError("attention scores need a unified KV cache: create the context with "
                            "ContextParams(kv_unified=True)")
    if rc == -5:
        raise KVRescueError("per-head attention scores need the same number of KV heads in every layer: use the "
                            "shared-set mode (e.g. --policy rkv:heads=shared)")
    if rc == -4:
        raise KVRescueError("could not allocate the attention score buffers (n_ctx x n_seq_max floats per layer): "
                            "lower n_ctx or n_seq_max, or free device memory")
    if rc != 0:
        raise KVRescueError(f"llama_kvr_attn_enable failed with status {rc}")


def reset_scores(ctx: Context, seq_id: int = -1) -> None:
    """Zero the scores of seq_id (-1: every sequence)."""
    if seq_id >= 0:
        ctx.check_seq(seq_id)
    ctx.call(patched().llama_kvr_attn_reset, ctx.handle, int(seq_id))


def observe_scores(ctx: Context, seq_id: int, observe: bool) -> None:
    """Whether seq_id's tokens (-1: every sequence's) add to its scores; all do after `enable_scores`. The
    scores of a sequence not observed are not maintained: reset them before observing it again."""
    if seq_id >= 0:
        ctx.check_seq(seq_id)
    ctx.call(patched().llama_kvr_attn_observe, ctx.handle, int(seq_id), bool(observe))


def copy_scores(ctx: Context, src: int, dst: int) -> None:
    """Give dst the scores of src (after `ctx.fork(src, dst)`, so the fork starts with its parent's scores)."""
    ctx.check_seq(src)
    ctx.check_seq(dst)
    ctx.call(patched().llama_kvr_attn_copy, ctx.handle, int(src), int(dst))


def check_layer(ctx: Context, layer: int, allow_sum: bool) -> None:
    n_layer = ctx.model.n_layer
    low = -1 if allow_sum else 0
    if not low <= layer < n_layer:
        hint = " (-1 sums the layers)" if allow_sum else ""
        raise KVRescueError(f"layer {layer} is out of range: this model has layers 0..{n_layer - 1}{hint}")


def cell_scores(ctx: Context, seq_id: int, layer: int = -1) -> np.ndarray:
    """Accumulated scores of seq_id, one per KV cell (length ctx.n_ctx): one layer, or summed over layers (-1)."""
    ctx.check_seq(seq_id)
    check_layer(ctx, layer, allow_sum=True)
    out = np.zeros(ctx.n_ctx, np.float32)
    n = ctx.call(patched().llama_kvr_attn_get, ctx.handle, int(seq_id), int(layer), out.ctypes.data_as(_F32P),
                 ctx.n_ctx)
    if n == -1:
        raise KVRescueError("attention scores are not enabled on this context: call enable_scores(ctx, n_obs) "
                            "before decoding")
    if n == -2:
        raise KVRescueError(f"sequence id {seq_id} is beyond this context's n_seq_max={ctx.n_seq_max}: "
                            "create it with a larger n_seq_max")
    if n == -3:
        raise KVRescueError(f"layer {layer} has no KV cache in this context: pick a layer that has one")
    if n < 0:
        raise KVRescueError(f"llama_kvr_attn_get failed with status {n}")
    return out


def head_scores(ctx: Context, seq_id: int, layer: int) -> np.ndarray:
    """[n_head, n_ctx]: the scores of seq_id in layer per KV head (n_head = 1 unless enabled per_head)."""
    ctx.check_seq(seq_id)
    check_layer(ctx, layer, allow_sum=False)
    n_head = n_head_kv(ctx)
    out = np.zeros((n_head, ctx.n_ctx), np.float32)
    n = ctx.call(patched().llama_kvr_attn_get_heads, ctx.handle, int(seq_id), int(layer), out.ctypes.data_as(_F32P),
                 ctx.n_ctx)
    if n < 0:
        raise KVRescueError(f"llama_kvr_attn_get_heads failed with status {n}: enable per-head scores "
                            "(enable_scores(ctx, n_obs, per_head=True)) before decoding")
    return out


def span_scores(ctx: Context, seq_id: int, cells) -> np.ndarray:
    """[n_layer, n_head, len(cells)]: the scores of seq_id in the given cells of every layer and head (n_head: the
    KV heads when enabled per_head, else 1), read in one transfer per layer of the span of cells they cover."""
    ctx.check_seq(seq_id)
    cells = np.asarray(cells, dtype=np.int64).reshape(-1)
    n_layer = ctx.model.n_layer
    if len(cells) == 0:
        return np.zeros((n_layer, 1, 0), np.float32)
    if cells.min() < 0 or cells.max() >= ctx.n_ctx:
        raise KVRescueError(f"cell index out of range [0, {ctx.n_ctx}): take cells from ctx.cells(seq_id)")
    c0 = int(cells.min())
    n_cells = int(cells.max()) - c0 + 1
    out = np.zeros(n_layer * n_head_kv(ctx) * n_cells, np.float32)  # room for the most heads the scores may have
    n = ctx.call(patched().llama_kvr_attn_get_span, ctx.handle, int(seq_id), c0, n_cells, out.ctypes.data_as(_F32P))
    if n == -1:
        raise KVRescueError("attention scores are not enabled on this context: call enable_scores(ctx, n_obs) "
                            "before decoding")
    if n < 0:
        raise KVRescueError(f"llama_kvr_attn_get_span failed with status {n}")
    return out[:n].reshape(n_layer, -1, n_cells)[:, :, cells - c0]


def n_head_kv(ctx: Context) -> int:
    """KV heads per layer (a K row holds one key of head_k values per KV head)."""
    return ctx.model.n_head_kv


def n_embd_k_gqa(ctx: Context) -> int:
    """Width of one K row: key head size times the number of KV heads."""
    return ctx.model.n_embd_k_gqa


def key_rows(ctx: Context, layer: int, cells) -> np.ndarray:
    """K vectors (post-RoPE, F32) of the given cells in layer: [len(cells), n_embd_k_gqa]."""
    check_layer(ctx, layer, allow_sum=False)
    cells = np.ascontiguousarray(cells, dtype=np.int32).reshape(-1)
    if len(cells) and (cells.min() < 0 or cells.max() >= ctx.n_ctx):
        raise KVRescueError(f"cell index out of range [0, {ctx.n_ctx}): take cells from ctx.cells(seq_id)")
    out = np.zeros((len(cells), n_embd_k_gqa(ctx)), np.float32)
    if len(cells) == 0:
        return out
    n = ctx.call(patched().llama_kvr_k_rows, ctx.handle, int(layer), cells.ctypes.data_as(_I32P), len(cells),
                 out.ctypes.data_as(_F32P))
    if n == -1:
        raise KVRescueError("K rows need a plain attention KV cache, and this model's memory is recurrent, hybrid "
                            "or sliding-window: use a pure-attention model")
    if n == -3:
        raise KVRescueError(f"layer {layer} has no KV cache in this context: pick a layer that has one")
    if n == -5:
        raise KVRescueError("this K cache type cannot be converted to F32 by this llama.cpp build: use -ctk f16")
    if n != len(cells):
        raise KVRescueError(f"llama_kvr_k_rows failed with status {n}")
    return out


class _GGMLTensor(ctypes.Structure):
    """The head of struct ggml_tensor (ggml.h of the pinned llama.cpp) up to the fields read here."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


_GGML_TYPE_F32 = 0


class GraphCapture:
    """Copies named F32 tensors of each llama_decode's graph through llama.cpp's cb_eval (flash attention off for
    `kq-<il>` and `kq_soft_max-<il>`), read with ggml_backend_tensor_get, so from host and device buffers alike:
    the reference the patch's scores are tested against, and the per-head logits perf/rkv_overlap.py feeds R-KV's rule.
    `tensors[name]` is [ne3][ne2, ne1, ne0] squeezed of ne3, e.g. [n_head, n_tokens, n_kv] for kq-<il>;
    wanted tensors that are not contiguous F32 are named in `skipped` (an exception cannot leave cb_eval)."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes
        self.enabled = True
        self.tensors: dict[str, np.ndarray] = {}
        self.skipped: set[str] = set()
        self.callback = llama().ggml_backend_sched_eval_callback(self._on_tensor)

    def _on_tensor(self, t, ask, user_data):
        tensor = ctypes.cast(t, ctypes.POINTER(_GGMLTensor)).contents
        name = tensor.name.decode()
        wanted = self.enabled and name.startswith(self.prefixes)
        if ask:
            return wanted
        if wanted:
            ne = list(tensor.ne)
            if tensor.type != _GGML_TYPE_F32 or tensor.nb[1] != 4 * ne[0] or tensor.nb[2] != tensor.nb[1] * ne[1]:
                self.skipped.add(name)
                return True
            first = np.empty((ne[2], ne[1], ne[0]), np.float32)  # the tensor's first ne3 slice
            ggml_base().ggml_backend_tensor_get(t, first.ctypes.data, 0, first.nbytes)
            self.tensors[name] = first
        return True

    def context(self, model, params: ContextParams) -> Context:
        """A Context whose llama_context_params carry this capture's cb_eval (fixed at creation)."""
        low = llama()
        original = low.llama_init_from_model

        def init_with_callback(model_handle, cparams):
            cparams.cb_eval = self.callback
            cparams.cb_eval_user_data = None
            return original(model_handle, cparams)

        low.llama_init_from_model = init_with_callback
        try:
            return Context(model, params)
        finally:
            low.llama_init_from_model = original
