"""What an eviction policy sees, and the registry of policies by name."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import KVRescueError


@dataclass(frozen=True)
class EvictionInputs:
    """One sequence's resident entries at compression time, in increasing position order."""

    positions: np.ndarray  # int32 [n]
    window_attention: np.ndarray | None = None  # [n] attention from the last observation-window queries
    cumulative_attention: np.ndarray | None = None  # [n] attention summed since each entry arrived
    keys: np.ndarray | None = None  # [n, d] post-RoPE keys of one or more layers, concatenated


@dataclass(frozen=True)
class Policy:
    """Scores resident entries: the budget keeps the highest-scoring ones (plus sinks and the recent window)."""

    needs_attention = False
    needs_keys = False

    def score(self, inputs: EvictionInputs) -> np.ndarray:
        raise NotImplementedError


POLICIES: dict[str, type[Policy]] = {}


def register(name: str):
    def add(cls: type[Policy]) -> type[Policy]:
        POLICIES[name] = cls
        cls.name = name
        return cls
    return add


def make_policy(name: str, **options) -> Policy:
    try:
        return POLICIES[name](**options)
    except KeyError:
        raise KVRescueError(f"unknown eviction policy {name!r}: use one of {', '.join(sorted(POLICIES))}") from None


def max_pool(x: np.ndarray, kernel: int) -> np.ndarray:
    """Same-length 1-D max pooling (SnapKV's clustering of neighbouring positions)."""
    if kernel <= 1 or len(x) == 0:
        return x
    pad = kernel // 2
    padded = np.pad(x, pad, mode="edge")
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel)
    return windows.max(axis=1)[: len(x)]
