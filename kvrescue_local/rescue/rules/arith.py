"""arith: the arithmetic check around a rule. A survivor whose step states false arithmetic ("15 × 0.08 = 12",
rescue/arithmetic.py) is set aside while another survivor states none, before the rule chooses; a lone survivor is
not checked, there being nothing to set it aside for. Fitted per dataset on training rows (prmtrain/commit.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..arithmetic import false_equalities
from ..generator import Draft
from .base import Rule, register


def arithmetic_checked(survivors: list[Draft]) -> list[Draft]:
    """The survivors whose steps state no false arithmetic, where one does and some other does not; every survivor
    otherwise. Each checked draft records what it stated falsely (its false_arithmetic)."""
    if len(survivors) < 2:
        return survivors
    for draft in survivors:
        draft.false_arithmetic = false_equalities(draft.content)
    return [c for c in survivors if not c.false_arithmetic] or survivors


@register
@dataclass(frozen=True)
class Arith(Rule):
    rule: Rule = None
    name = "arith"
    rules = ("rule",)
    usage = "arith:RULE (RULE, after survivors stating false arithmetic are set aside while another states none)"

    @property
    def needs_judge(self) -> bool:
        return self.rule.needs_judge

    @property
    def key_name(self) -> str:
        return self.rule.key_name

    @property
    def checks_arithmetic(self) -> bool:
        return True

    def at_budget(self, budget: int) -> Rule:
        return Arith(self.rule.at_budget(budget))

    def choose(self, survivors: list[Draft], seeds: tuple[int, int, int]) -> Draft:
        return self.rule.choose(arithmetic_checked(survivors), seeds)
