"""How well a head judges steps of held-out problems: step-level AUC, and pairwise accuracy by pair type.

A pair is two steps of the same problem at the same round index (the same point of a solution, as far
as a round number tells): one committed by a trajectory that ended right, one labelled wrong (committed
by a trajectory that ended wrong, or killed by the detector), with different texts (two identical texts
cannot be told apart and are not a right and a wrong step). The head gets the pair right when it scores
the right step higher (a tie counts half). Pairs are split by the wrong step's origin; a coin scores 50%.
The interval is a bootstrap over problems (pairs of one problem are not independent).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .examples import ORIGINS, LabelledStep
from .fit import auc

BOOTSTRAP = 1000


@dataclass(frozen=True)
class PairScore:
    origin: str
    pairs: int
    problems: int
    accuracy: float
    low: float  # 95% bootstrap interval over problems
    high: float


def pair_outcomes(steps: list[LabelledStep], rewards: np.ndarray) -> dict[str, dict[str, list[float]]]:
    """origin -> problem -> outcome of each pair (1 right step above, 0 below, 0.5 tie)."""
    by_round: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, s in enumerate(steps):
        by_round[(s.problem, s.round)].append(i)
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (problem, _), members in by_round.items():
        right = [i for i in members if steps[i].label == 1]
        wrong = [i for i in members if steps[i].label == 0]
        for r in right:
            for w in wrong:
                if steps[r].text.strip() == steps[w].text.strip():
                    continue
                outcome = 1.0 if rewards[r] > rewards[w] else 0.5 if rewards[r] == rewards[w] else 0.0
                out[steps[w].origin][problem].append(outcome)
    return out


def pair_scores(steps: list[LabelledStep], rewards: np.ndarray, seed: int = 0) -> list[PairScore]:
    rng = np.random.default_rng(seed)
    scores = []
    outcomes = pair_outcomes(steps, rewards)
    pooled: dict[str, list[float]] = defaultdict(list)
    for per_problem in outcomes.values():
        for problem, results in per_problem.items():
            pooled[problem] += results
    for origin in (*ORIGINS, "all"):
        problems = pooled if origin == "all" else outcomes.get(origin, {})
        if not problems:
            continue
        per_problem = [np.asarray(v) for v in problems.values()]
        accuracy = float(np.concatenate(per_problem).mean())
        draws = [np.concatenate([per_problem[i] for i in rng.integers(len(per_problem), size=len(per_problem))]).mean()
                 for _ in range(BOOTSTRAP)]
        low, high = np.percentile(draws, [2.5, 97.5])
        scores.append(PairScore(origin, sum(len(v) for v in per_problem), len(per_problem), accuracy,
                                float(low), float(high)))
    return scores


def step_auc(steps: list[LabelledStep], rewards: np.ndarray) -> float:
    return auc(rewards, np.array([s.label for s in steps]))
