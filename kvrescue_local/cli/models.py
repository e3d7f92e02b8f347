"""`kvrescue-local models`: list and fetch presets, convert PRM checkpoints."""

from __future__ import annotations

import time
from pathlib import Path

import click


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

    started = time.perf_counter()
    gguf = convert_prm(src, out, dtype=dtype, quantize=quantize)
    head = RewardHead.load(head_path(gguf))
    click.echo(f"wrote {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB) and {head_path(gguf).name}: "
               f"format {head.format}, hidden size {head.hidden_size}, {time.perf_counter() - started:.1f} s")


@models.command("list")
def models_list() -> None:
    """The presets: bundled ones and those fetched from the Hugging Face hub."""
    from ..hub import HUB_PRESETS
    from ..presets import PRESETS

    for name in PRESETS:
        click.echo(f"{name:18s} bundled")
    for preset in HUB_PRESETS.values():
        click.echo(f"{preset.name:18s} hub: base {preset.base}, helper {preset.helper}, PRM {preset.prm_repo} "
                   f"(converted locally, {preset.prm_quantize or 'f16'})")


@models.command("pull")
@click.argument("name")
@click.option("--offline", is_flag=True, help="use the Hugging Face cache only (check that everything is there)")
def models_pull(name: str, offline: bool) -> None:
    """Download a hub preset's models into the Hugging Face cache (with progress) and convert its PRM."""
    from ..presets import load_preset

    preset = load_preset(name, offline=offline or None)
    for role in ("base", "helper", "prm"):
        path = getattr(preset, role)
        click.echo(f"{role:6s} {path} ({path.stat().st_size / 2**30:.2f} GiB)")
