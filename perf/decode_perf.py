#!/usr/bin/env python3
"""Decode speed of the runtime layer on a tiny model, measured side by side in one run.

Prints:
  - tokens/s of 8 candidates decoded in one batch vs one llama_decode per candidate;
  - the wrapper's time per decode call vs calling llama_decode directly on a prepared batch.

Usage: python3 perf/decode_perf.py [--steps 200] [--model PATH.gguf] [--n-gpu-layers N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from kvrescue_local.gguf_export import TINY_BASE, write_tiny_model
from kvrescue_local.runtime import Context, ContextParams, Model, llama

N_CANDIDATES = 8


def candidates_context(model: Model, prompt: np.ndarray, flash_attn: str) -> Context:
    ctx = Context(model, ContextParams(n_ctx=4096, n_seq_max=N_CANDIDATES, flash_attn=flash_attn))
    ctx.prefill(0, prompt)
    for seq in range(1, N_CANDIDATES):
        ctx.fork(0, seq)
    return ctx


def timed(fn, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        fn()
    return time.perf_counter() - started


def prompt_of(model: Model) -> np.ndarray:
    return model.tokenize("<|im_start|>user\n" + "Compute a+b+c for a=1 b=2 c=3. " * 4 + "<|im_end|>\n")


def batched_and_sequential(model: Model, steps: int, flash_attn: str) -> tuple[float, float]:
    """Tokens/s of the 8 candidates decoded in one batch per step, then one llama_decode per candidate."""
    prompt = prompt_of(model)
    tokens = np.full(N_CANDIDATES, ord("x"), np.int32)
    seqs = np.arange(N_CANDIDATES, dtype=np.int32)
    batched = candidates_context(model, prompt, flash_attn)
    t_batched = timed(lambda: batched.step(seqs, tokens), steps)
    sequential = candidates_context(model, prompt, flash_attn)
    t_sequential = timed(lambda: [sequential.step(seqs[i:i + 1], tokens[i:i + 1]) for i in range(N_CANDIDATES)], steps)
    return steps * N_CANDIDATES / t_batched, steps * N_CANDIDATES / t_sequential


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", type=Path, help="a GGUF (default: a tiny random qwen2)")
    parser.add_argument("--n-gpu-layers", "-ngl", type=int, default=0, help="layers offloaded to the GPU")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Model(args.model or write_tiny_model(Path(tmp) / "tiny.gguf", TINY_BASE, seed=0),
                      n_gpu_layers=args.n_gpu_layers)
        prompt = prompt_of(model)
        tokens = np.full(N_CANDIDATES, ord("x"), np.int32)
        seqs = np.arange(N_CANDIDATES, dtype=np.int32)

        print(f"{N_CANDIDATES} candidates x {args.steps} steps on {model.describe()}")
        for flash_attn in ("off", "on"):
            batched, sequential = batched_and_sequential(model, args.steps, flash_attn)
            print(f"  flash attention {flash_attn:3}: batched {batched:8.0f} tokens/s, sequential "
                  f"{sequential:8.0f} tokens/s, speed-up {batched / sequential:.2f}x (goal >= 3x)")

        # The same 8-token batch through the wrapper and through llama_decode directly.
        wrapped = candidates_context(model, prompt, "off")
        raw = candidates_context(model, prompt, "off")
        low = llama()
        raw_batch = raw.batch
        raw_batch.fill(tokens, np.zeros(N_CANDIDATES, np.int32), seqs, np.ones(N_CANDIDATES, np.int8))

        def raw_step() -> None:
            raw_batch.pos[:N_CANDIDATES] += 1
            assert low.llama_decode(raw.handle, raw_batch.struct) == 0

        raw_batch.pos[:N_CANDIDATES] = raw.pos_max(0)
        t_raw, t_wrapped = 0.0, 0.0
        for _ in range(5):  # interleave rounds so drift affects both alike
            t_raw += timed(raw_step, args.steps // 5)
            t_wrapped += timed(lambda: wrapped.step(seqs, tokens), args.steps // 5)
        calls = 5 * (args.steps // 5)
        print(f"  llama_decode direct : {1e6 * t_raw / calls:8.1f} us/call")
        print(f"  Context.step        : {1e6 * t_wrapped / calls:8.1f} us/call")
        print(f"  wrapper overhead: {100 * (t_wrapped - t_raw) / t_raw:+.1f}% (goal <= 10%)")


if __name__ == "__main__":
    main()
