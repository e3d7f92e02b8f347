"""Grading: the last \\boxed{} of a trajectory against the gold answer, with math-verify."""

from __future__ import annotations

from functools import lru_cache

from math_verify import parse, verify

# math-verify gives up after its timeout and grades the answer wrong; its 5 s default was hit by ordinary
# MATH500 answers on loaded cores, so a grade depended on the load. A minute still stops pathological input.
TIMEOUT_S = 60


@lru_cache(maxsize=4096)
def parsed_gold(gold: str):
    return parse(f"${gold}$", parsing_timeout=TIMEOUT_S)


def is_correct(gold: str, answer: str | None) -> bool:
    """True when answer (the content of the last \\boxed{}) equals gold; argument order matters to math-verify."""
    if answer is None:
        return False
    gold_parsed = parsed_gold(gold)
    return bool(gold_parsed) and bool(verify(gold_parsed, parse(f"\\boxed{{{answer}}}", parsing_timeout=TIMEOUT_S),
                                             timeout_seconds=TIMEOUT_S))
