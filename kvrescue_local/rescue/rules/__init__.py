"""Commit rules: how a round's winner is chosen, one rule per file, registered by name, given as specs
(`judge:margin=0.005`, `by-budget:32,judge,lead:base`, `arith:judge`; base.py holds the grammar)."""

# each registers its rule; in this order the listing of a bad spec names them
from . import judge, drawn, lead, calibrated, by_budget, arith  # noqa: F401, I001
from .arith import Arith
from .base import RULES, Rule, parse_rule, rules_help
from .by_budget import ByBudget
from .calibrated import Calibrated
from .drawn import Random
from .judge import Judge
from .lead import Lead

# the spec each value of `--choice` (and a request's "choice") said before rules were specs: their refusal names it
CHOICE_SPECS = {"prm": "judge", "random": "random", "base-first": "lead:base", "helper-first": "lead:helper",
                "calibrated": "calibrated", "regime": "by-budget:BUDGET,judge,lead:base"}

__all__ = ["CHOICE_SPECS", "RULES", "Arith", "ByBudget", "Calibrated", "Judge", "Lead", "Random", "Rule", "parse_rule",
           "rules_help"]
