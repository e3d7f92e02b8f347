"""Fit the detector's thresholds from unlabeled candidate statistics.

Both signals are bimodal: Otsu's two-class split of each finds the two modes, and the
threshold sits in the middle of the gap between them. The split's separability
(between-class over total variance) says whether two modes were there at all.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from ..errors import KVRescueError
from .detector import DetectorParams

MIN_SEPARABILITY = 0.75  # below this the sample has one mode: keep the old threshold


def otsu_threshold(values, bins: int = 256) -> tuple[float, float]:
    """(threshold, separability in [0, 1]) of the best two-class split of values."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) < 4 or np.ptp(x) == 0:
        return float(x.mean()) if len(x) else 0.0, 0.0
    hist, edges = np.histogram(x, bins=bins)
    centers = (edges[:-1] + edges[1:]) / 2
    w0 = np.cumsum(hist)
    w1 = w0[-1] - w0
    m0 = np.cumsum(hist * centers)
    mu0 = m0 / np.maximum(w0, 1)
    mu1 = (m0[-1] - m0) / np.maximum(w1, 1)
    between = w0 * w1 * (mu0 - mu1) ** 2 / w0[-1] ** 2
    k = int(np.argmax(between[:-1]))
    cut = edges[k + 1]
    # Otsu's cut leans towards the larger class; the middle of the gap between the classes does not.
    threshold = (x[x <= cut].max() + x[x > cut].min()) / 2
    return float(threshold), float(between[k] / x.var())


def calibrate(stats: list[dict], params: DetectorParams = DetectorParams()) -> tuple[DetectorParams, dict]:
    """New thresholds from candidates' `Monitor.stats()`; returns them with a report of each fit."""
    if len(stats) < 8:
        raise KVRescueError(f"calibration needs the statistics of at least 8 candidates, got {len(stats)}: run more problems")
    report, changes = {}, {}
    for field, key in (("tau_entropy", "max_mean_entropy"), ("tau_compression", "min_compression")):
        threshold, separability = otsu_threshold([s[key] for s in stats])
        fitted = separability >= MIN_SEPARABILITY
        report[field] = {"threshold": threshold, "separability": separability, "used": fitted}
        if fitted:
            changes[field] = threshold
    return dataclasses.replace(params, **changes), report


def save_params(params: DetectorParams, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(dataclasses.asdict(params), indent=2) + "\n")
    return path


def load_params(path: str | Path) -> DetectorParams:
    try:
        return DetectorParams(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise KVRescueError(f"detector thresholds in {path} are unreadable ({exc}): calibrate again") from None
