"""The commit rules' parameters (rescue/config.py: `calibration`, `helper_margin`), fitted on KV-Rescue rows of
training problems.

Each round the PRM scored has a reward for every survivor; the committed one is labelled as a value head's step is
(examples.py): its trajectory's final correctness. Per source, a logistic map of the reward to P(right) is fitted
on those committed steps (`calibration`), the base's with its step's entropy beside the reward (the detector's largest
windowed mean: `base_entropy_weight`). The base-first margin is then the one under which the calibrated
probability of the committed steps, summed over the training rounds that had a base and a helper survivor, is
highest (of equals the largest: the base's step is the default). Rounds with a lone survivor were not scored and
are left out, and so are the losers of a round (nothing says where they would have led).

The arithmetic check (`check_arithmetic`) is turned on where, of those rounds, the committed steps that state false
arithmetic (rescue/arithmetic.py) ended right less often than the others, over at least MIN_FALSE_STEPS of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import KVRescueError
from ..rescue import Trajectory
from ..rescue.arithmetic import false_equalities
from ..rescue.loop import calibrated
from .examples import check_split, usable
from .fit import auc, folds

MARGINS = tuple(round(0.005 * i, 3) for i in range(201))  # the base-first margins tried: 0 to 1 by 0.005
L2 = 1.0  # the logistic fit's penalty on the slope: few labelled steps, and rewards within a narrow range
L2_BIAS = 0.01  # and on the bias, which keeps it finite where a source's steps are all right or all wrong
MIN_FALSE_STEPS = 5  # committed steps stating false arithmetic the check's fit needs: fewer tell nothing


@dataclass(frozen=True)
class ScoredRound:
    problem: str
    base: float | None  # the best reward of each source's survivors (None: none survived)
    helper: float | None
    base_entropy: float  # the entropy of the base's best-rewarded survivor (Candidate.entropy)
    committed: str  # the source of the committed step
    reward: float  # its reward
    entropy: float  # its entropy
    right: int  # its trajectory's final correctness
    false_arithmetic: bool  # its step states false arithmetic


@dataclass(frozen=True)
class CommitFit:
    calibration: tuple[float, float, float, float]
    base_entropy_weight: float
    base_auc: dict[str, float | None]  # the base map's by-problem cross-validated AUC on its committed steps, by its
    # inputs (None: its steps all of one label)
    helper_margin: float
    problems: int
    rounds: int  # scored rounds: a base and a helper survivor
    steps: dict[str, tuple[int, int]]  # per source: committed steps, of them right
    arithmetic: dict[str, tuple[int, int]]  # committed steps stating false arithmetic ("false") and not ("true"),
    # of them right
    check_arithmetic: bool
    head: str | None  # the fingerprint of the reward head whose rewards were calibrated (results_file.file_hash)

    def rule(self) -> dict:
        return {"helper_margin": self.helper_margin, "calibration": list(self.calibration),
                "base_entropy_weight": self.base_entropy_weight, "check_arithmetic": self.check_arithmetic}


def scored_rounds(rows: list[dict]) -> list[ScoredRound]:
    """The rounds of KV-Rescue rows where the PRM scored a base and a helper survivor."""
    out = []
    for row in rows:
        trajectory = Trajectory.from_json(row["trajectory"], f"row {row.get('dataset')}:{row.get('id')}")
        for step in trajectory.steps:
            best = {}
            for c in step.candidates:
                if not c.killed and c.score is not None and (c.side not in best or c.score > best[c.side].score):
                    best[c.side] = c
            if {"base", "helper"} <= set(best) and step.score is not None:
                committed = [c for c in step.candidates
                             if not c.killed and c.side == step.source and c.text == step.text]
                if not committed:
                    raise KVRescueError(f"row {row.get('dataset')}:{row.get('id')}, round {step.round}: the committed "
                                        "step is none of its round's survivors, so the row is not a loop's: remove "
                                        "it from the rows fitted on")
                out.append(ScoredRound(f"{row.get('dataset')}:{row.get('id')}", best["base"].score,
                                       best["helper"].score, best["base"].entropy, step.source, step.score,
                                       committed[0].entropy, int(bool(row["correct"])),
                                       bool(false_equalities(step.text))))
    return out


def logistic(features: np.ndarray, labels: np.ndarray, l2: float = L2, iterations: int = 50) -> tuple[float, ...]:
    """(slopes..., bias) of P(right) = sigmoid(slopes·features + bias) by Newton's method (features: one row per
    step), each slope penalized by l2 and the bias by L2_BIAS."""
    x = np.column_stack([features, np.ones(len(features))])
    w = np.zeros(x.shape[1])
    penalty = np.diag([l2] * (x.shape[1] - 1) + [L2_BIAS])
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-x @ w))
        gradient = x.T @ (p - labels) + penalty @ w
        hessian = x.T @ (x * (p * (1 - p))[:, None]) + penalty
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    return tuple(float(v) for v in w)


def base_features(rounds: list[ScoredRound], with_entropy: bool = True) -> np.ndarray:
    """The base map's inputs for committed base steps: the reward, and the step's entropy (the evicted base's
    entropy says where it lost what the step needed; the helper holds every token)."""
    return np.array([[r.reward, r.entropy] if with_entropy else [r.reward] for r in rounds])


def cross_validated_auc(rounds: list[ScoredRound], with_entropy: bool) -> float | None:
    """How well the base map ranks its committed steps' outcomes on problems it was not fitted on: each fold's steps
    (by a hash of the problem, prmtrain/fit.py) scored by the map fitted on the other folds; None where the steps
    are all of one label."""
    x, y = base_features(rounds, with_entropy), np.array([r.right for r in rounds], dtype=float)
    fold = folds([r.problem for r in rounds])
    scores = np.zeros(len(rounds))
    for k in np.unique(fold):
        *slopes, bias = logistic(x[fold != k], y[fold != k])
        scores[fold == k] = x[fold == k] @ np.array(slopes) + bias
    value = auc(scores, y)
    return None if math.isnan(value) else round(value, 3)


def fit(rows: list[dict], where: str) -> CommitFit:
    """Both parameters from KV-Rescue rows of training problems (any other row is refused)."""
    rows, _ = usable(rows)
    check_split(rows, "train", where)
    rows = [r for r in rows if (r.get("config") or {}).get("mode") == "kvrescue"]
    of_row = [(row, scored_rounds([row])) for row in rows]
    rounds = [r for _, mine in of_row for r in mine]
    # the heads of the rows the fit reads (rows of a random choice score nothing and record no PRM)
    heads = {((row.get("setup") or {}).get("models") or {}).get("prm", {}).get("head_sha256") for row, mine in of_row
             if mine}
    if len(heads) > 1:
        named = sorted("no head recorded" if h is None else h[:8] for h in heads)
        raise KVRescueError(f"{where}: the rows were scored by {len(heads)} reward heads ({', '.join(named)}): a "
                            "calibration maps one head's rewards, fit on the rows of one")
    labels = {r.right for r in rounds}
    if labels != {0, 1}:
        raise KVRescueError(f"{where}: the {len(rounds)} scored rounds of {len({r.problem for r in rounds})} problems "
                            f"all come from trajectories that ended {'right' if labels == {1} else 'wrong'}, so "
                            "nothing tells a right step's reward from a wrong one's: fit on more training problems")
    steps = {}
    fitted = {}
    for source in ("base", "helper"):
        mine = [r for r in rounds if r.committed == source]
        steps[source] = (len(mine), sum(r.right for r in mine))
        if not mine:
            raise KVRescueError(f"{where}: no scored round committed a {source} step: fit on KV-Rescue rows with "
                                "the PRM choosing (`bench run --modes kvrescue --choice prm --split train`)")
        features = base_features(mine) if source == "base" else np.array([[r.reward] for r in mine])
        fitted[source] = logistic(features, np.array([r.right for r in mine], dtype=float))
    (base_slope, weight, base_bias), (helper_slope, helper_bias) = fitted["base"], fitted["helper"]
    base_steps = [r for r in rounds if r.committed == "base"]
    base_auc = {"reward": cross_validated_auc(base_steps, False),
                "reward and entropy": cross_validated_auc(base_steps, True)}
    calibration = (base_slope, base_bias, helper_slope, helper_bias)

    def expected(margin: float) -> float:
        return sum(calibrated(calibration, "helper", r.helper) if r.helper - r.base > margin
                   else calibrated(calibration, "base", r.base, r.base_entropy, weight) for r in rounds)

    values = {m: expected(m) for m in MARGINS}
    best = max(values.values())
    margin = max(m for m, v in values.items() if v >= best - 1e-12)
    false_steps = [r.right for r in rounds if r.false_arithmetic]
    true_steps = [r.right for r in rounds if not r.false_arithmetic]
    arithmetic = {"false": (len(false_steps), sum(false_steps)), "true": (len(true_steps), sum(true_steps))}
    # right less often: sum(false) / len(false) < sum(true) / len(true), without dividing by an empty count
    check = (len(false_steps) >= MIN_FALSE_STEPS
             and sum(false_steps) * len(true_steps) < sum(true_steps) * len(false_steps))
    return CommitFit(tuple(round(x, 6) for x in calibration), round(weight, 6), base_auc, margin,
                     len({r.problem for r in rounds}), len(rounds), steps, arithmetic, check, next(iter(heads), None))
