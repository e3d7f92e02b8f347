"""Labelled steps from the rows of `bench run`: what a value head learns from and is judged on.

Labels (README, "A PRM for the coder pair"): a committed step takes its trajectory's final correctness;
a candidate the detector killed is wrong; a survivor that lost its round has no label (its trajectory
never continued, so nothing says whether it would have led to the answer). Each labelled step has an
origin, the pair type the evaluation splits by: the helper's, the evicted base's, the full-KV base's,
or "degenerate" (killed by the detector, or a step of a wrong trajectory that ran into a length cap).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bench.datasets import SPLITS, split_of
from ..errors import KVRescueError
from ..rescue import Trajectory

ORIGINS = ("helper", "evicted base", "full-KV base", "degenerate")


@dataclass(frozen=True)
class LabelledStep:
    problem: str  # dataset:id, the unit the validation part and the pairs are drawn by
    round: int
    text: str
    origin: str
    label: int  # 1: from a trajectory that ended right; 0: from a wrong one, or killed
    committed: bool


def usable(rows: list[dict]) -> tuple[list[dict], int]:
    """The rows a PRM can learn from (a trajectory record and no error) and how many others were left out
    (rows written before records carried the trajectory, or problems that stopped with an error)."""
    kept = [r for r in rows if isinstance(r.get("trajectory"), dict) and not r.get("error")]
    return kept, len(rows) - len(kept)


def check_split(rows: list[dict], split: str, where: str) -> None:
    """Training never reads evaluation problems and evaluation reads nothing else (bench.datasets.SPLITS)."""
    for row in rows:
        theirs = split_of(str(row.get("dataset")), str(row.get("id")))
        if split == "train" and theirs == "eval" or split == "eval" and theirs != "eval":
            ranges = "; ".join(f"{d}: {', '.join(f'{s} positions {a}-{b - 1}' for s, (a, b) in parts.items())}"
                               for d, parts in SPLITS.items())
            raise KVRescueError(f"{where}: {row.get('dataset')} problem {row.get('id')} is "
                                f"{'an evaluation' if theirs == 'eval' else 'not an evaluation'} problem, and "
                                f"{'training' if split == 'train' else 'evaluation'} reads only {split}-split rows "
                                f"({ranges}): pass a results file of `bench run --split {split}`")


def origin(trajectory: Trajectory, correct: bool, source: str) -> str:
    if not correct and trajectory.length_capped:
        return "degenerate"
    if source == "helper":
        return "helper"
    return "evicted base" if trajectory.mode is not None and trajectory.mode.evicts else "full-KV base"


def labelled_steps(row: dict) -> list[LabelledStep]:
    """The row's labelled steps, round by round: the committed step, then the candidates killed that round
    (the order `features.row_hidden` reads their hidden states in)."""
    trajectory = Trajectory.from_json(row["trajectory"], f"row {row.get('dataset')}:{row.get('id')}")
    problem = f"{row.get('dataset')}:{row.get('id')}"
    correct = bool(row["correct"])
    out = []
    for step in trajectory.steps:
        out.append(LabelledStep(problem, step.round, step.text, origin(trajectory, correct, step.source),
                                int(correct), True))
        out += [LabelledStep(problem, step.round, c.text, "degenerate", 0, False) for c in step.candidates if c.killed]
    return out


def killed_texts(trajectory: Trajectory) -> list[list[str]]:
    return [[c.text for c in step.candidates if c.killed] for step in trajectory.steps]

