"""KV eviction: a budget manager and token-level policies, one per file, registered by name."""

from . import h2o, rkv, snapkv, streaming  # noqa: F401  (each registers its policy)
from .base import POLICIES, EvictionInputs, Policy, make_policy, policy_specs
from .budget import BudgetedSequences, KVBudget, evicted_runs

POLICY_HELP = (f"eviction policy: NAME or NAME:OPTION=VALUE,... with NAME one of {', '.join(sorted(POLICIES))} "
               "(e.g. rkv:lam=0.07,kernel=7,similar=0.5); rkv and snapkv choose per layer and KV head, "
               "heads=shared keeps one set of positions for all (e.g. rkv:heads=shared)")

__all__ = ["POLICIES", "POLICY_HELP", "BudgetedSequences", "EvictionInputs", "KVBudget", "Policy", "evicted_runs",
           "make_policy", "policy_specs"]
