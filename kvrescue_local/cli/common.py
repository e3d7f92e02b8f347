"""What the commands share: the search options, list parsing, JSON output."""

from __future__ import annotations

from pathlib import Path

import click

from ..bench.estimate import scaled
from ..errors import KVRescueError
from ..files import json_text, write_output
from ..rescue import RescueConfig
from ..rescue.rules import CHOICE_SPECS, rules_help
from ..runtime.context import CACHE_TYPES
from ..settings import POSITIVE, SEED, TEMPERATURE, TOP_P, Finite
from .options import MAX_THREADS, NON_NEGATIVE, THREADS, PromptTemplate

DEFAULTS = RescueConfig()


def preset_default(value) -> str:
    return f"[default: the preset's, else {value}]"


# llama.cpp's names: -ctk/-ctv for the model, and for the second model the draft model's -ctkd/-ctvd with h for helper
CACHE_TYPE_OPTIONS = [
    click.option("--cache-type-k", "-ctk", type=click.Choice(list(CACHE_TYPES)),
                 help=f"KV cache type for K, base and helper (llama.cpp's -ctk) {preset_default(DEFAULTS.cache_type_k)}"),
    click.option("--cache-type-v", "-ctv", type=click.Choice(list(CACHE_TYPES)),
                 help="KV cache type for V, base and helper (llama.cpp's -ctv; a quantized V needs -fa on) "
                      f"{preset_default(DEFAULTS.cache_type_v)}"),
    click.option("--cache-type-k-helper", "-ctkh", type=click.Choice(list(CACHE_TYPES)),
                 help="the helper's K cache type, as llama.cpp's -ctkd sets its draft model's [default: -ctk's]"),
    click.option("--cache-type-v-helper", "-ctvh", type=click.Choice(list(CACHE_TYPES)),
                 help="the helper's V cache type, as llama.cpp's -ctvd sets its draft model's [default: -ctv's]"),
]


def cache_type_options(command):
    for option in reversed(CACHE_TYPE_OPTIONS):
        command = option(command)
    return command


RULE_HELP = (f"how a round's winner is chosen among its survivors, a rule spec (docs/prm.md): {rules_help()} "
             "[default: the preset's for the dataset, else judge]")

FITTED_FOR_HELP = ("DATASET: the preset's rule fitted for that dataset's problems applies (bench run --dataset "
                   "applies its own; a --data file's problems take the preset's default without it), e.g. gsm8k")

# what the options that set a rule before rules were specs say in one
OLD_RULE_OPTIONS = {
    "--choice": lambda v: " --rule ".join(CHOICE_SPECS.get(x.strip(), "judge") for x in str(v).split(",") if x.strip()),
    "--pick-margin": lambda v: f"judge:margin={v} (or lead:SIDE,pick={v})",
    "--helper-margin": lambda v: f"lead:base,margin={v}",
    "--base-margin": lambda v: f"lead:helper,margin={v}",
    "--judge-max-budget": lambda v: f"by-budget:{v},judge,lead:base",
    "--weak-base-choice": lambda v: f"by-budget:BUDGET,{CHOICE_SPECS.get(v, 'judge')},lead:base",
    "--check-arithmetic": lambda v: "arith:RULE (e.g. arith:judge)" if v else "RULE without arith:",
}


def refuse_old_rule_option(ctx, param, value) -> None:
    """An option of the rules before they were specs: one Error line naming the spec that says the same."""
    if value is None or value == ():
        return
    option = "--check-arithmetic" if param.name == "check_arithmetic" else param.opts[0]
    given = next(iter(value)) if isinstance(value, tuple) else value
    shown = option if option != "--check-arithmetic" or given else "--no-check-arithmetic"
    raise KVRescueError(f"{shown} is gone: commit rules are specs now, pass --rule {OLD_RULE_OPTIONS[option](given)} "
                        "(docs/prm.md lists the rules)")


REFUSED_RULE_OPTIONS = [
    *(click.option(name, hidden=True, expose_value=False, callback=refuse_old_rule_option)
      for name in OLD_RULE_OPTIONS if name != "--check-arithmetic"),
    click.option("--check-arithmetic/--no-check-arithmetic", default=None, hidden=True, expose_value=False,
                 callback=refuse_old_rule_option),
]


# Options left unset (None) take the preset's recipe, else RescueConfig's defaults (kvrescue_local/compose.py)
def detector_options(prefix: str, side: str, tau_entropy, tau_compression, unwatched: str = "") -> list:
    """--{prefix}tau-entropy and --{prefix}tau-compression: the detector's thresholds for one side's candidates."""
    return [click.option(f"--{prefix}tau-entropy", type=Finite(0),
                         help=f"detector: mean entropy (nats) above which a {side} candidate dies{unwatched} "
                              f"{preset_default(tau_entropy)}"),
            click.option(f"--{prefix}tau-compression", type=Finite(0),
                         help=f"detector: zstd ratio below which a {side} candidate dies {preset_default(tau_compression)}")]


