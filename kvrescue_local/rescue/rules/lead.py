"""lead: one side's step first. The side's favourite survivor is committed unless none survives or the other side's
favourite scores more than `margin` above it (1: only when none survives, as a reward lies in [0, 1]); each side's
favourite is the judge's pick among its own survivors, within `pick` of its best.

With the base leading, one base candidate a round, no kill and the margin never exceeded, the trajectory is evicted
best-of-N's (the base's seeds and sequences are the same in both modes)."""

from __future__ import annotations

from dataclasses import dataclass

from ..generator import Draft
from .base import Rule, check_margin, favourite, register, reward

SIDES = ("base", "helper")


@register
@dataclass(frozen=True)
class Lead(Rule):
    side: str = "base"
    margin: float = 1.0
    pick: float = 0.0
    name = "lead"
    positional = ("side",)
    usage = ("lead:SIDE[,margin=M,pick=P] (SIDE base or helper: its favourite unless the other side's scores more "
             "than M higher, M in [0, 1], default 1; each side's favourite within P of its best)")

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise ValueError(f"lead's side is base or helper, not {self.side!r}")
        check_margin(self.name, "margin", self.margin)
        check_margin(self.name, "pick", self.pick, open_top=True)

    @property
    def key_name(self) -> str:
        return f"{self.side}-first"

    def choose(self, survivors: list[Draft], seeds: tuple[int, int, int]) -> Draft:
        ours = [c for c in survivors if c.side == self.side]
        theirs = [c for c in survivors if c.side != self.side]
        if not ours or not theirs:
            return favourite(ours or theirs, self.pick)
        leader, other = favourite(ours, self.pick), favourite(theirs, self.pick)
        return other if reward(other) - reward(leader) > self.margin else leader
