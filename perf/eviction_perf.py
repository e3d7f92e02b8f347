#!/usr/bin/env python3
"""Decode speed with budgeted eviction vs full KV, side by side in one run, on a tiny model.

For each policy and budget (64, 256, 512): tokens/s over a 2,000-token generation of 4
candidates decoded together, the share of wall time spent choosing and evicting (reading
scores, keys and the cell map, scoring, seq_rm), of it in per-head compaction (llama_kvr_compact), the
most cells one sequence held (against budget + buffer), and the resident KV bytes at the end vs full KV.
The configurations decode in turn, 25 tokens at a time, so a load that changes during the run
(shared cores) falls on all of them alike.
With --cache-types (llama.cpp's -ctk/-ctv names, TYPE or K/V), each policy and budget runs at every cache type
and prints its speed as a ratio to the first type's (f16 first by default); a quantized V needs flash
attention, so then every run of the script, full KV included, has it on (--flash-attn overrides).

Only the package's public budget API is used, so another version of it can be timed by the same
script: `PYTHONPATH=<checkout of that version> python3 perf/eviction_perf.py ...` (the README's
old-vs-new rkv line compares the last-layer redundancy of commit 4e1596c with the all-layer one).

Usage: PYTHONPATH=. python3 perf/eviction_perf.py [--tokens 2000] [--model PATH.gguf]
                                                   [--policies rkv,snapkv] [--budgets 64,256]
                                                   [--cache-types f16,q8_0,q4_0] [--flash-attn on|off]
                                                   [--n-gpu-layers N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from kvrescue_local.bench.run import cache_types
from kvrescue_local.eviction import POLICIES, BudgetedSequences, KVBudget
from kvrescue_local.gguf_export import TINY_BASE, write_tiny_model
from kvrescue_local.runtime import Context, ContextParams, Model
from kvrescue_local.runtime.context import CACHE_TYPES, kv_bytes_per_cell

N_SEQ = 4


class Decode:
    """One configuration's greedy decode of n_seq sequences after the prompt (full KV when budget is None),
    advanced a chunk of tokens at a time so that every configuration runs interleaved with the others:
    a load that changes during the run (shared cores) falls on all of them alike."""

    def __init__(self, model: Model, prompt: np.ndarray, tokens: int, budget: KVBudget | None, n_seq: int,
                 cache: str = "f16", flash_attn: str = "off") -> None:
        n_ctx = budget.context_cells(n_seq, 512) if budget else n_seq * (len(prompt) + tokens) + 512
        type_k, type_v = cache_types(cache)
        self.ctx = Context(model, ContextParams(n_ctx=n_ctx, n_seq_max=n_seq, flash_attn=flash_attn, type_k=type_k,
                                                type_v=type_v))
        self.budget, self.n_seq, self.cache = budget, n_seq, cache
        self.bytes_per_cell = kv_bytes_per_cell(model, type_k, type_v)
        self.seqs = BudgetedSequences(self.ctx, budget) if budget else None
        self.ctx.prefill(0, prompt)
        for s in range(1, n_seq):
            self.seqs.fork(0, s) if self.seqs else self.ctx.fork(0, s)
        self.ids = np.arange(n_seq, dtype=np.int32)
        self.next_tokens = np.full(n_seq, ord("x"), np.int32)
        self.seconds = self.evicting = 0.0
        self.tokens = 0

    def advance(self, steps: int) -> None:
        started = time.perf_counter()
        for _ in range(steps):
            self.ctx.step(self.ids, self.next_tokens)
            self.next_tokens = np.array([int(np.argmax(self.ctx.logits(i))) for i in range(self.n_seq)], np.int32)
            if self.seqs:
                t0 = time.perf_counter()
                for s in range(self.n_seq):
                    self.seqs.enforce(s)
                self.evicting += time.perf_counter() - t0
        self.seconds += time.perf_counter() - started
        self.tokens += steps * self.n_seq

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def resident_mib(self) -> float:
        return sum(self.ctx.n_cells(s) for s in range(self.n_seq)) * self.bytes_per_cell / 2**20


def side_by_side(model: Model, prompt: np.ndarray, tokens: int, configs: list[tuple[KVBudget | None, str]],
                 n_seq: int = N_SEQ, flash_attn: str = "off", chunk: int = 25) -> list[Decode]:
    """Every (budget, cache type) decoded `tokens` tokens, `chunk` at a time in turn."""
    runs = [Decode(model, prompt, tokens, budget, n_seq, cache, flash_attn) for budget, cache in configs]
    for done in range(0, tokens, chunk):
        for run in runs:
            run.advance(min(chunk, tokens - done))
    return runs


def print_comparison(model: Model, prompt: np.ndarray, tokens: int, policies: list[str], budgets: list[int],
                     n_seq: int = N_SEQ, caches: tuple[str, ...] = ("f16",), flash_attn: str = "off") -> None:
    """Full KV and each policy at each budget and cache type, side by side: tokens/s (against full KV at the
    first cache type, and against the first cache type at the same policy and budget), the share evicting
    (and compacting), the most cells a sequence held, the resident KV at the end."""
    configs = [(KVBudget(budget=b, policy=policy), cache) for policy in policies for b in budgets for cache in caches]
    full, *evicted = side_by_side(model, prompt, tokens, [(None, caches[0]), *configs], n_seq, flash_attn)
    print(f"{n_seq} sequences x {tokens} tokens after a {len(prompt)}-token prompt on {model.describe()}, "
          f"interleaved {len(configs) + 1} ways; flash attention {flash_attn}; KV "
          + ", ".join(f"{c} {kv_bytes_per_cell(model, *cache_types(c))} B/cell" for c in caches))
    print(f"  full KV {caches[0]:10s}       : {full.rate:8.1f} tokens/s, resident {full.resident_mib():7.2f} MiB "
          f"(cells counted per sequence)")
    first_rate: dict[tuple[str, int], float] = {}
    for (budget, cache), run in zip(configs, evicted):
        first = first_rate.setdefault((budget.policy, budget.budget), run.rate)
        versus = f", {run.rate / first:4.2f}x {caches[0]}" if len(caches) > 1 else ""
        print(f"  {budget.policy:16s} B={budget.budget:<4d} {cache:8s}: {run.rate:8.1f} tokens/s ({run.rate / full.rate:4.2f}x "
              f"full{versus}), eviction {100 * run.evicting / run.seconds:5.1f}% of time (compaction "
              f"{100 * run.seqs.compaction_seconds / run.seconds:4.2f}%), most cells a sequence held "
              f"{max(run.seqs.peak_cells.values())} (limit {budget.limit}), resident {run.resident_mib():7.2f} MiB")


def ledger_prompt(model: Model) -> np.ndarray:
    return model.tokenize("<|im_start|>user\nLedger: a=17 b=42 c=5 d=93. Compute a+d-c.<|im_end|>\n")


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
    parser.add_argument("--n-gpu-layers", "-ngl", type=int, default=0, help="layers offloaded to the GPU")
    args = parser.parse_args()
    caches = tuple(args.cache_types.split(","))
    flash_attn = args.flash_attn or ("on" if any(CACHE_TYPES[cache_types(c)[1]].quantized for c in caches) else "off")
    with tempfile.TemporaryDirectory() as tmp:
        model = Model(args.model or write_tiny_model(Path(tmp) / "tiny.gguf", TINY_BASE, seed=0),
                      n_gpu_layers=args.n_gpu_layers)
        print_comparison(model, ledger_prompt(model), args.tokens, args.policies.split(","), [int(b) for b in args.budgets.split(",")],
                         caches=caches, flash_attn=flash_attn)


if __name__ == "__main__":
    main()