SEARCH_OPTIONS = [
    click.option("--preset", default="toy", show_default=True,
                 help="model preset, or a folder `kvrescue-local fit` wrote (overridden by --base/--helper/--prm)"),
    click.option("--base", help="base model (evicted): a GGUF path, owner/repo:FILE.gguf or owner/repo:QUANT"),
    click.option("--helper", help="helper model (full context): a GGUF path, owner/repo:FILE.gguf or owner/repo:QUANT"),
    click.option("--prm", help="PRM: a backbone GGUF path (its .head.npz beside it, or PATH.gguf:HEAD.npz), a hub "
                               "checkpoint owner/repo, or helper[:HEAD.npz]: a head on the helper's own context (the "
                               "preset's helper head, or that one)"),
    click.option("--prompt-template", type=PromptTemplate(),
                 help="the chat prompt, with {problem} where the problem goes [default: the model's (preset or GGUF "
                      "metadata), else Qwen2.5-Math's]"),
    click.option("--buffer", type=POSITIVE, help=f"entries added before each eviction {preset_default(DEFAULTS.kv.buffer)}"),
    click.option("--n-sink", type=NON_NEGATIVE, help="first entries always kept [default: the preset's, else the policy's: "
                                            "streaming 4, the others 0]"),
    click.option("--window", type=POSITIVE, help=f"recent entries always kept {preset_default(DEFAULTS.kv.window)}"),
    click.option("--protect-prompt/--evict-prompt", default=None,
                 help=f"never evict the prompt {preset_default(DEFAULTS.kv.protect_prompt)}"),
    click.option("--temp", "temperature", type=TEMPERATURE, help=preset_default(DEFAULTS.temperature)),
    click.option("--top-p", type=TOP_P, help=preset_default(DEFAULTS.top_p)),
    click.option("--seed", "-s", type=SEED, help=preset_default(DEFAULTS.seed)),
    click.option("--n-gpu-layers", "-ngl", type=click.IntRange(min=-1), help=preset_default(DEFAULTS.n_gpu_layers)),
    click.option("--threads", "-t", type=THREADS,
                 help=f"llama.cpp threads, at most {MAX_THREADS} (0: KVRESCUE_THREADS, else physical cores - 1: one core "
                      f"stays free for other work) {preset_default(DEFAULTS.n_threads)}"),
    click.option("--flash-attn", "-fa", type=click.Choice(["on", "off", "auto"]), help=preset_default(DEFAULTS.flash_attn)),
    *CACHE_TYPE_OPTIONS,
    click.option("--max-tokens", type=POSITIVE, help=f"trajectory length cap {preset_default(DEFAULTS.max_tokens)}"),
    click.option("--max-steps", type=POSITIVE, help=preset_default(DEFAULTS.max_steps)),
    click.option("--max-step-tokens", type=POSITIVE, help=preset_default(DEFAULTS.max_step_tokens)),
    *REFUSED_RULE_OPTIONS,
    *detector_options("", "base", DEFAULTS.detector.tau_entropy, DEFAULTS.detector.tau_compression),
    *detector_options("helper-", "helper", DEFAULTS.helper_tau_entropy, DEFAULTS.helper_tau_compression,
                      " (0 and 0: the helper is not watched)"),
    click.option("--rpc", help="host:port[,host:port...]: offload the models' layers to these `kvrescue-local "
                               "rpc-server`s (every layer unless -ngl says how many; needs a build with --rpc)"),
    click.option("--prm-ctx", type=NON_NEGATIVE, default=0, show_default=True,
                 help="PRM context in its own tokens (0: sized from the problem; it grows as the trajectory does)"),
]


def search_options(command):
    for option in reversed(SEARCH_OPTIONS):
        command = option(command)
    return command


UNITS = {"k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}
MAX_SIZE = 2 ** 63 - 1  # llama.cpp and the OS count bytes in 64 bits


def parse_size(text: str, option: str) -> int:
    """'512M', '8G', '1.5GiB' or bytes -> bytes; a size that is not finite ('infG', '1e400k') or beyond 64 bits
    is refused."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        size = scaled(value[:-1], UNITS[value[-1]]) if value and value[-1] in UNITS else int(value)
    except ValueError:
        raise KVRescueError(f"{option} takes a size like 512M or 8G, not {text!r}") from None
    if size <= 0:
        raise KVRescueError(f"{option} must be a positive size, not {text!r}")
    if size > MAX_SIZE:
        raise KVRescueError(f"{option} {text} is larger than any memory (8 EiB, 64-bit byte counts): give a size "
                            "like 512M or 8G")
    return size


def name_list(text: str, allowed, what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in allowed]
    if unknown or not names:
        raise KVRescueError(f"unknown {what} {', '.join(unknown) or repr(text)}: use {', '.join(sorted(allowed))}")
    return names


def write_json(path: Path, data: dict, option: str) -> None:
    """Complete file or none (files.write_output); NaN or infinity would not be JSON, so they are refused."""
    write_output(path, json_text(data, f"the record for {option} {path}:", indent=1) + "\n", option)


def note(text: str) -> None:
    click.echo(text, err=True)
