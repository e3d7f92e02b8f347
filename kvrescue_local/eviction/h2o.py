"""H2O: heavy hitters by attention accumulated over the whole generation."""

from dataclasses import dataclass

import numpy as np

from .base import EvictionInputs, Policy, register


@register("h2o")
@dataclass(frozen=True)
class H2OPolicy(Policy):
    needs_attention = True

    def score(self, inputs: EvictionInputs) -> np.ndarray:
        return np.asarray(inputs.cumulative_attention, np.float64)
