"""A value head fitted in numpy (the runtime never needs torch): logistic regression or a one-hidden-layer
MLP on the leading principal components (16 to 128 of them) of the standardised hidden states, classes
balanced, L2; the standardisation and the projection folded into the first layer so the result is a plain
`RewardHead`. Kind, components and L2 are chosen on a by-problem validation part of the training rows (a
problem's steps are all in one part), then the chosen model is refitted on all of them.

The projection keeps the fits small: a few thousand steps cannot pin down 896 weights, and numpy's
threaded BLAS crawls on cores shared with llama.cpp (a 96-wide fit took 30x longer beside a busy core).
"""

from __future__ import annotations

import ctypes
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import KVRescueError
from ..prm import RewardHead, prm_format



@dataclass(frozen=True)
class Choice:
    """One point of the hyper-parameter grid."""

    kind: str  # "logistic" or "mlp"
    components: int  # leading principal components the fit sees
    l2: float

    @property
    def label(self) -> str:
        return f"{self.kind} k={self.components} l2={self.l2:g}"


GRID = [Choice("logistic", k, l2) for k in (16, 64, 128) for l2 in (1.0, 10.0, 100.0, 1000.0)] + \
       [Choice("mlp", 64, l2) for l2 in (10.0, 100.0)]
FALLBACK = Choice("logistic", 64, 100.0)  # too few problems to validate: the middle of the grid
HIDDEN = 32  # the MLP's units
VALIDATION_SHARE = 5  # one problem in 5 (by a hash of its name) validates


OPENBLAS_PREFIXES = ("scipy_openblas", "openblas")  # numpy's bundled OpenBLAS, a system one
OPENBLAS_SUFFIXES = ("64_", "")


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """numpy's OpenBLAS on one thread while inside: its threads spin-wait for each other, and beside busy
    cores (llama.cpp, another job) a fit then takes 30x longer (measured on 2 shared cores). Linux only;
    elsewhere, or with another BLAS, nothing changes."""
    maps = Path("/proc/self/maps")
    libraries = {line.split()[-1] for line in maps.read_text().splitlines() if "openblas" in line.lower()} \
        if maps.exists() else set()
    restore = []
    for path in libraries:
        lib = ctypes.CDLL(path)
        for prefix in OPENBLAS_PREFIXES:
            for suffix in OPENBLAS_SUFFIXES:
                setter, getter = f"{prefix}_set_num_threads{suffix}", f"{prefix}_get_num_threads{suffix}"
                if hasattr(lib, setter) and hasattr(lib, getter):
                    restore.append((getattr(lib, setter), getattr(lib, getter)()))
                    getattr(lib, setter)(1)
    try:
        yield
    finally:
        for setter, threads in restore:
            setter(threads)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Probability that a random positive scores above a random negative (ties count half); nan without both."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels).astype(bool)
    n_pos, n_neg = labels.sum(), (~labels).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    for a, b in zip(starts, ends):
        ranks[order[a:b]] = (a + b + 1) / 2.0  # average rank of a tie, 1-based
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def folds(problems: list[str]) -> np.ndarray:
    """Each step's fold (0 to VALIDATION_SHARE - 1) by a hash of its problem: fold 0 validates."""
    return np.array([zlib.crc32(p.encode()) % VALIDATION_SHARE for p in problems])


def balanced_weights(labels: np.ndarray) -> np.ndarray:
    """Each class weighs half of the total."""
    n_pos = labels.sum()
    n_neg = len(labels) - n_pos
    return np.where(labels == 1, len(labels) / (2.0 * max(n_pos, 1)), len(labels) / (2.0 * max(n_neg, 1)))


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -40, 40)))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float, iterations: int = 30) -> list[tuple[np.ndarray, np.ndarray]]:
    """Newton's method on the weighted mean log loss + l2/2 |w|^2 / n (the bias unpenalised)."""
    n, d = x.shape
    weights = balanced_weights(y)
    xb = np.hstack([x, np.ones((n, 1))])
    penalty = np.full(d + 1, l2 / n)
    penalty[-1] = 0.0
    theta = np.zeros(d + 1)
    for _ in range(iterations):
        p = sigmoid(xb @ theta)
        gradient = xb.T @ (weights * (p - y)) / n + penalty * theta
        hessian = (xb * (weights * p * (1 - p))[:, None]).T @ xb / n + np.diag(penalty + 1e-9)
        change = np.linalg.solve(hessian, gradient)
        theta -= change
        if np.abs(change).max() < 1e-6:
            break
    return [(theta[None, :d].astype(np.float32), theta[d:].astype(np.float32))]


