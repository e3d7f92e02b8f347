"""Limits checked before any solving: an empty or non-UTF-8 problem, a prompt longer than a model's trained
context, the KV memory of K problems at once (N and K against llama.cpp's sequences are RescueConfig's own
checks)."""

from __future__ import annotations

import os

from ..errors import KVRescueError
from ..eviction import make_policy
from ..prm import PRM
from ..runtime import Model
from ..runtime.context import N_CTX_PAD, kv_bytes_per_cell
from .config import RescueConfig
from .judge import HelperHead

GIB = 1024 ** 3


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


def padded(cells: int) -> int:
    return -(-cells // N_CTX_PAD) * N_CTX_PAD


def kv_memory(config: RescueConfig, slots: int, base: Model | None, helper: Model | None, prm: Model | None,
              prm_cells: int, prompt_tokens: int, helper_scores: bool = False) -> int:
    """Bytes the KV caches of `slots` problems at once take, allocated up front: the base's and the helper's
    contexts (config.context_cells; with helper_scores, `--prm helper`, the helper's also holds every problem's
    base candidates, config.scoring_cells), the base's attention-score accumulators (one float per cell, sequence and layer)
    when its policy reads attention, and the PRM's context (`prm_cells` per problem, one batch shared; PRM
    caches are f16)."""
    total = 0
    for side, model, used in (("base", base, config.uses_base), ("helper", helper, config.uses_helper)):
        if model is None or not used:
            continue
        scoring = config.scoring_cells(slots) if side == "helper" and helper_scores else 0
        cells = padded(config.context_cells(side, slots, prompt_tokens) + scoring)
        total += cells * kv_bytes_per_cell(model, *config.cache_types(side))
        if side == "base" and config.evicts and make_policy(config.kv.policy).reads_attention:
            total += cells * slots * (config.n + 1) * model.n_layer * 4
    if prm is not None and config.candidates_per_round > 1:
        total += padded(slots * max(0, prm_cells - config.n_batch) + config.n_batch) * kv_bytes_per_cell(prm, "f16", "f16")
    return total


def models_kv_memory(config: RescueConfig, slots: int, base: Model | None, helper: Model | None,
                     judge: PRM | HelperHead | None, prompt_tokens: int) -> int:
    """kv_memory of a run's models: a PRM with a context of its own adds that context (its cells per problem as
    opened), a head on the helper's context (`--prm helper`) the base candidates the helper reads."""
    prm = judge if isinstance(judge, PRM) else None
    return kv_memory(config, slots, base, helper, prm and prm.model, prm.params.n_ctx if prm else 0, prompt_tokens,
                     helper_scores=judge is not None and prm is None)


def available_memory() -> int:
    """Memory the system can give without swapping (MemAvailable), in bytes."""
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def largest_fitting(configs: list[RescueConfig], memory: int, need) -> int:
    """The most problems at once that every configuration runs within `memory` bytes of KV caches
    (`need(config, slots)` gives the bytes) and llama.cpp's sequences; 0 if not even one fits."""
    best = min(c.largest_concurrency() for c in configs)
    while best > 0 and any(need(c, best) > memory for c in configs):
        best -= 1
    return best


def check_concurrency_fits(configs: list[RescueConfig], concurrency: int, memory: int, need) -> None:
    largest = largest_fitting(configs, memory, need)
    if largest == 0:
        raise KVRescueError(f"not even one problem fits: its KV caches take {need(configs[0], 1) / GIB:.2f} GiB of the "
                            f"{memory / GIB:.2f} GiB allowed: raise --memory or lower --max-tokens")
    if concurrency > largest:
        most = max(need(c, concurrency) for c in configs)
        raise KVRescueError(f"--concurrency {concurrency} does not fit: its KV caches take {most / GIB:.2f} GiB of the "
                            f"{memory / GIB:.2f} GiB allowed (--memory); the largest concurrency that fits is {largest}")
