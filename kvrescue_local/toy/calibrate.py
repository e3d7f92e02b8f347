"""The detector's thresholds for the toy preset, fitted (detect.calibrate, no labels) to the base
candidates of KV-Rescue runs with the detector disarmed, on problems the toy dataset never uses."""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..detect import DetectorParams, calibrate
from ..rescue import Trajectory
from .task import EVAL_SEED, problems

CALIBRATION_SEED = EVAL_SEED + 10_000
CALIBRATION_BUDGET = 48  # the smallest budget of the README's table, where the base degenerates most


def disarmed(params: DetectorParams) -> DetectorParams:
    """The same windows with thresholds no candidate reaches: every candidate runs to its end."""
    return dataclasses.replace(params, tau_entropy=1e6, tau_compression=1e-6)


def calibration_problems(count: int) -> list[str]:
    return [p.text for p in problems(CALIBRATION_SEED, count)]


def calibrate_detector(solve: Callable[[str], Trajectory], texts: list[str], params: DetectorParams,
                       progress: Callable[[int], None] = lambda k: None) -> tuple[DetectorParams, dict]:
    """`solve` runs one problem under a disarmed detector; returns params (windows kept, thresholds
    fitted, or the default thresholds where a statistic has one mode only) and the fit report."""
    stats = []
    for text in texts:
        stats += [c.detector for c in solve(text).base_candidates if c.detector is not None]
        progress(1)
    defaults = DetectorParams()
    return calibrate(stats, dataclasses.replace(params, tau_entropy=defaults.tau_entropy,
                                                tau_compression=defaults.tau_compression))
