"""The `kvrescue-local` command line."""

from __future__ import annotations

import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import click
import numpy as np

from .errors import KVRescueError


class ProjectErrorsAsOneLine(click.Group):
    """Every KVRescueError reaches the user as `Error: <message>`, never as a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KVRescueError as exc:
            raise click.ClickException(str(exc)) from None


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


@click.group(cls=ProjectErrorsAsOneLine)
@click.version_option(package_version("kvrescue-local"), prog_name="kvrescue-local")
def main() -> None:
    """KV-Rescue on llama.cpp: an evicted base model rescued by a full-context helper and a PRM."""


@main.command()
@click.option("--n-gpu-layers", "-ngl", default=0, show_default=True, help="layers of the test model to offload")
def doctor(n_gpu_layers: int) -> None:
    """Check the patched llama.cpp build and decode with a tiny model, offline."""
    from .gguf_export import TINY_BASE, write_tiny_model
    from .runtime import Context, ContextParams, Model, Sampler, SamplingParams, library_path, llama, patched

    low = llama()
    click.echo(f"kvrescue-local {package_version('kvrescue-local')}, llama-cpp-python {package_version('llama_cpp_python')}")
    click.echo(f"library: {library_path()}")
    click.echo(f"patch level: {patched().llama_kvr_patch_level()}")
    click.echo(f"system: {low.llama_print_system_info().decode().strip()}")
    click.echo(f"GPU offload: {'yes' if low.llama_supports_gpu_offload() else 'no (CPU build)'}")
    with tempfile.TemporaryDirectory(prefix="kvrescue-doctor-") as tmp:
        model = Model(write_tiny_model(Path(tmp) / "tiny.gguf", TINY_BASE, seed=0), n_gpu_layers=n_gpu_layers)
        n_cand = 8
        ctx = Context(model, ContextParams(n_ctx=1024, n_seq_max=n_cand))
        prompt = model.tokenize("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
        row = ctx.prefill(0, prompt)
        samplers = [Sampler(SamplingParams(seed=s)) for s in range(n_cand)]
        first = [s.sample(ctx, row) for s in samplers]
        for seq in range(1, n_cand):
            ctx.fork(0, seq)
        tokens = np.array(first, np.int32)
        n_steps = 32
        started = time.perf_counter()
        for _ in range(n_steps):
            ctx.step(np.arange(n_cand), tokens)
            tokens = np.array([s.sample(ctx, i) for i, s in enumerate(samplers)], np.int32)
        elapsed = time.perf_counter() - started
        cells, _ = ctx.cells(0)
        click.echo(f"tiny-model decode: {n_cand} sequences x {n_steps} steps, {n_cand * n_steps / elapsed:.0f} tokens/s; "
                   f"sequence 0 holds {len(cells)} cells (prompt {len(prompt)} + {n_steps} decoded)")
    click.echo("ok")


@main.group()
def models() -> None:
    """Model files: PRM conversion."""


@models.command("convert-prm")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(["f16", "f32"]), default="f16", show_default=True,
              help="storage of the backbone's matrices")
@click.option("--quantize", type=click.Choice(["q8_0", "q4_k_m", "q4_0"]), default=None,
              help="quantize the backbone with llama.cpp after conversion")
def convert_prm_command(src: Path, out: Path, dtype: str, quantize: str | None) -> None:
    """Convert a Hugging Face PRM checkpoint directory SRC into OUT (GGUF) and OUT's reward head."""
    from .prm import RewardHead, head_path
    from .prm.convert import convert_prm

    started = time.perf_counter()
    gguf = convert_prm(src, out, dtype=dtype, quantize=quantize)
    head = RewardHead.load(head_path(gguf))
    click.echo(f"wrote {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB) and {head_path(gguf).name}: "
               f"format {head.format}, hidden size {head.hidden_size}, {time.perf_counter() - started:.1f} s")
