"""The commit rules' parameters (rescue/rules/: calibrated's numbers, lead:base's margin), fitted on KV-Rescue rows of
training problems.

Each round the PRM scored has a reward for every survivor; the committed one is labelled as a value head's step is
(examples.py): its trajectory's final correctness. Per source, a logistic map of the reward to P(right) is fitted
on those committed steps (`calibration`). The base-first margin is then the one under which the calibrated
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
from ..rescue.rules.calibrated import probability
from .examples import check_split, usable

MARGINS = tuple(round(0.005 * i, 3) for i in range(201))  # the base-first margins tried: 0 to 1 by 0.005
L2 = 1.0  # the logistic fit's penalty on the slope: few labelled steps, and rewards within a narrow range
L2_BIAS = 0.01  # and on the bias, which keeps it finite where a source's steps are all right or all wrong
MIN_FALSE_STEPS = 5  # committed steps stating false arithmetic the check's fit needs: fewer tell nothing


@dataclass(frozen=True)
class ScoredRound:
    problem: str
    base: float | None  # the best reward of each source's survivors (None: none survived)
    helper: float | None
    committed: str  # the source of the committed step
    reward: float  # its reward
    right: int  # its trajectory's final correctness
    false_arithmetic: bool  # its step states false arithmetic


@dataclass(frozen=True)
class CommitFit:
    calibration: tuple[float, float, float, float]
    helper_margin: float
    problems: int
    rounds: int  # scored rounds: a base and a helper survivor
    steps: dict[str, tuple[int, int]]  # per source: committed steps, of them right
    arithmetic: dict[str, tuple[int, int]]  # committed steps stating false arithmetic ("false") and not ("true"),
    # of them right
    check_arithmetic: bool
    head: str | None  # the fingerprint of the reward head whose rewards were calibrated (results_file.file_hash)

    def rule(self) -> dict:
        """Its part of prmtrain.regime.regime_rule's parameters."""
        return {"helper_margin": self.helper_margin, "calibration": list(self.calibration),
                "check_arithmetic": self.check_arithmetic}


def scored_rounds(rows: list[dict]) -> list[ScoredRound]:
    """The rounds of KV-Rescue rows where the PRM scored a base and a helper survivor."""
    out = []
    for row in rows:
        trajectory = Trajectory.from_json(row["trajectory"], f"row {row.get('dataset')}:{row.get('id')}")
        for step in trajectory.steps:
            best = {}
            for c in step.candidates:
                if not c.killed and c.score is not None:
                    best[c.side] = max(best.get(c.side, -math.inf), c.score)
            if {"base", "helper"} <= set(best) and step.score is not None:
                out.append(ScoredRound(f"{row.get('dataset')}:{row.get('id')}", best["base"], best["helper"],
                                       step.source, step.score, int(bool(row["correct"])),
                                       bool(false_equalities(step.text))))
    return out


def logistic(rewards: np.ndarray, labels: np.ndarray, l2: float = L2, iterations: int = 50) -> tuple[float, float]:
    """(slope, bias) of P(right) = sigmoid(slope·reward + bias) by Newton's method, the slope penalized by l2 and
    the bias by L2_BIAS."""
    x = np.stack([rewards, np.ones_like(rewards)], axis=1)
    w = np.zeros(2)
    penalty = np.diag([l2, L2_BIAS])
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-x @ w))
        gradient = x.T @ (p - labels) + penalty @ w
        hessian = x.T @ (x * (p * (1 - p))[:, None]) + penalty
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    return float(w[0]), float(w[1])


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
    calibration = [1.0, 0.0, 1.0, 0.0]  # base slope, base bias, helper slope, helper bias: fitted below
    for i, source in enumerate(("base", "helper")):
        mine = [r for r in rounds if r.committed == source]
        steps[source] = (len(mine), sum(r.right for r in mine))
        if not mine:
            raise KVRescueError(f"{where}: no scored round committed a {source} step: fit on KV-Rescue rows with "
                                "the PRM choosing (`bench run --modes kvrescue --rule judge --split train`)")
        calibration[2 * i:2 * i + 2] = logistic(np.array([r.reward for r in mine]), np.array([r.right for r in mine],
                                                                                               dtype=float))

    def expected(margin: float) -> float:
        return sum(probability(calibration, "helper", r.helper) if r.helper - r.base > margin
                   else probability(calibration, "base", r.base) for r in rounds)

    values = {m: expected(m) for m in MARGINS}
    best = max(values.values())
    margin = max(m for m, v in values.items() if v >= best - 1e-12)
    false_steps = [r.right for r in rounds if r.false_arithmetic]
    true_steps = [r.right for r in rounds if not r.false_arithmetic]
    arithmetic = {"false": (len(false_steps), sum(false_steps)), "true": (len(true_steps), sum(true_steps))}
    # right less often: sum(false) / len(false) < sum(true) / len(true), without dividing by an empty count
    check = (len(false_steps) >= MIN_FALSE_STEPS
             and sum(false_steps) * len(true_steps) < sum(true_steps) * len(false_steps))
    return CommitFit(tuple(round(x, 6) for x in calibration), margin, len({r.problem for r in rounds}), len(rounds),
                     steps, arithmetic, check, next(iter(heads), None))
