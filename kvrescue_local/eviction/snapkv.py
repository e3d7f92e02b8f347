"""SnapKV: attention from the observation window, max-pooled over neighbouring positions.

As R-KV's SnapKV baseline (rkv/compression/snapkv.py) runs it: no sinks, the 8 newest entries kept,
a prompt longer than the budget compressed once read. Deviation forced by llama.cpp: one keep-set per
position, by the attention summed over layers and heads, where the reference chooses per KV head.
"""

from dataclasses import dataclass

import numpy as np

from .base import EvictionInputs, Policy, max_pool, register


@register("snapkv")
@dataclass(frozen=True)
class SnapKVPolicy(Policy):
    kernel: int = 7
    needs_attention = True

    def __post_init__(self) -> None:
        if self.kernel < 1:
            raise ValueError(f"snapkv needs kernel >= 1 (got {self.kernel})")

    def score(self, inputs: EvictionInputs) -> np.ndarray:
        return max_pool(np.asarray(inputs.window_attention, np.float64).sum(axis=0), self.kernel)
