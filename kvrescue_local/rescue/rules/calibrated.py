"""calibrated: the survivor most probably right, each source's reward r mapped to P(step right) =
sigmoid(slope·r + bias) (the first on a tie). The four numbers (base slope, base bias, helper slope, helper bias) are
fitted on the labelled steps of training problems (prmtrain/commit.py, `kvrescue-local fit`); a spec without them
takes the ones the preset fitted for the run's dataset (its commit.json)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..generator import Draft
from .base import Rule, register, reward


def probability(fit: tuple[float, float, float, float], side: str, value: float) -> float:
    """P(step right) of a reward of `side`'s step under a fit."""
    slope, bias = fit[:2] if side == "base" else fit[2:]
    return 1 / (1 + math.exp(-(slope * value + bias)))


@register
@dataclass(frozen=True)
class Calibrated(Rule):
    fit: tuple[float, float, float, float] | None = None  # None: the preset's, for the run's dataset
    name = "calibrated"
    positional = ("fit",)
    usage = ("calibrated[:BS,BB,HS,HB] (the survivor most probably right, P = sigmoid(slope·reward + bias) per "
             "side; without the numbers, the preset's fit for the dataset)")

    def __post_init__(self) -> None:
        if self.fit is not None and len(self.fit) != 4:
            raise ValueError(f"calibrated takes four numbers (base slope, base bias, helper slope, helper bias), "
                             f"not {len(self.fit)}")

    def choose(self, survivors: list[Draft], seeds: tuple[int, int, int]) -> Draft:
        if self.fit is None:
            raise ValueError("calibrated has no numbers: give them in the spec (calibrated:BS,BB,HS,HB)")
        return max(survivors, key=lambda c: probability(self.fit, c.side, reward(c)))


def fits_in(rule: Rule) -> list[tuple[float, float, float, float]]:
    """The calibrations a rule's calibrated parts carry (a composition's, in order)."""
    own = [rule.fit] if isinstance(rule, Calibrated) and rule.fit is not None else []
    return own + [fit for field in rule.rules for fit in fits_in(getattr(rule, field))]


def unfitted(rule: Rule) -> bool:
    """Whether a calibrated part of the rule has no numbers yet."""
    return (isinstance(rule, Calibrated) and rule.fit is None) or any(unfitted(getattr(rule, f)) for f in rule.rules)


def with_fit(rule: Rule, fit: tuple[float, float, float, float]) -> Rule:
    """The rule with `fit` in each calibrated part that has no numbers."""
    if isinstance(rule, Calibrated):
        return rule if rule.fit is not None else Calibrated(tuple(fit))
    return dataclasses.replace(rule, **{f: with_fit(getattr(rule, f), fit) for f in rule.rules}) if rule.rules else rule
