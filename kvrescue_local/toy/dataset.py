"""The toy task as a benchmark dataset (`--dataset toy`): its held-out problems, graded by exact integer match."""

from __future__ import annotations

from ..bench.datasets import Dataset, Problem, generated
from .task import exact_match, held_out


@generated("toy")
def toy_dataset() -> Dataset:
    """The toy task's held-out problems (other seeds than training's); made only when asked for."""
    return Dataset("toy", [Problem(f"toy-{i}", p.text, str(p.answer)) for i, p in enumerate(held_out())], exact_match)
