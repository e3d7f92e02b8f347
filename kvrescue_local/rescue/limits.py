"""Limits checked before any solving: an empty or non-UTF-8 problem, every context size against the trained
context of its model and the memory allowed (from the GGUF headers, before llama.cpp allocates), a prompt longer
than a model's trained context, the KV memory of K problems at once (N and K against llama.cpp's sequences are
RescueConfig's own checks)."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import gguf_header
from ..errors import KVRescueError, SettingError
from ..eviction import make_policy
from ..files import check_encodable
from ..prm import PRM
from ..runtime import Model
from ..runtime.context import N_CTX_PAD, kv_bytes_per_cell
from .config import RescueConfig
from .judge import HelperHead

GIB = 1024 ** 3


def check_problem(text: str, where: str) -> str:
    if not text.strip():
        raise KVRescueError(f"{where} is empty: give the problem's text")
    return check_encodable(text, where, "pass the problem as UTF-8 text (convert it, e.g. with iconv)")


def prompt_room(config: RescueConfig, model: Model | ModelFacts) -> int:
    """The most prompt tokens (template included) a model holds: its trained context less one step of
    --max-step-tokens, which must fit after the prompt; beyond it a model answers garbage, slowly."""
    return model.n_ctx_train - config.max_step_tokens


def check_prompt_room(config: RescueConfig, model: Model | ModelFacts, tokens: int, what: str,
                      fix: Callable[[int], str], count: str | None = None) -> None:
    """`what` (a prompt of `tokens` tokens, or the cells reserved for one) within prompt_room; `fix(room)` says what
    to do about it (naming settings as errors.SettingError does); `count` words the tokens where they are a bound, not a count. solve's and bench's prompts,
    `serve --prompt-tokens` and each request's prompt share it."""
    room = prompt_room(config, model)
    if tokens > room:
        raise SettingError(f"{what} {count or f'{tokens:,} tokens'} with the prompt template, but {model.name} was "
                           f"trained on {model.n_ctx_train:,} and one step of {{max_step_tokens}} "
                           f"{config.max_step_tokens} must fit after it: {fix(room)}", "max_step_tokens")


