#!/usr/bin/env python3
"""Decode speed with budgeted eviction vs full KV, side by side in one run, on a tiny model.

For each policy and budget (64, 256, 512): tokens/s over a 2,000-token generation of 4
candidates decoded together, the share of wall time spent choosing and evicting (reading
scores, keys and the cell map, scoring, seq_rm), of it in per-head compaction (llama_kvr_compact), the
most cells one sequence held (against budget + buffer), and the resident KV bytes at the end vs full KV.

Only the package's public budget API is used, so another version of it can be timed by the same
script: `PYTHONPATH=<checkout of that version> python3 perf/eviction_perf.py ...` (the README's
old-vs-new rkv line compares the last-layer redundancy of commit 4e1596c with the all-layer one).

Usage: PYTHONPATH=. python3 perf/eviction_perf.py [--tokens 2000] [--model PATH.gguf]
                                                   [--policies rkv,snapkv] [--budgets 64,256] [--n-gpu-layers N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from kvrescue_local.eviction import POLICIES, BudgetedSequences, KVBudget
from kvrescue_local.gguf_export import TINY_BASE, write_tiny_model
from kvrescue_local.runtime import Context, ContextParams, Model

N_SEQ = 4


def n_embd_k_gqa_of(model: Model) -> int:
    from kvrescue_local.runtime import llama

    low = llama()
    return model.n_embd // low.llama_model_n_head(model.handle) * low.llama_model_n_head_kv(model.handle)


def generate(model: Model, prompt: np.ndarray, tokens: int, budget: KVBudget | None,
             n_seq: int = N_SEQ) -> tuple[float, float, int, BudgetedSequences | None]:
    """(seconds in total, seconds in eviction, cells resident at the end summed over sequences, the budget)."""
    n_ctx = budget.context_cells(n_seq, 512) if budget else n_seq * (len(prompt) + tokens) + 512
    ctx = Context(model, ContextParams(n_ctx=n_ctx, n_seq_max=n_seq, flash_attn="off"))
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


def ledger_prompt(model: Model) -> np.ndarray:
    return model.tokenize("<|im_start|>user\nLedger: a=17 b=42 c=5 d=93. Compute a+d-c.<|im_end|>\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--policies", default=",".join(sorted(POLICIES)))
    parser.add_argument("--budgets", default="64,256,512")
    parser.add_argument("--n-gpu-layers", "-ngl", type=int, default=0, help="layers offloaded to the GPU")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Model(args.model or write_tiny_model(Path(tmp) / "tiny.gguf", TINY_BASE, seed=0),
                      n_gpu_layers=args.n_gpu_layers)
        prompt = ledger_prompt(model)
        per_cell = 2 * 2 * model.n_layer * n_embd_k_gqa_of(model)
        total, _, cells, _ = generate(model, prompt, args.tokens, None)
        full_rate = N_SEQ * args.tokens / total
        print(f"{N_SEQ} sequences x {args.tokens} tokens on {model.describe()}; KV {per_cell} B/cell (f16)")
        print(f"  full KV            : {full_rate:8.0f} tokens/s, resident {cells * per_cell / 2**20:7.2f} MiB "
              f"(cells counted per sequence)")
        for policy in args.policies.split(","):
            for b in map(int, args.budgets.split(",")):
                budget = KVBudget(budget=b, policy=policy)
                total, evicting, cells, seqs = generate(model, prompt, args.tokens, budget)
                rate = N_SEQ * args.tokens / total
                print(f"  {policy:16s} B={b:<4d}: {rate:8.0f} tokens/s ({rate / full_rate:4.2f}x full), eviction "
                      f"{100 * evicting / total:5.1f}% of time (compaction {100 * seqs.compaction_seconds / total:4.2f}%), "
                      f"most cells a sequence held {max(seqs.peak_cells.values())} (limit {budget.limit}), "
                      f"resident {cells * per_cell / 2**20:7.2f} MiB")


if __name__ == "__main__":
    main()
