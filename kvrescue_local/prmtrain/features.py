"""Hidden states of labelled steps, read by the PRM's own scoring code, cached on disk.

The committed steps of a row are read with `PRM.trajectory_hidden` (what `score_trajectory` feeds
the head), the killed candidates with `PRM.candidate_hidden` on the committed prefix of their round
(what `score` feeds the head in the loop): training and serving cannot disagree on a feature. For
`--prm helper` (a HelperJudge on the helper's context) every labelled step is read as the loop reads a
candidate, alone on the committed prefix of its round (`HelperJudge.trajectory_hidden`).

One file per row, named by the backbone's fingerprint, the format and the hash of the row's problem
and step texts, written atomically: a killed run reads what it had and continues.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from ..files import file_hash
from ..paths import CACHE
from ..prm import PRM
from ..rescue import Trajectory
from ..rescue.judge import HelperJudge
from .examples import killed_texts

FEATURES_CACHE = CACHE / "prm-features"


def row_hidden(prm: PRM | HelperJudge, trajectory: Trajectory) -> np.ndarray:
    """[labelled steps, n_embd] in `labelled_steps` order: each round's committed step, then its killed candidates."""
    killed = killed_texts(trajectory)
    if isinstance(prm, HelperJudge):
        return prm.trajectory_hidden(trajectory.problem, [s.text for s in trajectory.steps], killed)
    committed = prm.trajectory_hidden(trajectory.problem, [s.text for s in trajectory.steps])
    if not any(killed):
        return committed
    rows = []
    prm.start(trajectory.problem)
    for i, step in enumerate(trajectory.steps):
        rows.append(committed[i:i + 1])
        if killed[i]:
            rows.append(prm.candidate_hidden(killed[i]))
        prm.commit(step.text)
    return np.concatenate(rows)


class FeatureCache:
    def __init__(self, prm: PRM | HelperJudge, directory: Path = FEATURES_CACHE) -> None:
        self.prm = prm
        # the helper's context holds its own prompt: part of what a feature is
        read = f"-judged-{hashlib.sha256(prm.prompt.encode()).hexdigest()[:8]}" if isinstance(prm, HelperJudge) else ""
        self.directory = directory / f"{file_hash(prm.model.path)}-{prm.format.name}{read}"

    def path(self, trajectory: Trajectory) -> Path:
        texts = {"problem": trajectory.problem, "steps": [s.text for s in trajectory.steps],
                 "killed": killed_texts(trajectory)}
        digest = hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode()).hexdigest()[:24]
        return self.directory / f"{digest}.npy"

    def hidden(self, trajectory: Trajectory) -> tuple[np.ndarray, bool]:
        """The row's hidden states and whether they were cached."""
        path = self.path(trajectory)
        if path.exists():
            return np.load(path), True
        hidden = row_hidden(self.prm, trajectory)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, hidden.astype(np.float32))
        os.replace(tmp, path)
        return hidden, False


def dataset_hidden(cache: FeatureCache, rows: list[dict], progress: Callable[[bool], None] = lambda cached: None
                   ) -> np.ndarray:
    """Every labelled step of the rows, in order, [n, n_embd]."""
    out = []
    for row in rows:
        hidden, cached = cache.hidden(Trajectory.from_json(row["trajectory"]))
        out.append(hidden)
        progress(cached)
    return np.concatenate(out) if out else np.zeros((0, cache.prm.model.n_embd), np.float32)
