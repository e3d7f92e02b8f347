"""The regime map: how much of the accuracy eviction costs KV-Rescue recovers, helper by helper, against the
helper's strength alone (its pass@1 as a fraction of the full-KV base's).

It reads rows of one base with several helpers, told apart by their model files (the setup's fingerprint): full KV
and evicted best-of-N once, and for each helper the helper alone and KV-Rescue at the same budgets and N. Per helper
and KV-Rescue configuration, on the problems all four ran:
- the helper ratio: the helper's pass@1 alone / full KV's;
- recovered %: (kvrescue - bon) / (full - bon), as in Table 2, with a 95% paired bootstrap interval (the problems
  resampled together for the four configurations);
- the oracle's recovered %: the same for the better of best-of-N's and the helper's whole answers, problem by
  problem (what a perfect choice between whole answers would recover);
- the helper's share of KV-Rescue's committed steps (where the loop mixes the two models, and where it is the helper
  alone under another name).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..rescue import Mode
from .metrics import ConfigKey, accuracy_recovered, config_key, correct_by_problem, problem_keys

MIN_HELPERS = 2  # one helper's numbers are Table 2's already; the map compares helpers


@dataclass(frozen=True)
class RegimePoint:
    """One helper's KV-Rescue configuration against full KV, evicted best-of-N and the helper alone."""

    helper: str  # the helper's file name
    key: ConfigKey  # the KV-Rescue configuration (setups pooled)
    problems: int  # those all four configurations ran
    full_pass1: float  # %, on these problems
    helper_pass1: float
    bon_pass1: float
    kvrescue_pass1: float
    oracle_pass1: float  # the better of best-of-N's and the helper's answers, problem by problem
    recovered: float | None  # % of (full - bon); None when full does not beat bon
    low: float | None  # 95% paired bootstrap interval of `recovered`
    high: float | None
    oracle_recovered: float | None
    helper_steps: float | None  # %, of KV-Rescue's committed steps, the helper's

    @property
    def ratio(self) -> float | None:
        return self.helper_pass1 / self.full_pass1 if self.full_pass1 > 0 else None


def helper_of(row: dict) -> tuple[str, str] | None:
    """The helper a row ran with, as its setup records it: (file name, sha256); None for rows without one."""
    fingerprint = ((row.get("setup") or {}).get("models") or {}).get("helper")
    if not isinstance(fingerprint, dict):
        return None
    return str(fingerprint.get("file", "")), str(fingerprint.get("sha256", ""))


def recovered_interval(full: np.ndarray, bon: np.ndarray, kvrescue: np.ndarray, rng: np.random.Generator,
                       draws: int) -> tuple[float | None, float | None]:
    """95% paired bootstrap interval of the recovered share, in %: each draw resamples the problems, keeping each
    problem's three outcomes together; draws where full KV does not beat best-of-N have no share and are left out."""
    picks = rng.integers(len(full), size=(draws, len(full)))
    gap = full[picks].mean(axis=1) - bon[picks].mean(axis=1)
    gained = kvrescue[picks].mean(axis=1) - bon[picks].mean(axis=1)
    shares = 100.0 * gained[gap > 0] / gap[gap > 0]
    if not len(shares):
        return None, None
    low, high = np.percentile(shares, [2.5, 97.5])
    return float(low), float(high)


def regime_map(rows: list[dict], draws: int = 2000, seed: int = 0) -> list[RegimePoint]:
    """The map's points, by dataset, N, helper ratio and budget; empty unless the rows hold KV-Rescue and the helper
    alone for at least MIN_HELPERS helpers, with full KV and best-of-N to compare them with."""
    groups: dict[tuple[ConfigKey, tuple[str, str] | None], list[dict]] = {}
    for row in rows:
        key = config_key(row, pool_setups=True)
        groups.setdefault((key, helper_of(row) if key.uses_helper else None), []).append(row)
    helpers = {helper for (key, helper) in groups if key.mode == Mode.KVRESCUE and helper is not None
               and any(k.mode == Mode.HELPER and h == helper for k, h in groups)}
    if len(helpers) < MIN_HELPERS:
        return []
    rng = np.random.default_rng(seed)
    points = []
    for (key, helper), kvrescue in groups.items():
        if key.mode != Mode.KVRESCUE or helper not in helpers:
            continue
        alone = next((g for (k, h), g in groups.items() if k.mode == Mode.HELPER and h == helper
                      and (k.dataset, k.n) == (key.dataset, key.n)), None)
        full = next((g for (k, _), g in groups.items() if k.mode == Mode.FULL and (k.dataset, k.n) == (key.dataset, key.n)
                     and (k.weights, k.kv_cache) == (key.weights, key.kv_cache)), None)
        bon = next((g for (k, _), g in groups.items() if k.mode == Mode.BON
                    and (k.dataset, k.n, k.budget, k.policy, k.weights, k.kv_cache)
                    == (key.dataset, key.n, key.budget, key.policy, key.weights, key.kv_cache)), None)
        if alone is None or full is None or bon is None:
            continue
        problem = problem_keys(full, bon, alone, kvrescue)
        correct = [correct_by_problem(g, problem) for g in (full, bon, alone, kvrescue)]
        common = sorted(set.intersection(*(set(c) for c in correct)))
        if not common:
            continue
        f, b, h, k = (np.array([float(c[i]) for i in common]) for c in correct)
        oracle = np.maximum(b, h)
        pct = lambda flags: 100.0 * float(flags.mean())  # noqa: E731
        low, high = recovered_interval(f, b, k, rng, draws)
        steps: dict[str, int] = {}
        ran = set(common)
        for row in kvrescue:
            if problem(row) in ran:
                for side, count in (row.get("steps_from") or {}).items():
                    steps[side] = steps.get(side, 0) + int(count or 0)
        total = sum(steps.values())
        points.append(RegimePoint(
            helper[0], key, len(common), pct(f), pct(h), pct(b), pct(k), pct(oracle),
            accuracy_recovered(pct(k), pct(b), pct(f)), low, high, accuracy_recovered(pct(oracle), pct(b), pct(f)),
            100.0 * steps.get("helper", 0) / total if total else None))
    return sorted(points, key=lambda p: (p.key.dataset, p.key.n, p.ratio or 0.0, p.helper, p.key.budget or 0))
