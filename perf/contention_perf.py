#!/usr/bin/env python3
"""Decode speed with and without a competing busy process, side by side, per thread setting.

For each model (the tiny test model, and the pulled coder-0.5b (`models pull coder-0.5b`) or --model if present) and each
thread setting (the old default, every core; every core with OpenMP's passive wait policy; the new
default, physical cores - 1), a fresh process decodes one sequence token by token, first alone, then
while a busy Python loop competes for a core. Prints tokens/s idle, tokens/s busy and the slowdown
(idle / busy); the goal is a slowdown under 2.5x.

Usage: python3 perf/contention_perf.py [--steps 64] [--seconds 20] [--model PATH.gguf ...]
(KVRESCUE_THREADS is ignored here: each setting passes its thread count explicitly.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REAL_MODEL = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvrescue-local" / "models" / "coder-0.5b.gguf"
BUSY_LOOP = "while True: pass"


def decode_speed(model_path: str, threads: int, steps: int, seconds: float) -> float:
    """Tokens/s of single-sequence decoding (stops early after `seconds`, so a collapse stays bounded)."""
    import numpy as np

    from kvrescue_local.runtime import Context, ContextParams, Model

    model = Model(model_path)
    ctx = Context(model, ContextParams(n_ctx=512, n_threads=threads, flash_attn="off"))
    ctx.prefill(0, model.tokenize("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"))
    token = 1
    for _ in range(4):  # warm-up: first decodes allocate
        ctx.step([0], [token])
    started = time.perf_counter()
    done = 0
    while done < steps and time.perf_counter() - started < seconds:
        ctx.step([0], [token])
        token = int(np.argmax(ctx.logits(0)))
        done += 1
    return done / (time.perf_counter() - started)


def measure(model_path: str, threads: int, env: dict, steps: int, seconds: float) -> float:
    child = [sys.executable, __file__, "--child", model_path, str(threads), str(steps), str(seconds)]
    out = subprocess.run(child, env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def settings() -> list[tuple[str, int, dict]]:
    from kvrescue_local.runtime.context import physical_cores

    cores = os.cpu_count() or 1
    new = max(1, physical_cores() - 1)
    return [(f"old default: all cores ({cores})", cores, {}),
            (f"all cores ({cores}), OMP_WAIT_POLICY=passive", cores, {"OMP_WAIT_POLICY": "passive"}),
            (f"new default: physical cores - 1 ({new})", new, {})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0, help="cap per measurement")
    parser.add_argument("--model", action="append", default=[], help="a GGUF to measure (repeatable)")
    args = parser.parse_args()

    from kvrescue_local.gguf_export import TINY_BASE, write_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvrescue-contention-") as tmp:
        models = [str(write_tiny_model(Path(tmp) / "tiny.gguf", TINY_BASE, seed=0))]
        models += args.model or ([str(REAL_MODEL)] if REAL_MODEL.exists() else [])
        print(f"{'model':18s} {'threads':42s} {'idle tok/s':>10s} {'busy tok/s':>10s} {'slowdown':>9s}")
        for model in models:
            for label, threads, env in settings():
                idle = measure(model, threads, env, args.steps, args.seconds)
                competitor = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
                try:
                    time.sleep(0.5)  # let the scheduler see it
                    busy = measure(model, threads, env, args.steps, args.seconds)
                finally:
                    competitor.kill()
                    competitor.wait()
                print(f"{Path(model).name:18s} {label:42s} {idle:10.1f} {busy:10.1f} {idle / busy:8.1f}x", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        path, threads, steps, seconds = sys.argv[2:6]
        print(json.dumps(decode_speed(path, int(threads), int(steps), float(seconds))))
    else:
        main()
