"""StreamingLLM: attention sinks plus the most recent entries."""

from dataclasses import dataclass

import numpy as np

from .base import EvictionInputs, Policy, register


@register("streaming")
@dataclass(frozen=True)
class StreamingPolicy(Policy):
    def score(self, inputs: EvictionInputs) -> np.ndarray:
        return inputs.positions.astype(np.float64)
