"""What the commands share: the search options, list parsing, atomic JSON output."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ..errors import KVRescueError
from ..rescue import RescueConfig

DEFAULTS = RescueConfig()


def preset_default(value) -> str:
    return f"[default: the preset's, else {value}]"


# Options left unset (None) take the preset's recipe, else RescueConfig's defaults (kvrescue_local/compose.py)
SEARCH_OPTIONS = [
    click.option("--preset", default="toy", show_default=True, help="model preset (overridden by --base/--helper/--prm)"),
    click.option("--base", help="base model (evicted): a GGUF path, owner/repo:FILE.gguf or owner/repo:QUANT"),
    click.option("--helper", help="helper model (full context): a GGUF path, owner/repo:FILE.gguf or owner/repo:QUANT"),
    click.option("--prm", help="PRM: a backbone GGUF path (its .head.npz beside it) or a hub checkpoint owner/repo"),
    click.option("--prompt-template",
                 help="the chat prompt, with {problem} where the problem goes [default: the model's (preset or GGUF "
                      "metadata), else Qwen2.5-Math's]"),
    click.option("--buffer", type=int, help=f"entries added before each eviction {preset_default(DEFAULTS.kv.buffer)}"),
    click.option("--n-sink", type=int, help="first entries always kept [default: the preset's, else the policy's: "
                                            "streaming 4, the others 0]"),
    click.option("--window", type=int, help=f"recent entries always kept {preset_default(DEFAULTS.kv.window)}"),
    click.option("--protect-prompt/--evict-prompt", default=None,
                 help=f"never evict the prompt {preset_default(DEFAULTS.kv.protect_prompt)}"),
    click.option("--temp", "temperature", type=float, help=preset_default(DEFAULTS.temperature)),
    click.option("--top-p", type=float, help=preset_default(DEFAULTS.top_p)),
    click.option("--seed", "-s", type=int, help=preset_default(DEFAULTS.seed)),
    click.option("--n-gpu-layers", "-ngl", type=int, help=preset_default(DEFAULTS.n_gpu_layers)),
    click.option("--threads", "-t", type=int,
                 help="llama.cpp threads (0: KVRESCUE_THREADS, else physical cores - 1: one core stays free for "
                      f"other work) {preset_default(DEFAULTS.n_threads)}"),
    click.option("--flash-attn", "-fa", type=click.Choice(["on", "off", "auto"]), help=preset_default(DEFAULTS.flash_attn)),
    click.option("--max-tokens", type=int, help=f"trajectory length cap {preset_default(DEFAULTS.max_tokens)}"),
    click.option("--max-steps", type=int, help=preset_default(DEFAULTS.max_steps)),
    click.option("--max-step-tokens", type=int, help=preset_default(DEFAULTS.max_step_tokens)),
    click.option("--tau-entropy", type=float,
                 help="detector: mean entropy (nats) above which a base candidate dies "
                      f"{preset_default(DEFAULTS.detector.tau_entropy)}"),
    click.option("--tau-compression", type=float,
                 help=f"detector: zstd ratio below which a base candidate dies "
                      f"{preset_default(DEFAULTS.detector.tau_compression)}"),
    click.option("--prm-ctx", type=int, default=0, show_default=True,
                 help="PRM context in its own tokens (0: sized from the problem; it grows as the trajectory does)"),
]


def search_options(command):
    for option in reversed(SEARCH_OPTIONS):
        command = option(command)
    return command


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KVRescueError(f"expected comma-separated integers, not {text!r}") from None


UNITS = {"k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}


def parse_size(text: str, option: str) -> int:
    """'512M', '8G', '1.5GiB' or bytes -> bytes."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        size = int(float(value[:-1]) * UNITS[value[-1]]) if value and value[-1] in UNITS else int(value)
    except ValueError:
        raise KVRescueError(f"{option} takes a size like 512M or 8G, not {text!r}") from None
    if size <= 0:
        raise KVRescueError(f"{option} must be a positive size, not {text!r}")
    return size


def name_list(text: str, allowed, what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in allowed]
    if unknown or not names:
        raise KVRescueError(f"unknown {what} {', '.join(unknown) or repr(text)}: use {', '.join(sorted(allowed))}")
    return names


def write_json_atomically(path: Path, data: dict) -> None:
    """Complete file or none: a crash or Ctrl-C never leaves half a JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def note(text: str) -> None:
    click.echo(text, err=True)
