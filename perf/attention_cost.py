#!/usr/bin/env python3
"""What the patch's attention scores cost per decoded token, by problems at once, side by side in one run.

K problems, each a prefix of --prefix tokens forked into N candidates, all decoded together in one
unified context (as the engine runs them); per token, microseconds of:
  - no scores (the accumulator off),
  - every sequence observed (H2O, and every step of the first version of the patch),
  - scores on but no sequence observed (a window policy between its windows: with buffer 128 and
    window 8 that is 15 steps in 16),
and the cost of a window policy's steady state: (window * all + (buffer - window) * none) / buffer; beside them,
no scores with llama.cpp's per-sequence KV streams (kv_unified=false, which the patch's scores refuse), where a
row attends over its own stream only. CPU microseconds of this process (shared cores slow the wall clock).

Usage: python3 perf/attention_cost.py [--ks 1,8] [-n 8] [--prefix 300] [--steps 40] [--repeats 3] [--model PATH.gguf]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from kvrescue_local.presets import load_preset
from kvrescue_local.runtime import Context, ContextParams, Model
from kvrescue_local.runtime.attention import enable_scores, observe_scores

SETTINGS = ("off", "all", "none")


def microseconds_per_token(model: Model, k: int, n: int, prefix: int, steps: int, scores: str, window: int,
                           flash_attn: str = "off", streams: bool = False) -> float:
    """CPU time of this process per decoded token (llama.cpp's threads run in it; on shared cores wall time counts
    the neighbours too). streams: llama.cpp's per-sequence KV streams (kv_unified=false, cells for a prefix and the steps each)."""
    n_seq = k * (n + 1)
    stream = 256 * -(-(prefix + steps + 2) // 256)  # a stream holds its sequence's prefix and decoded tokens
    n_ctx = n_seq * stream if streams else k * (prefix + n * (steps + 2)) + 256
    ctx = Context(model, ContextParams(n_ctx=n_ctx, n_seq_max=n_seq, flash_attn=flash_attn, kv_unified=not streams))
    if scores != "off":
        enable_scores(ctx, window)
        observe_scores(ctx, -1, scores == "all")
    rng = np.random.default_rng(0)
    for problem in range(k):
        committed = problem * (n + 1)
        ctx.prefill(committed, rng.integers(100, 200, prefix).astype(np.int32))
        for j in range(1, n + 1):
            ctx.fork(committed, committed + j)
    seqs = np.array([p * (n + 1) + j for p in range(k) for j in range(1, n + 1)], np.int32)
    tokens = np.full(len(seqs), 120, np.int32)
    ctx.step(seqs, tokens)  # the first decode of this shape builds its graph
    started = time.process_time()
    for _ in range(steps):
        ctx.step(seqs, tokens)
    elapsed = time.process_time() - started
    ctx.free()
    return 1e6 * elapsed / (steps * len(seqs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="1,8", help="problems at once")
    parser.add_argument("-n", type=int, default=8, help="candidates per problem")
    parser.add_argument("--prefix", type=int, default=300)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--buffer", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path, help="a GGUF [default: the toy base]")
    parser.add_argument("--flash-attn", choices=("off", "on"), default="off")
    args = parser.parse_args()
    model = Model(args.model or load_preset("toy").base)
    print(f"{model.describe()}: N={args.n} candidates per problem, {args.prefix}-token prefixes, {args.steps} steps, "
          f"flash attention {args.flash_attn}")
    print(f"{'K':>3s} {'no scores':>10s} {'all observed':>13s} {'none observed':>14s} {'window policy':>14s} "
          f"{'streams':>8s}  us/token")
    for k in [int(x) for x in args.ks.split(",")]:
        # the best of interleaved repeats: other processes on the cores slow single runs, not all of them
        runs = [(s, microseconds_per_token(model, k, args.n, args.prefix, args.steps, "off" if s == "streams" else s,
                                          args.window, args.flash_attn, streams=s == "streams"))
                for _ in range(args.repeats) for s in (*SETTINGS, "streams")]
        cost = {s: min(t for name, t in runs if name == s) for s in (*SETTINGS, "streams")}
        windowed = (args.window * cost["all"] + (args.buffer - args.window) * cost["none"]) / args.buffer
        print(f"{k:3d} {cost['off']:10.1f} {cost['all']:13.1f} {cost['none']:14.1f} {windowed:14.1f} "
              f"{cost['streams']:8.1f}   (scores add {cost['all'] / cost['off'] - 1:+.0%} all observed, "
              f"{windowed / cost['off'] - 1:+.0%} windowed)")


if __name__ == "__main__":
    main()
