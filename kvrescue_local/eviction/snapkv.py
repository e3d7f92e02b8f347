"""SnapKV: attention from the observation window, max-pooled over neighbouring positions.

As R-KV's SnapKV baseline (rkv/compression/snapkv.py) runs it: no sinks, the 8 newest entries kept,
a prompt longer than the budget compressed once read. heads=per (the default) chooses per (layer, KV
head) as the reference does, by that head's attention (computed as R-KV's); heads=shared keeps one set
of positions, by the attention summed over layers and heads.
"""

from dataclasses import dataclass

import numpy as np

from .base import MAX_KERNEL, EvictionInputs, Policy, check_heads, check_ranges, max_pool, ranged, register


@register("snapkv")
@dataclass(frozen=True)
class SnapKVPolicy(Policy):
    kernel: int = ranged(7, 1, MAX_KERNEL)
    heads: str = "per"
    needs_attention = True

    @property
    def per_head(self) -> bool:
        return self.heads == "per"

    def __post_init__(self) -> None:
        check_heads("snapkv", self.heads)
        check_ranges(self)

    def head_scores(self, inputs: EvictionInputs) -> np.ndarray:
        return max_pool(np.asarray(inputs.window_attention, np.float64), self.kernel)[..., ~inputs.forced]

    def score(self, inputs: EvictionInputs) -> np.ndarray:
        return max_pool(np.asarray(inputs.window_attention, np.float64).sum(axis=0), self.kernel)
