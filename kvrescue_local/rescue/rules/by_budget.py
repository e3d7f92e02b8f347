"""by-budget: one rule at base budgets up to `budget`, another above. Fitted per dataset (prmtrain/regime.py): the
budgets where evicted best-of-N solved fewer training problems than the helper alone, the evicted base writing
worse steps than the helper there, take the judge's or the helper's step; above them the base's own trajectory
leads. by-budget:0,X,Y is Y at every budget."""

from __future__ import annotations

from dataclasses import dataclass

from ..generator import Draft
from .base import Rule, register


@register
@dataclass(frozen=True)
class ByBudget(Rule):
    budget: int = 0
    up_to: Rule = None
    above: Rule = None
    name = "by-budget"
    positional = ("budget",)
    rules = ("up_to", "above")
    usage = "by-budget:B,RULE,RULE (the first rule at base KV budgets up to B, the second above)"

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"by-budget's budget is 0 or more, a KV budget (got {self.budget})")

    @property
    def needs_judge(self) -> bool:
        return self.up_to.needs_judge or self.above.needs_judge

    @property
    def key_name(self) -> str:
        return "regime"  # as configuration keys named it before rules were specs

    @property
    def checks_arithmetic(self) -> bool:
        return self.up_to.checks_arithmetic and self.above.checks_arithmetic

    def at_budget(self, budget: int) -> Rule:
        return (self.up_to if budget <= self.budget else self.above).at_budget(budget)

    def choose(self, survivors: list[Draft], seeds: tuple[int, int, int]) -> Draft:
        raise ValueError("by-budget chooses through the rule in force at the run's budget (Rule.at_budget)")
