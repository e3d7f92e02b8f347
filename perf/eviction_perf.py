#!/usr/bin/env python3
"""Decode speed with budgeted eviction vs full KV, side by side in one run, on a tiny model.

For each policy and budget (64, 256, 512): tokens/s over a 2,000-token generation of 4
candidates decoded together, the share of wall time spent choosing and evicting (reading
scores, keys and the cell map, scoring, seq_rm), of it in per-head compaction (llama_kvr_compact), the
most cells one sequence held (against budget + buffer), and the resident KV bytes at the end vs full KV.
With --cache-types (llama.cpp's -ctk/-ctv names, TYPE or K/V), each policy and budget runs at every cache type
in turn and prints its speed as a ratio to the first type's (f16 first by default); a quantized V needs flash
attention, so then every run of the script, full KV included, has it on (--flash-attn overrides).

Only the package's public budget API is used, so another version of it can be timed by the same
script: `PYTHONPATH=<checkout of that version> python3 perf/eviction_perf.py ...` (the README's
old-vs-new rkv line compares the last-layer redundancy of commit 4e1596c with the all-layer one).

Usage: PYTHONPATH=. python3 perf/eviction_perf.py [--tokens 2000] [--model PATH.gguf]
                                                   [--policies rkv,snapkv] [--budgets 64,256]
                                                   [--cache-types f16,q8_0,q4_0] [--flash-attn on|off]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from kvrescue_local.eviction import POLICIES, BudgetedSequences, KVBudget
from kvrescue_local.gguf_export import TINY_BASE, write_tiny_model
from kvrescue_local.bench.run import cache_types
from kvrescue_local.runtime import Context, ContextParams, Model
from kvrescue_local.runtime.context import CACHE_TYPES, kv_bytes_per_cell

N_SEQ = 4


def generate(model: Model, prompt: np.ndarray, tokens: int, budget: KVBudget | None, n_seq: int = N_SEQ,
             cache: str = "f16", flash_attn: str = "off") -> tuple[float, float, int, BudgetedSequences | None]:
    """(seconds in total, seconds in eviction, cells resident at the end summed over sequences, the budget)."""
    n_ctx = budget.context_cells(n_seq, 512) if budget else n_seq * (len(prompt) + tokens) + 512
    type_k, type_v = cache_types(cache)
    ctx = Context(model, ContextParams(n_ctx=n_ctx, n_seq_max=n_seq, flash_attn=flash_attn, type_k=type_k,
                                       type_v=type_v))
    seqs = BudgetedSequences(ctx, budget) if budget else None
    ctx.prefill(0, prompt)
    for s in range(1, n_seq):
        seqs.fork(0, s) if seqs else ctx.fork(0, s)
    ids = np.arange(n_seq, dtype=np.int32)
    next_tokens = np.full(n_seq, ord("x"), np.int32)
    evicting = 0.0
    started = time.perf_counter()
    for _ in range(tokens):
        ctx.step(ids, next_tokens)
        next_tokens = np.array([int(np.argmax(ctx.logits(i))) for i in range(n_seq)], np.int32)
        if seqs:
            t0 = time.perf_counter()
            for s in range(n_seq):
                seqs.enforce(s)
            evicting += time.perf_counter() - t0
    total = time.perf_counter() - started
    return total, evicting, sum(ctx.n_cells(s) for s in range(n_seq)), seqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--policies", default=",".join(sorted(POLICIES)))
    parser.add_argument("--budgets", default="64,256,512")
    parser.add_argument("--cache-types", default="f16", help="comma-separated KV cache types, TYPE or K/V; the first "
                                                             "is the one the others are compared with")
    parser.add_argument("--flash-attn", choices=["on", "off"],
                        help="[default: on when a cache type quantizes V (llama.cpp needs it), else off]")
    args = parser.parse_args()
    caches = args.cache_types.split(",")
    flash_attn = args.flash_attn or ("on" if any(CACHE_TYPES[cache_types(c)[1]].quantized for c in caches) else "off")
    with tempfile.TemporaryDirectory() as tmp:
        model = Model(args.model or write_tiny_model(Path(tmp) / "tiny.gguf", TINY_BASE, seed=0))
        prompt = model.tokenize("<|im_start|>user\nLedger: a=17 b=42 c=5 d=93. Compute a+d-c.<|im_end|>\n")
        per_cell = {c: kv_bytes_per_cell(model, *cache_types(c)) for c in caches}
        total, _, cells, _ = generate(model, prompt, args.tokens, None, cache=caches[0], flash_attn=flash_attn)
        full_rate = N_SEQ * args.tokens / total
        print(f"{N_SEQ} sequences x {args.tokens} tokens on {model.describe()}; flash attention {flash_attn}; KV "
              + ", ".join(f"{c} {b} B/cell" for c, b in per_cell.items()))
        print(f"  full KV {caches[0]:10s} : {full_rate:8.0f} tokens/s, resident "
              f"{cells * per_cell[caches[0]] / 2**20:7.2f} MiB (cells counted per sequence)")
        for policy in args.policies.split(","):
            for b in map(int, args.budgets.split(",")):
                budget = KVBudget(budget=b, policy=policy)
                first_rate = None
                for cache in caches:  # side by side: every cache type of this policy and budget in turn
                    total, evicting, cells, seqs = generate(model, prompt, args.tokens, budget, cache=cache,
                                                            flash_attn=flash_attn)
                    rate = N_SEQ * args.tokens / total
                    first_rate = first_rate or rate
                    versus = f", {rate / first_rate:4.2f}x {caches[0]}" if len(caches) > 1 else ""
                    print(f"  {policy:16s} B={b:<4d} {cache:8s}: {rate:8.0f} tokens/s ({rate / full_rate:4.2f}x full"
                          f"{versus}), eviction {100 * evicting / total:5.1f}% of time (compaction "
                          f"{100 * seqs.compaction_seconds / total:4.2f}%), most cells a sequence held "
                          f"{max(seqs.peak_cells.values())} (limit {budget.limit}), resident "
                          f"{cells * per_cell[cache] / 2**20:7.2f} MiB")


if __name__ == "__main__":
    main()
