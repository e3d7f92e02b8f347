"""Kill a degenerate base candidate while it is being decoded.

Two signals, both bimodal in practice (ordinary reasoning vs degeneration), so one flat
threshold each separates them:
  - incoherence: the mean token entropy (nats, full-vocabulary softmax) over the last
    `entropy_window` tokens rises above tau_entropy;
  - repetition: len(zstd(window)) / len(window) of the last `text_window` bytes of the
    candidate's text falls below tau_compression (a loop compresses well).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import zstandard

from ..errors import KVRescueError

_compressor = zstandard.ZstdCompressor(level=3)


ENTROPY_ROWS = 8  # rows per float64 pass: 8 rows of a 152k vocabulary take 10 MB


def token_entropy(logits: np.ndarray) -> float | np.ndarray:
    """Entropy in nats of softmax(logits) over the last axis: a float for one row of logits, an array for
    [rows, n_vocab] (one call per decode, not per candidate)."""
    if logits.ndim == 2:
        return np.concatenate([row_entropies(logits[i:i + ENTROPY_ROWS]) for i in range(0, len(logits), ENTROPY_ROWS)])
    return float(row_entropies(logits[None])[0])


def row_entropies(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    total = p.sum(axis=-1)
    return np.log(total) - (p * z).sum(axis=-1) / total


def compression_ratio(text: bytes) -> float:
    return len(_compressor.compress(text)) / max(1, len(text))


@dataclass(frozen=True)
class DetectorParams:
    tau_entropy: float = 3.0  # nats
    tau_compression: float = 0.35
    entropy_window: int = 16  # tokens
    text_window: int = 256  # bytes
    check_every: int = 8  # tokens between compression checks

    def __post_init__(self) -> None:
        if self.entropy_window < 1 or self.text_window < 16 or self.check_every < 1:
            raise KVRescueError("detector windows must be positive (entropy_window >= 1, text_window >= 16)")
        if not 0 < self.tau_compression < 1.5 or self.tau_entropy <= 0:
            raise KVRescueError(f"detector thresholds out of range: tau_entropy={self.tau_entropy} (nats, > 0), "
                                f"tau_compression={self.tau_compression} (a ratio in (0, 1.5))")


@dataclass
class Monitor:
    """The detector's state for one candidate; `update` once per decoded token."""

    params: DetectorParams
    text: bytearray = field(default_factory=bytearray)
    entropies: deque = field(init=False)
    n_tokens: int = 0
    mean_entropy: float = 0.0  # over the current window
    max_mean_entropy: float = 0.0
    min_compression: float = 1.0
    killed: str | None = None  # "entropy" or "repetition" once killed

    def __post_init__(self) -> None:
        self.entropies = deque(maxlen=self.params.entropy_window)

    def update(self, entropy: float, piece: bytes) -> bool:
        """Record one token (the entropy of the logits it was drawn from, and its text); returns True when the
        candidate must be killed."""
        p = self.params
        self.n_tokens += 1
        self.text += piece
        self.entropies.append(float(entropy))
        if len(self.entropies) == p.entropy_window:
            self.mean_entropy = sum(self.entropies) / p.entropy_window
            self.max_mean_entropy = max(self.max_mean_entropy, self.mean_entropy)
            if self.mean_entropy > p.tau_entropy:
                self.killed = "entropy"
        if self.n_tokens % p.check_every == 0:
            self.check_repetition()
        return self.killed is not None

    def finish(self) -> bool:
        """The candidate ended its step: a step shorter than check_every tokens, which no check saw, is checked
        once, so a loop of such steps (each `\\]` and a blank line) is seen in the trajectory's tail the window
        starts with. A longer step is not checked again at its end: its checks saw it, and one more check at
        an arbitrary token only adds a chance to kill a sound step near the threshold. Returns True when the
        candidate must be killed."""
        if self.killed is None and self.n_tokens < self.params.check_every:
            self.check_repetition()
        return self.killed is not None

    def check_repetition(self) -> None:
        p = self.params
        if len(self.text) < p.text_window:
            return
        ratio = compression_ratio(bytes(self.text[-p.text_window:]))
        self.min_compression = min(self.min_compression, ratio)
        if ratio < p.tau_compression:
            self.killed = self.killed or "repetition"

    def stats(self) -> dict:
        return {"tokens": self.n_tokens, "max_mean_entropy": round(self.max_mean_entropy, 4),
                "min_compression": round(self.min_compression, 4), "killed": self.killed}


@dataclass(frozen=True)
class Detector:
    params: DetectorParams = DetectorParams()

    def monitor(self, prefix: bytes = b"") -> Monitor:
        """A monitor whose text window starts with the trajectory's tail, so a loop across steps is seen."""
        return Monitor(self.params, bytearray(prefix[-self.params.text_window:]))
