"""Limits checked before any solving: an empty or non-UTF-8 problem, a prompt longer than a model's trained
context (N against llama.cpp's sequences is RescueConfig's own check)."""

from __future__ import annotations

from ..errors import KVRescueError
from ..runtime import Model
from .config import RescueConfig


def check_problem(text: str, where: str) -> str:
    if not text.strip():
        raise KVRescueError(f"{where} is empty: give the problem's text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise KVRescueError(f"{where} holds bytes that are not UTF-8 (at character {exc.start}): pass the problem "
                            "as UTF-8 text (convert it, e.g. with iconv)") from None
    return text


def check_prompts_fit(config: RescueConfig, models: list[Model | None], problems: dict[str, str]) -> None:
    """Each problem's prompt plus one step must fit in every model's trained context: beyond it a model
    answers garbage, slowly."""
    for model in (m for m in models if m is not None):
        room = model.n_ctx_train - config.max_step_tokens
        for where, problem in problems.items():
            tokens = len(model.tokenize(config.prompt.format(problem=problem)))
            if tokens > room:
                fits = max(0, len(problem) * room // tokens)
                raise KVRescueError(
                    f"{where} takes {tokens:,} tokens with the prompt template, but {model.path.name} was trained "
                    f"on {model.n_ctx_train:,} and one step of {config.max_step_tokens} must fit after it: shorten "
                    f"it (to about {fits:,} characters) or use a model with a longer context")
