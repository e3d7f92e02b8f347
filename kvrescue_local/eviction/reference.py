"""R-KV's own selection, per layer and KV head, ported from its published code (github Zefan-Cai/R-KV:
`R1KV.update_kv` in rkv/compression/r1_kv.py, `compute_attention_scores` and `cal_similarity` in
rkv/utils.py) step by step, loops where the reference loops over heads or rows.

It is the oracle that the `rkv` policy is tested and measured against, per (layer, KV head) as the
reference keeps them, and with heads=shared (one set of positions for every layer and head).
"""

from __future__ import annotations

import numpy as np


def window_attention(logits: np.ndarray, n_head_kv: int, window: int) -> np.ndarray:
    """[n_head_kv, n - window]: the mean over the window queries of the softmax over the keys before the
    window, each KV head's query-group logits max-pooled first (compute_attention_scores, pooling="max").

    logits [n_head_q, window, n]: q.k / sqrt(head_dim) of the last `window` queries, keys in position order."""
    group = logits.shape[0] // n_head_kv
    out = []
    for h in range(n_head_kv):
        pooled = logits[h * group:(h + 1) * group].max(axis=0)[:, :-window]  # [window, n - window]
        p = np.exp(pooled - pooled.max(axis=1, keepdims=True))
        out.append((p / p.sum(axis=1, keepdims=True)).mean(axis=0))
    return np.stack(out)


def similarity_scores(keys: np.ndarray, threshold: float = 0.5) -> np.ndarray:
    """[n]: cal_similarity(retain_direction="last") for one head's keys [n, d]."""
    k = keys / (np.linalg.norm(keys, axis=1, keepdims=True) + 1e-8)
    sim = k @ k.T
    np.fill_diagonal(sim, 0.0)
    for i in range(len(sim)):
        similar = np.flatnonzero(sim[i] > threshold)
        sim[i, similar.max() if len(similar) else 0] = 0.0  # torch.max over (index if similar else 0)
    column_mean = sim.mean(axis=0)
    e = np.exp(column_mean - column_mean.max())
    return e / e.sum()


def max_pool_1d(x: np.ndarray, kernel: int) -> np.ndarray:
    """F.max_pool1d(kernel, stride 1, padding kernel // 2): padding never wins a max."""
    pad = kernel // 2
    return np.array([x[max(0, i - pad): i + pad + 1].max() for i in range(len(x))])


def select(keys: np.ndarray, attention: np.ndarray, budget: int, window: int = 8, lam: float = 0.07,
           kernel: int = 7, threshold: float = 0.5) -> np.ndarray:
    """[n_layer, n_head_kv, n] bool: what each (layer, KV head) keeps when R-KV compresses n >= budget entries.

    keys [n_layer, n_head_kv, n, d]; attention [n_layer, n_head_kv, n - window] from `window_attention`."""
    n_layer, n_head_kv, n, _ = keys.shape
    kept = np.zeros((n_layer, n_head_kv, n), bool)
    for layer in range(n_layer):
        for h in range(n_head_kv):
            score = (lam * max_pool_1d(attention[layer, h], kernel)
                     - (1 - lam) * similarity_scores(keys[layer, h], threshold)[:-window])
            kept[layer, h, np.argsort(-score, kind="stable")[: budget - window]] = True
            kept[layer, h, n - window:] = True
    return kept


def overlap(kept: np.ndarray, per_head: np.ndarray, window: int) -> float:
    """Mean over (layer, head) of the share of that head's own choice (outside the window) that `kept` keeps:
    one set [n], or one per head [n_layer, n_head_kv, n]."""
    chosen = per_head[..., :-window]
    return float(((chosen & kept[..., :-window]).sum(axis=-1) / chosen.sum(axis=-1)).mean())
