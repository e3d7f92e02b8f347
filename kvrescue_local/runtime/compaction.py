"""Per-(layer, KV head) compaction of one sequence's cells (patch 0004).

`compact(ctx, seq_id, layer, head, src, dst)`: afterwards KV head head[m] of layer layer[m] in cell dst[m]
holds what the same head of cell src[m] held before the call (every move is read before any is written).
K and V move byte for byte (quantized blocks too; a transposed V element by element). A destination
shared with a fork is not written: the sequence moves to a free cell (same position) first, so the
context needs free cells for it. A cell's position is then a label of the sequence's cell, which is why
models where a position is more than a label (ALiBi, sliding-window attention, M-RoPE) are refused.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..errors import KVRescueError
from .context import Context
from .lib import patched

_I32P = ctypes.POINTER(ctypes.c_int32)
SHARED_SET_HINT = "use the shared-set mode (e.g. --policy rkv:heads=shared)"


def compact(ctx: Context, seq_id: int, layer, head, src, dst) -> None:
    ctx.check_seq(seq_id)
    arrays = [np.ascontiguousarray(a, dtype=np.int32).reshape(-1) for a in (layer, head, src, dst)]
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise KVRescueError("compact needs one layer, head, source and destination per move")
    rc = ctx.call(patched().llama_kvr_compact, ctx.handle, int(seq_id), *(a.ctypes.data_as(_I32P) for a in arrays), n)
    if rc == -3:
        raise KVRescueError(f"per-head eviction cannot serve {ctx.model.path.name}: its positions are more than labels "
                            f"(ALiBi, sliding-window attention or M-RoPE); {SHARED_SET_HINT}")
    if rc == -5:
        raise KVRescueError("no free KV cells to move a sequence shared with a fork into: raise the context size "
                            "(KVBudget.context_cells counts them)")
    if rc == -6:
        raise KVRescueError(f"this KV cache type's blocks straddle the heads of {ctx.model.path.name}: use -ctk/-ctv "
                            f"f16, or {SHARED_SET_HINT}")
    if rc != 0:
        raise KVRescueError(f"llama_kvr_compact failed with status {rc} (a layer, head or cell out of range, or a "
                            "cell the sequence does not hold)")


def check_compaction(ctx: Context) -> None:
    """Refuse, before anything is decoded, a model per-head eviction cannot serve (an empty compaction)."""
    compact(ctx, 0, [], [], [], [])
