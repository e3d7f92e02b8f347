"""KV eviction: a budget manager and token-level policies, one per file, registered by name."""

from . import h2o, rkv, snapkv, streaming  # noqa: F401  (each registers its policy)
from .base import POLICIES, EvictionInputs, Policy, make_policy
from .budget import BudgetedSequences, KVBudget, evicted_runs

__all__ = ["POLICIES", "BudgetedSequences", "EvictionInputs", "KVBudget", "Policy", "evicted_runs", "make_policy"]
