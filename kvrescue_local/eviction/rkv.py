"""R-KV: importance from the observation window minus redundancy among keys, per layer and KV head.

As the reference runs it (github Zefan-Cai/R-KV: rkv/compression/r1_kv.py, rkv/utils.py), each layer
and KV head scores the entries outside the recent window:
  importance = the window's attention, normalised over those entries and max-pooled over `kernel`
               neighbours;
  redundancy = a softmax over all entries of each key's mean cosine similarity to every key (the
               diagonal zeroed), after each key's similarity to the newest other key above `similar`
               (to the first key, when there is none) is zeroed: of a group of near-identical keys the
               newest is spared and the oldest penalised most;
  score      = lam * importance - (1 - lam) * redundancy, and the head keeps its best entries.
heads=per (the default) does as the reference: each (layer, KV head) keeps its own entries, the
attention computed per KV head inside the graph as the reference does (the query group's logits
max-pooled, the softmax over the keys before the window), and the budget compacts the cells per head
(patch 0004). heads=shared keeps one set of positions for every layer and head: the entries that the
most (layer, head) pairs would keep (ties: the higher mean score), with the attention summed over the
query heads and a softmax over every visible key; perf/rkv_overlap.py measures both against a port of
the reference (eviction/reference.py).
Defaults as the reference runs them: lam 0.07 (its --mix_lambda), kernel 7, similar 0.5, no sinks;
the budget keeps the 8 newest entries (these hold the newest position, which llama.cpp needs) and
compresses a prompt longer than the budget once it has been read.
"""

from dataclasses import dataclass

import numpy as np

from .base import MAX_KERNEL, EvictionInputs, Policy, check_heads, check_ranges, max_pool, ranged, register


def redundancy(keys: np.ndarray, similar: float = 0.5) -> np.ndarray:
    """[..., n] redundancy of keys [..., n, d]: R-KV's softmaxed mean similarity, newest copy spared."""
    k = keys.astype(np.float32)  # half the time of float64 for the n x n products of every layer and head
    k /= np.linalg.norm(k, axis=-1, keepdims=True) + 1e-8
    sim = k @ np.swapaxes(k, -1, -2)
    n = sim.shape[-1]
    sim[..., np.arange(n), np.arange(n)] = 0.0
    above = sim > similar
    newest = np.where(above.any(axis=-1), n - 1 - np.argmax(above[..., ::-1], axis=-1), 0)
    np.put_along_axis(sim, newest[..., None], 0.0, axis=-1)
    mean = sim.mean(axis=-2, dtype=np.float64)
    e = np.exp(mean - mean.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@register("rkv")
@dataclass(frozen=True)
class RKVPolicy(Policy):
    lam: float = ranged(0.07, 0.0, 1.0)
    kernel: int = ranged(7, 1, MAX_KERNEL)
    similar: float = ranged(0.5, -1.0, 1.0)
    heads: str = "per"
    needs_attention = True
    needs_keys = True

    @property
    def per_head(self) -> bool:
        return self.heads == "per"

    def __post_init__(self) -> None:
        check_heads("rkv", self.heads)
        check_ranges(self)

    def head_scores(self, inputs: EvictionInputs) -> np.ndarray:
        """[n_layer, n_head_kv, n_free]: each pair's score of the entries the budget may drop."""
        free = ~inputs.forced
        attention = np.asarray(inputs.window_attention, np.float64)[..., free]
        if attention.ndim == 2:  # per layer: every KV head of the layer shares it
            attention = attention[:, None, :]
        importance = max_pool(attention / np.maximum(attention.sum(axis=-1, keepdims=True), 1e-12), self.kernel)
        return self.lam * importance - (1 - self.lam) * redundancy(inputs.keys, self.similar)[..., free]

    def score(self, inputs: EvictionInputs) -> np.ndarray:
        free = np.flatnonzero(~inputs.forced)
        per_head = self.head_scores(inputs).reshape(-1, len(free))
        chosen = np.argsort(-per_head, axis=-1, kind="stable")[:, : min(inputs.n_choose, len(free))]
        votes = np.bincount(chosen.ravel(), minlength=len(free)).astype(np.float64)
        tie_break = np.argsort(np.argsort(per_head.mean(axis=0), kind="stable"), kind="stable") / len(free)
        scores = np.zeros(len(inputs.positions))
        scores[free] = votes + tie_break
        return scores
