"""The stepwise search: KV-Rescue and its baselines on one shared machinery."""

from .config import MODES, QWEN_MATH_COT, RescueConfig
from .generator import Candidate, Generator
from .loop import Rescue, Trajectory, check_compatible, last_boxed, longest_prompt

__all__ = ["MODES", "QWEN_MATH_COT", "Candidate", "Generator", "Rescue", "RescueConfig", "Trajectory",
           "check_compatible", "last_boxed", "longest_prompt"]
