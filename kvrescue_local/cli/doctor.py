"""`kvrescue-local doctor`: check the patched llama.cpp build offline."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import click
import numpy as np

from ..errors import KVRescueError
from ..runtime.lib import GGML_BACKEND_DEVICE_TYPE_CPU, OFFLOAD_DEVICE_TYPES


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def load_and_decode(path: Path, device: str, device_type: int) -> None:
    """Load the model with every layer on device (the CPU: none offloaded) and decode its prompt once."""
    from ..compose import ALL_LAYERS
    from ..runtime import Context, ContextParams, Model

    offload = device_type in OFFLOAD_DEVICE_TYPES
    model = Model(path, n_gpu_layers=ALL_LAYERS if offload else 0, devices=(device,) if offload else ())
    ctx = Context(model, ContextParams(n_ctx=256))
    ctx.prefill(0, model.tokenize("What is 2+3?"))


def check_load(path: Path, device: str, device_type: int) -> None:
    """load_and_decode in a process of its own, so that a build that crashes there ends in one line, not a core dump."""
    run = subprocess.run([sys.executable, "-m", "kvrescue_local", "doctor", "--load-on", device, "--device-type",
                          str(device_type), "--model", str(path)], capture_output=True, text=True)
    if run.returncode < 0:
        number = -run.returncode
        raise KVRescueError(f"loading a model on {device} crashed (signal {number}, {signal.Signals(number).name}): "
                            "this llama.cpp build cannot run there, and every command that loads a model would crash "
                            "the same way; rebuild it (README: set-up; for a GPU docs/gpu-build.md)")
    if run.returncode != 0:
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        raise KVRescueError(f"loading a model on {device} failed: "
                            f"{lines[-1].removeprefix('Error: ') if lines else f'exit status {run.returncode}'}")


@click.command()
@click.option("--n-gpu-layers", "-ngl", default=0, show_default=True, help="layers of the test model to offload")
@click.option("--load-on", hidden=True, help="only load --model on this device and decode once (the check of each device)")
@click.option("--device-type", hidden=True, type=int, default=GGML_BACKEND_DEVICE_TYPE_CPU)
@click.option("--model", "model_path", hidden=True, type=click.Path(dir_okay=False, path_type=Path))
def doctor(n_gpu_layers: int, load_on: str | None, device_type: int, model_path: Path | None) -> None:
    """Check the patched llama.cpp build: load a tiny model on every device it finds, then decode, offline."""
    from ..gguf_export import TINY_BASE, write_tiny_model
    from ..runtime import Context, ContextParams, Model, Sampler, SamplingParams, library_path, llama, patched
    from ..runtime.lib import backends, devices

    if load_on is not None:
        load_and_decode(model_path, load_on, device_type)
        return
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
        path = write_tiny_model(Path(tmp) / "tiny.gguf", TINY_BASE, seed=0)
        checked = [(name, kind) for name, kind in devices()
                   if kind == GGML_BACKEND_DEVICE_TYPE_CPU or kind in OFFLOAD_DEVICE_TYPES]
        for name, kind in checked:
            check_load(path, name, kind)
        click.echo("model load: " + ", ".join(f"{name} ok" for name, _ in checked))
        model = Model(path, n_gpu_layers=n_gpu_layers)
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
