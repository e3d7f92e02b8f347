"""random: a survivor drawn by a seed of the run's seed, the problem and the round (reproducible, and not the same
draw on every problem): the baseline that says what the judge's pick is worth. It scores nothing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..generator import Draft
from .base import Rule, register


@register
@dataclass(frozen=True)
class Random(Rule):
    name = "random"
    usage = "random (a survivor drawn per problem and round; no judge)"

    @property
    def needs_judge(self) -> bool:
        return False

    def choose(self, survivors: list[Draft], seeds: tuple[int, int, int]) -> Draft:
        return survivors[int(np.random.default_rng(list(seeds)).integers(len(survivors)))]
