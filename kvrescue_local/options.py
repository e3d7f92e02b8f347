"""Command-line options shared by `solve` and `bench run`, and the objects they build."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from .detect import DetectorParams
from .detect.calibrate import load_params
from .errors import KVRescueError
from .eviction import KVBudget
from .hub import resolve_gguf, resolve_prm
from .presets import CACHE, PRESET_DETECTORS, PRESET_PROMPTS, load_preset
from .prm import PRM, PRMParams
from .rescue import RescueConfig
from .runtime import Model

SEARCH_OPTIONS = [
    click.option("--preset", default="toy", show_default=True, help="model preset (overridden by --base/--helper/--prm)"),
    click.option("--base", help="base model (evicted): a GGUF path, owner/repo:FILE.gguf or owner/repo:QUANT"),
    click.option("--helper", help="helper model (full context): a GGUF path, owner/repo:FILE.gguf or owner/repo:QUANT"),
    click.option("--prm", help="PRM: a backbone GGUF path (its .head.npz beside it) or a hub checkpoint owner/repo"),
    click.option("--buffer", type=int, default=128, show_default=True, help="entries added before each eviction"),
    click.option("--n-sink", type=int, help="first entries always kept [default: the policy's: streaming 4, others 0]"),
    click.option("--window", type=int, default=8, show_default=True, help="recent entries always kept"),
    click.option("--protect-prompt", is_flag=True, help="never evict the prompt"),
    click.option("--temp", "temperature", type=float, default=0.7, show_default=True),
    click.option("--top-p", type=float, default=0.8, show_default=True),
    click.option("--seed", "-s", type=int, default=0, show_default=True),
    click.option("--n-gpu-layers", "-ngl", type=int, default=0, show_default=True),
    click.option("--threads", "-t", type=int, default=0, show_default=True,
                 help="llama.cpp threads (0: physical cores - 1, or KVRESCUE_THREADS; one core stays free for other work)"),
    click.option("--flash-attn", "-fa", type=click.Choice(["on", "off", "auto"]), default="off", show_default=True),
    click.option("--max-tokens", type=int, default=4096, show_default=True, help="trajectory length cap"),
    click.option("--max-steps", type=int, default=512, show_default=True),
    click.option("--max-step-tokens", type=int, default=256, show_default=True),
    click.option("--tau-entropy", type=float,
                 help="detector: mean entropy (nats) above which a base candidate dies [default: the preset's "
                      f"calibrated one, else {DetectorParams().tau_entropy}]"),
    click.option("--tau-compression", type=float,
                 help="detector: zstd ratio below which a base candidate dies [default: the preset's "
                      f"calibrated one, else {DetectorParams().tau_compression}]"),
    click.option("--prm-ctx", type=int, default=0, show_default=True,
                 help="PRM context in its own tokens (0: sized from the problem; it grows as the trajectory does)"),
]


def search_options(command):
    for option in reversed(SEARCH_OPTIONS):
        command = option(command)
    return command


def detector_params(options: dict) -> DetectorParams:
    """The preset's calibrated detector (when its models are used), with the thresholds given on the command line."""
    o = options
    path = PRESET_DETECTORS.get(o["preset"]) if o["base"] is None else None
    params = load_params(path) if path and path.exists() else DetectorParams()
    given = {k: o[k] for k in ("tau_entropy", "tau_compression") if o[k] is not None}
    return dataclasses.replace(params, **given)


def template_config(mode: str, n: int, budget: int, policy: str, options: dict) -> RescueConfig:
    """A RescueConfig from the shared options (and the sweep axes given separately)."""
    o = options
    return RescueConfig(
        mode=mode, n=n,
        kv=KVBudget(budget=budget, buffer=o["buffer"], n_sink=o["n_sink"], window=o["window"], policy=policy,
                    protect_prompt=o["protect_prompt"]),
        detector=detector_params(o),
        max_tokens=o["max_tokens"], max_steps=o["max_steps"], max_step_tokens=o["max_step_tokens"],
        temperature=o["temperature"], top_p=o["top_p"], seed=o["seed"], n_gpu_layers=o["n_gpu_layers"],
        flash_attn=o["flash_attn"], n_threads=o["threads"],
        **({"prompt": PRESET_PROMPTS[o["preset"]]} if o["base"] is None and o["preset"] in PRESET_PROMPTS else {}))


PRM_TEMPLATE_TOKENS = 256  # the PRM's chat template around the problem


def open_models(options: dict, needs_base: bool, needs_helper: bool, max_candidates: int, problems: list[str]):
    """(base, helper, prm) from --base/--helper/--prm, falling back to the preset for what is not given.

    The PRM is opened only when a round has a choice (max_candidates > 1). Its context starts at
    --prm-ctx, or at the longest problem (a token covers at least one byte, so its UTF-8 length bounds
    its tokens) + the trajectory cap + one batch of candidates, and grows in the PRM's own tokens."""
    o = options
    needs_prm = max_candidates > 1
    given = {k: o[k] for k in ("base", "helper", "prm")}
    preset = None
    if any(given[k] is None for k, needed in (("base", needs_base), ("helper", needs_helper), ("prm", needs_prm)) if needed):
        preset = load_preset(o["preset"])
        if preset.note:
            click.echo(f"preset {preset.name}: {preset.note}", err=True)
    path = {k: given[k] or getattr(preset, k) for k in given} if preset else dict(given)
    if needs_prm and path["prm"] is None:
        raise KVRescueError(f"the {preset.name} preset has no PRM yet, and {max_candidates} candidates per round need "
                            "one to choose between them: pass --prm PATH.gguf (or use -n 1 in mode full, bon or helper)")
    for role in ("base", "helper"):
        path[role] = path[role] and resolve_gguf(path[role])
    if given["prm"] and not Path(given["prm"]).exists() and given["prm"].count("/") == 1:
        path["prm"] = resolve_prm(given["prm"], CACHE / "prm", quantize="q8_0")
    ngl = o["n_gpu_layers"]
    base = Model(path["base"], n_gpu_layers=ngl) if needs_base else None
    helper = Model(path["helper"], n_gpu_layers=ngl) if needs_helper else None
    if not needs_prm:
        return base, helper, None
    prm_params = PRMParams(max_candidates=max_candidates, n_gpu_layers=ngl, flash_attn=o["flash_attn"],
                           n_threads=o["threads"])
    longest = max(len(p.encode()) for p in problems)
    n_ctx = o["prm_ctx"] or longest + PRM_TEMPLATE_TOKENS + o["max_tokens"] + prm_params.n_batch
    return base, helper, PRM(path["prm"], dataclasses.replace(prm_params, n_ctx=n_ctx))
