"""`kvrescue-local doctor`: check the patched llama.cpp build offline."""

from __future__ import annotations

import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import click
import numpy as np


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


@click.command()
@click.option("--n-gpu-layers", "-ngl", default=0, show_default=True, help="layers of the test model to offload")
def doctor(n_gpu_layers: int) -> None:
    """Check the patched llama.cpp build and decode with a tiny model, offline."""
    from ..gguf_export import TINY_BASE, write_tiny_model
    from ..runtime import Context, ContextParams, Model, Sampler, SamplingParams, library_path, llama, patched
    from ..runtime.lib import backends

    low = llama()
    click.echo(f"kvrescue-local {package_version('kvrescue-local')}, llama-cpp-python {package_version('llama_cpp_python')}")
    click.echo(f"library: {library_path()}")
    click.echo(f"patch level: {patched().llama_kvr_patch_level()}")
    click.echo(f"system: {low.llama_print_system_info().decode().strip()}")
    found = backends()
    click.echo("backends: " + ", ".join(f"{name} ({count} device{'s' * (count != 1)})" for name, count in found))
    accelerators = [name for name, _ in found if name != "CPU"]
    if low.llama_supports_gpu_offload():
        click.echo("GPU offload: yes")
    elif accelerators:  # compiled in, but no device found (no GPU, or no driver): llama.cpp runs on the CPU
        click.echo(f"GPU offload: no device found for the {', '.join(accelerators)} backend (no GPU or no driver); "
                   "running on the CPU")
    else:
        click.echo("GPU offload: no (CPU build)")
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
