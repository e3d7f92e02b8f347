"""SnapKV: attention from the observation window, max-pooled over neighbouring positions."""

from dataclasses import dataclass

import numpy as np

from .base import EvictionInputs, Policy, max_pool, register


@register("snapkv")
@dataclass(frozen=True)
class SnapKVPolicy(Policy):
    kernel: int = 7
    needs_attention = True

    def score(self, inputs: EvictionInputs) -> np.ndarray:
        return max_pool(np.asarray(inputs.window_attention, np.float64), self.kernel)
