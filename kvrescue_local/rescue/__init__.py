"""The stepwise search: KV-Rescue and its baselines on one shared machinery, and its records."""

from .config import QWEN_MATH_COT, RescueConfig
from .generator import Draft, Generator, Request
from .loop import Models, Progress, Rescue, check_compatible, longest_prompt, problem_key
from .record import MODES, SCHEMA_VERSION, Candidate, Mode, Step, Trajectory

__all__ = ["MODES", "QWEN_MATH_COT", "SCHEMA_VERSION", "Candidate", "Draft", "Generator", "Mode", "Models", "Progress",
           "Request",
           "Rescue", "RescueConfig", "Step", "Trajectory", "check_compatible", "longest_prompt", "problem_key"]
