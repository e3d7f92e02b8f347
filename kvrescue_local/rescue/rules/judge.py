"""judge: the judge's favourite survivor (the PRM's, or the helper's head's), or the first within a margin of it.

A margin above the layout noise makes the pick among near-equal steps independent of what shared their decodes
(docs/prm.md): the base's candidates come first in a round's order, so near-ties go to the base."""

from __future__ import annotations

from dataclasses import dataclass

from ..generator import Draft
from .base import Rule, check_margin, favourite, register


@register
@dataclass(frozen=True)
class Judge(Rule):
    margin: float = 0.0
    name = "judge"
    usage = "judge[:margin=M] (the judge's favourite, or the first survivor within M of its score; M in [0, 1))"

    def __post_init__(self) -> None:
        check_margin(self.name, "margin", self.margin, open_top=True)

    @property
    def key_name(self) -> str:
        return "prm"  # as configuration keys named it before rules were specs

    def choose(self, survivors: list[Draft], seeds: tuple[int, int, int]) -> Draft:
        return favourite(survivors, self.margin)
