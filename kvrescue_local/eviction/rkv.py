"""R-KV: importance from the observation window minus redundancy among keys.

score = lam * importance - (1 - lam) * redundancy, where importance is the max-pooled
window attention and redundancy is each key's mean cosine similarity to the other keys
(diagonal zeroed; a key's most recent highly similar neighbour, above `similar`, is
exempt, so the newest of a repeated pair survives), softmaxed over entries.
"""

from dataclasses import dataclass

import numpy as np

from .base import EvictionInputs, Policy, max_pool, register


def redundancy(keys: np.ndarray, similar: float = 0.5) -> np.ndarray:
    k = keys.astype(np.float64)
    k /= np.maximum(np.linalg.norm(k, axis=1, keepdims=True), 1e-12)
    sim = k @ k.T
    np.fill_diagonal(sim, 0.0)
    n = len(k)
    # the most recent later neighbour above the threshold does not count against a key
    later = np.triu(sim > similar, 1)
    has_later = later.any(axis=1)
    newest = n - 1 - np.argmax(later[:, ::-1], axis=1)
    rows = np.flatnonzero(has_later)
    sim[rows, newest[rows]] = 0.0
    mean_sim = sim.sum(axis=1) / max(1, n - 1)
    e = np.exp(mean_sim - mean_sim.max())
    return e / e.sum()


@register("rkv")
@dataclass(frozen=True)
class RKVPolicy(Policy):
    lam: float = 0.1
    kernel: int = 7
    similar: float = 0.5
    needs_attention = True
    needs_keys = True

    def score(self, inputs: EvictionInputs) -> np.ndarray:
        attention = max_pool(np.asarray(inputs.window_attention, np.float64), self.kernel)
        importance = attention / max(attention.sum(), 1e-12)
        return self.lam * importance - (1 - self.lam) * redundancy(inputs.keys, self.similar)