def fit_mlp(x: np.ndarray, y: np.ndarray, l2: float, seed: int = 0, iterations: int = 400,
            rate: float = 0.01) -> list[tuple[np.ndarray, np.ndarray]]:
    """One hidden ReLU layer, full-batch Adam on the weighted mean log loss + l2/2 |W|^2 / n."""
    n, d = x.shape
    rng = np.random.default_rng(seed)
    weights = balanced_weights(y)
    params = [rng.standard_normal((HIDDEN, d)) * np.sqrt(2.0 / d), np.zeros(HIDDEN),
              rng.standard_normal((1, HIDDEN)) * np.sqrt(1.0 / HIDDEN), np.zeros(1)]
    moments = [np.zeros_like(p) for p in params]
    squares = [np.zeros_like(p) for p in params]
    for t in range(1, iterations + 1):
        w1, b1, w2, b2 = params
        hidden = np.maximum(x @ w1.T + b1, 0.0)
        p = sigmoid(hidden @ w2[0] + b2[0])
        delta = weights * (p - y) / n
        g_w2 = delta @ hidden + l2 / n * w2[0]
        g_hidden = np.outer(delta, w2[0]) * (hidden > 0)
        grads = [g_hidden.T @ x + l2 / n * w1, g_hidden.sum(0), g_w2[None, :], np.array([delta.sum()])]
        for i, g in enumerate(grads):
            moments[i] = 0.9 * moments[i] + 0.1 * g
            squares[i] = 0.999 * squares[i] + 0.001 * g * g
            params[i] -= rate * (moments[i] / (1 - 0.9 ** t)) / (np.sqrt(squares[i] / (1 - 0.999 ** t)) + 1e-8)
    w1, b1, w2, b2 = params
    return [(w1.astype(np.float32), b1.astype(np.float32)), (w2.astype(np.float32), b2.astype(np.float32))]


FITTERS = {"logistic": fit_logistic, "mlp": fit_mlp}


def forward(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    for i, (w, b) in enumerate(layers):
        x = x @ w.T + b
        if i < len(layers) - 1:
            x = np.maximum(x, 0.0)
    return x[:, 0]


@dataclass(frozen=True)
class Fit:
    head: RewardHead
    choice: Choice
    validation: dict  # Choice.label -> validation AUC
    train_auc: float  # of the final head on all training steps
    out_of_fold: np.ndarray  # each step's score by the chosen kind fitted without its problem's fold
    steps: int
    positives: int


def to_head(layers: list[tuple[np.ndarray, np.ndarray]], mean: np.ndarray, scale: np.ndarray, basis: np.ndarray,
            fmt: str) -> RewardHead:
    """Projection and standardisation folded into the first layer: W ((x - m) / s) V + b = A x + b - A m with
    A = W V^T / s; a 2-way format gets logits (0, z), whose softmax[1] is sigmoid(z)."""
    (w, b), rest = layers[0], layers[1:]
    a = (w @ basis.T) / scale
    folded = [(a, b - a @ mean), *rest]
    weights, biases = [w.astype(np.float32) for w, _ in folded], [b.astype(np.float32) for _, b in folded]
    if prm_format(fmt).output == "softmax1":
        weights[-1] = np.vstack([np.zeros_like(weights[-1]), weights[-1]])
        biases[-1] = np.concatenate([np.zeros_like(biases[-1]), biases[-1]])
    return RewardHead(weights, biases, fmt)


def fit_head(hidden: np.ndarray, labels: np.ndarray, problems: list[str], fmt: str) -> Fit:
    with one_blas_thread():
        return _fit_head(hidden, labels, problems, fmt)


def _fit_head(hidden: np.ndarray, labels: np.ndarray, problems: list[str], fmt: str) -> Fit:
    labels = np.asarray(labels, np.float64)
    if len(labels) == 0 or labels.min() == labels.max():
        raise KVRescueError(f"{len(labels)} labelled steps, {int(labels.sum())} of them right: training needs right "
                            "and wrong steps; run more rollouts (a larger --limit)")
    x = np.asarray(hidden, np.float64)
    mean, scale = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / scale
    basis = np.linalg.svd(z, full_matrices=False)[2].T  # [n_embd, components], label-free
    projected = z @ basis[:, :max(c.components for c in GRID)]
    fold = folds(problems)
    held = fold == 0
    validation = {}
    both = held.any() and (~held).any() and len(set(labels[held])) == 2 and len(set(labels[~held])) == 2
    for choice in GRID if both else []:
        part = projected[:, :choice.components]
        layers = FITTERS[choice.kind](part[~held], labels[~held], choice.l2)
        validation[choice.label] = auc(forward(layers, part[held]), labels[held])
    best = max(GRID, key=lambda c: validation[c.label]) if validation else FALLBACK
    layers = FITTERS[best.kind](projected[:, :best.components], labels, best.l2)
    head = to_head(layers, mean, scale, basis[:, :best.components], fmt)
    out_of_fold = np.zeros(len(labels))
    for k in np.unique(fold):
        inside = fold != k
        if len(set(labels[inside])) == 2:
            part = projected[:, :best.components]
            out_of_fold[~inside] = forward(FITTERS[best.kind](part[inside], labels[inside], best.l2), part[~inside])
    return Fit(head, best, validation, auc(head.rewards(hidden), labels), out_of_fold, len(labels),
               int(labels.sum()))
