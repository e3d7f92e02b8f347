#!/usr/bin/env python3
"""Decode speed with budgeted eviction vs full KV, side by side in one run, on a tiny model.

For each policy and budget (64, 256, 512): tokens/s over a 2,000-token generation of 4
candidates decoded together, the share of wall time spent choosing and evicting (reading
scores, keys and the cell map, scoring, seq_rm), of it in per-head compaction (llama_kvr_compact), the
most cells one sequence held (against budget + buffer), and the resident KV bytes at the end vs full KV.
The configurations decode in turn, 25 tokens at a time, so a load that changes during the run
(shared cores) falls on all of them alike.

Only the package's public budget API is used, so another version of it can be timed by the same
script: `PYTHONPATH=<checkout of that version> python3 perf/eviction_perf.py ...` (the README's
old-vs-new rkv line compares the last-layer redundancy of commit 4e1596c with the all-layer one).

Usage: PYTHONPATH=. python3 perf/eviction_perf.py [--tokens 2000] [--model PATH.gguf]
                                                   [--policies rkv,snapkv] [--budgets 64,256]
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


class Decode:
    """One configuration's greedy decode of n_seq sequences after the prompt (full KV when budget is None),
    advanced a chunk of tokens at a time so that every configuration runs interleaved with the others:
    a load that changes during the run (shared cores) falls on all of them alike."""

    def __init__(self, model: Model, prompt: np.ndarray, tokens: int, budget: KVBudget | None, n_seq: int) -> None:
        n_ctx = budget.context_cells(n_seq, 512) if budget else n_seq * (len(prompt) + tokens) + 512
        self.ctx = Context(model, ContextParams(n_ctx=n_ctx, n_seq_max=n_seq, flash_attn="off"))
        self.budget, self.n_seq = budget, n_seq
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

    def resident_cells(self) -> int:
        return sum(self.ctx.n_cells(s) for s in range(self.n_seq))


def side_by_side(model: Model, prompt: np.ndarray, tokens: int, budgets: list[KVBudget | None], n_seq: int = N_SEQ,
                 chunk: int = 25) -> list[Decode]:
    """Every configuration decoded `tokens` tokens, `chunk` at a time in turn."""
    runs = [Decode(model, prompt, tokens, budget, n_seq) for budget in budgets]
    for done in range(0, tokens, chunk):
        for run in runs:
            run.advance(min(chunk, tokens - done))
    return runs


def print_comparison(model: Model, prompt: np.ndarray, tokens: int, policies: list[str], budgets: list[int],
                     n_seq: int = N_SEQ) -> None:
    """Full KV and each policy at each budget, side by side: tokens/s, the share evicting (and compacting),
    the most cells a sequence held, the resident KV at the end."""
    per_cell = 2 * 2 * model.n_layer * n_embd_k_gqa_of(model)  # K and V, f16
    configs = [KVBudget(budget=b, policy=policy) for policy in policies for b in budgets]
    full, *evicted = side_by_side(model, prompt, tokens, [None, *configs], n_seq)
    print(f"{n_seq} sequences x {tokens} tokens after a {len(prompt)}-token prompt on {model.describe()}, "
          f"interleaved {len(configs) + 1} ways; KV {per_cell} B/cell (f16)")
    print(f"  full KV            : {full.rate:8.1f} tokens/s, resident {full.resident_cells() * per_cell / 2**20:7.2f} MiB "
          f"(cells counted per sequence)")
    for budget, run in zip(configs, evicted):
        print(f"  {budget.policy:16s} B={budget.budget:<4d}: {run.rate:8.1f} tokens/s ({run.rate / full.rate:4.2f}x full), "
              f"eviction {100 * run.evicting / run.seconds:5.1f}% of time (compaction "
              f"{100 * run.seqs.compaction_seconds / run.seconds:4.2f}%), most cells a sequence held "
              f"{max(run.seqs.peak_cells.values())} (limit {budget.limit}), resident "
              f"{run.resident_cells() * per_cell / 2**20:7.2f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--policies", default=",".join(sorted(POLICIES)))
    parser.add_argument("--budgets", default="64,256,512")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Model(args.model or write_tiny_model(Path(tmp) / "tiny.gguf", TINY_BASE, seed=0))
        prompt = model.tokenize("<|im_start|>user\nLedger: a=17 b=42 c=5 d=93. Compute a+d-c.<|im_end|>\n")
        print_comparison(model, prompt, args.tokens, args.policies.split(","), [int(b) for b in args.budgets.split(",")])


if __name__ == "__main__":
    main()
