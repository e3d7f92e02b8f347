"""H2O: heavy hitters by attention accumulated over the whole generation.

The H2O paper's rule (R-KV's "h2o" baseline scores by the last query alone). No sinks by default, as
there; the budget keeps the `window` newest entries, which hold the newest position llama.cpp needs.
"""

from dataclasses import dataclass

import numpy as np

from .base import EvictionInputs, Policy, register


@register("h2o")
@dataclass(frozen=True)
class H2OPolicy(Policy):
    needs_cumulative_attention = True

    def score(self, inputs: EvictionInputs) -> np.ndarray:
        return np.asarray(inputs.cumulative_attention, np.float64)