def check_prompts_fit(config: RescueConfig, models: list[Model | None], problems: dict[str, str]) -> None:
    """Each problem's prompt plus one step must fit in every model's trained context: beyond it a model
    answers garbage, slowly. A prompt of more bytes than the room left could hold at the model's longest token is
    refused from its length, before tokenizing it (megabytes would take seconds and a gigabyte of tokens)."""
    for model in (m for m in models if m is not None):
        for where, problem in problems.items():
            prompt = config.prompt.format(problem=problem)
            size = len(prompt.encode("utf-8"))  # at least one byte a token: the vocabulary is read only past room
            count, about = None, "about"
            room = prompt_room(config, model)
            if size > room and size > room * model.longest_token_bytes:
                tokens = -(-size // model.longest_token_bytes)
                count = f"at least {tokens:,} tokens ({size:,} bytes, at most {model.longest_token_bytes} a token)"
                about = "well under"  # tokens is a lower bound: the characters that fit are fewer than its share
            else:
                tokens = len(model.tokenize(prompt))

            def fix(room: int) -> str:
                if room <= len(model.tokenize(config.prompt.format(problem=""))):
                    # not even the template fits beside one step: it is the step cap that leaves no room
                    return f"lower {{max_step_tokens}} to at most {max(1, model.n_ctx_train - tokens):,}"
                return (f"shorten it (to {about} {len(problem) * room // tokens:,} characters) or use a model with a "
                        "longer context")

            check_prompt_room(config, model, tokens, f"{where} takes", fix, count)


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
    for config in configs:  # the sequences bound it whatever the memory: say so rather than quote the memory
        config.check_concurrency(concurrency)
    largest = largest_fitting(configs, memory, need)
    if largest == 0:
        raise KVRescueError(f"not even one problem fits: its KV caches take {need(configs[0], 1) / GIB:.2f} GiB of the "
                            f"{memory / GIB:.2f} GiB allowed: raise --memory or lower --max-tokens")
    if concurrency > largest:
        most = max(need(c, concurrency) for c in configs)
        raise KVRescueError(f"--concurrency {concurrency} does not fit: its KV caches take {most / GIB:.2f} GiB of the "
                            f"{memory / GIB:.2f} GiB allowed (--memory); the largest concurrency that fits is {largest}")


@dataclass(frozen=True)
class ModelFacts:
    """What the size checks need of a model, read from its GGUF header before llama.cpp loads it (nothing is
    allocated): its file's name, the context it was trained on, and the shape of one KV cell. It has the
    attributes runtime.context.kv_bytes_per_cell and kv_memory read of a Model, so both take it in a Model's stead."""

    name: str
    n_ctx_train: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int

    @classmethod
    def read(cls, path: str | Path) -> "ModelFacts | None":
        """The facts of a GGUF file; None where it is missing, no GGUF or its header lacks them (opening the model
        then says what is wrong, in the order it checks)."""
        path = Path(path)
        if not path.is_file():  # a FIFO would block the open: opening the model refuses it
            return None
        try:
            with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                values = {key: gguf_header.string(data, at) if kind == gguf_header.STRING else
                          gguf_header.scalar(data, at, kind)
                          for key, kind, at, _ in gguf_header.metadata(data) if kind != gguf_header.ARRAY}
        except (OSError, struct.error, ValueError, KVRescueError):  # unreadable, empty, cut short, not a GGUF
            return None
        arch = values.get("general.architecture")
        keys = ("context_length", "block_count", "embedding_length", "attention.head_count")
        if not all(isinstance(values.get(f"{arch}.{key}"), int) for key in keys):
            return None
        n_ctx_train, n_layer, n_embd, n_head = (values[f"{arch}.{key}"] for key in keys)
        return cls(path.name, n_ctx_train, n_layer, n_embd, n_head, values.get(f"{arch}.attention.head_count_kv", n_head))


@dataclass(frozen=True)
class RunModels:
    """The facts of a run's models, None where a model is not used (or its header lacks them); prm only for a
    PRM with a context of its own."""

    base: ModelFacts | None = None
    helper: ModelFacts | None = None
    prm: ModelFacts | None = None


def size_text(size: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if size >= scale:
            return f"{size / scale:,.2f} {unit}"
    return f"{size:,.0f} B"


def check_budget_trained(config: RescueConfig, base: Model | ModelFacts) -> None:
    """A budget or buffer beyond the base's trained context never evicts, yet would allocate cells for all of it
    (or stall making them)."""
    for field, value in (("kv.budget", config.kv.budget), ("kv.buffer", config.kv.buffer)):
        if value > base.n_ctx_train:
            raise SettingError(f"{{{field}}} {value} exceeds the {base.n_ctx_train:,} positions {base.name} was "
                               f"trained on, so it never evicts: lower {{{field}}} to at most {base.n_ctx_train:,} "
                               "(or run mode full for no eviction)", field)


def check_kv_sizes(configs: list[RescueConfig], base: Model | None, prompt_tokens: int) -> None:
    """After the base opens, before its contexts are made: a budget or buffer beyond its trained context never
    evicts (checked from the GGUF header before, check_context_sizes, and here for each base a sweep
    opens); a protected prompt that fills the budget leaves the policy nothing to choose among."""
    for config in (c for c in configs if c.evicts and base is not None):
        check_budget_trained(config, base)
        kv = config.kv
        needed = prompt_tokens + kv.window
        if kv.protect_prompt and needed > kv.budget:
            raise SettingError(f"{{kv.protect_prompt}} keeps the prompt's {prompt_tokens} tokens, and with the recent "
                               f"window of {kv.window} they do not fit in {{kv.budget}} {kv.budget}: raise "
                               f"{{kv.budget}} to at least {needed}, or evict the prompt", "kv.budget",
                               "kv.protect_prompt")


def check_context_sizes(config: RescueConfig, models: RunModels, memory: int,
                        memory_option: str = "the memory available", prm_ctx: int = 0, problem_bytes: int = 0) -> None:
    """Before any model loads, so before llama.cpp allocates anything: every context one problem needs, against
    the trained context of its model and against `memory` bytes of KV caches (`memory_option` names where that
    number came from). A trajectory (--max-tokens) or a step (--max-step-tokens) longer than the base's or the
    helper's trained context, or a PRM context (--prm-ctx) longer than the PRM's, is refused naming its option;
    so are caches that do not fit, each named with the options that size it. `prm_ctx` 0: the PRM's context
    is sized from the longest problem's `problem_bytes`. The prompt's tokens are not known before the models
    load: they count as none here (check_prompts_fit checks them once the models are open).

    A plain function of the settings and the models' facts (ModelFacts.read of each GGUF), so that the server
    checks a request's settings as the command line checks its options."""
    if config.evicts and models.base is not None:
        check_budget_trained(config, models.base)
    for model, used in ((models.base, config.uses_base), (models.helper, config.uses_helper)):
        if model is None or not used:
            continue
        for field, value in (("max_tokens", config.max_tokens), ("max_step_tokens", config.max_step_tokens)):
            if value > model.n_ctx_train:
                raise SettingError(f"{{{field}}} {value} exceeds the {model.n_ctx_train:,} positions {model.name} was "
                                   f"trained on, beyond which it answers garbage: lower {{{field}}} to at most "
                                   f"{model.n_ctx_train:,}", field)
    if models.prm is not None and prm_ctx > models.prm.n_ctx_train:
        raise KVRescueError(f"--prm-ctx {prm_ctx} exceeds the {models.prm.n_ctx_train:,} positions {models.prm.name} "
                            f"was trained on: lower --prm-ctx to at most {models.prm.n_ctx_train:,}, or pass 0 to size "
                            "it from the problem")
    prm_cells = prm_ctx or config.prm_context(problem_bytes)
    need = kv_memory(config, 1, models.base, models.helper, models.prm, prm_cells, prompt_tokens=0)
    if need > memory:
        sized = []
        if config.uses_base and models.base is not None:
            sized.append(f"the evicted base by {{kv.budget}} {config.kv.budget} and {{kv.buffer}} {config.kv.buffer}"
                         if config.evicts else f"the base by {{max_tokens}} {config.max_tokens}")
        if config.uses_helper and models.helper is not None:
            sized.append(f"the helper by {{max_tokens}} {config.max_tokens}, {{n}} {config.n} and {{max_step_tokens}} "
                         f"{config.max_step_tokens}")
        if models.prm is not None and config.candidates_per_round > 1:
            sized.append(f"the PRM by --prm-ctx {prm_ctx}" if prm_ctx else
                         f"the PRM by the longest problem's {problem_bytes:,} bytes (--prm-ctx sizes it instead) and "
                         f"{{max_tokens}} {config.max_tokens}")
        raise SettingError(f"the KV caches of one problem take {size_text(need)}, more than the {size_text(memory)} "
                           f"of {memory_option}; they are sized: {'; '.join(sized)}: lower those, or raise the memory",
                           "max_tokens", "kv.budget", "kv.buffer", "n", "max_step_tokens")
