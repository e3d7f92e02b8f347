"""StreamingLLM: attention sinks plus the most recent entries (4 sinks by default, as R-KV's baseline)."""

from dataclasses import dataclass

import numpy as np

from .base import EvictionInputs, Policy, register


@register("streaming")
@dataclass(frozen=True)
class StreamingPolicy(Policy):
    n_sink = 4

    def score(self, inputs: EvictionInputs) -> np.ndarray:
        return inputs.positions.astype(np.float64)
