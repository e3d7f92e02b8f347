#!/usr/bin/env python3
"""Real-shape performance on the Qwen2.5-Coder pair, every number a ratio measured side by side in one run.

  1. eviction overhead: tokens/s of N sequences decoded together with each policy at each budget vs full
     KV, the share of time spent choosing and evicting, and the resident KV bytes at the end;
  2. batching: 8 candidates decoded in one llama_decode per token vs one call per candidate;
  3. the share of `solve` wall time outside llama.cpp and the PRM, per mode, on a GSM8K problem.

Usage (the defaults are the target sizes: 1,000 tokens, N = 4 and 8, every policy; pass smaller ones on a busy machine):
  KVRESCUE_THREADS=1 python3 perf/real_perf.py [--tokens 1000] [--sequences 4,8] [--budgets 64,256]
      [--policies rkv,snapkv,h2o,streaming] [--batch-steps 64] [--solve-tokens 256] [--prm PRM.gguf]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from decode_perf import N_CANDIDATES, candidates_context, timed
from eviction_perf import print_comparison
from kvrescue_local.bench.datasets import load_dataset
from kvrescue_local.eviction import KVBudget
from kvrescue_local.presets import MODELS_CACHE
from kvrescue_local.prm import PRM, PRMParams
from kvrescue_local.rescue import Rescue, RescueConfig, longest_prompt
from kvrescue_local.runtime import Model

GGUF = MODELS_CACHE  # `kvrescue-local models pull coder` puts the pair here


def eviction_overhead(model: Model, prompt: np.ndarray, args) -> None:
    print("1. eviction vs full KV")
    for n_seq in args.sequences:
        print_comparison(model, prompt, args.tokens, args.policies, args.budgets, n_seq)


def batching(model: Model, prompt: np.ndarray, steps: int) -> None:
    tokens = np.full(N_CANDIDATES, int(prompt[-1]), np.int32)
    seqs = np.arange(N_CANDIDATES, dtype=np.int32)
    batched = candidates_context(model, prompt, "off")
    t_batched = timed(lambda: batched.step(seqs, tokens), steps)
    sequential = candidates_context(model, prompt, "off")
    t_sequential = timed(lambda: [sequential.step(seqs[i:i + 1], tokens[i:i + 1]) for i in range(N_CANDIDATES)], steps)
    n = steps * N_CANDIDATES
    print(f"2. {N_CANDIDATES} candidates x {steps} tokens: batched {n / t_batched:.1f} tokens/s, sequential "
          f"{n / t_sequential:.1f} tokens/s, batched is {t_sequential / t_batched:.2f}x faster")


def solve_overhead(base: Model, helper: Model, prm_path: Path | None, max_tokens: int) -> None:
    problem = load_dataset("gsm8k", limit=1).problems[0].problem
    common = dict(n=1, max_tokens=max_tokens, max_step_tokens=128, kv=KVBudget(budget=64, buffer=128))
    configs = [RescueConfig(mode=m, **common) for m in ("full", "bon", "helper")]
    prm = None
    if prm_path:
        prm = PRM(prm_path, PRMParams(n_ctx=4096, max_candidates=4, flash_attn="off"))
        configs.append(RescueConfig(mode="kvrescue", **{**common, "n": 2}))
    print(f"3. solve on GSM8K problem 0, at most {max_tokens} tokens: share of wall time outside llama.cpp and the PRM")
    for config in configs:
        engine = Rescue(config, base, helper, prm, prompt_tokens_max=longest_prompt(config, [base, helper], [problem]))
        t = engine.solve(problem).timings
        print(f"  {config.mode:8s} N={config.n}: {t['total']:6.1f} s, PRM {100 * t['prm'] / t['total']:4.1f}%, "
              f"outside {100 * t['orchestration'] / t['total']:4.1f}% (goal <= 5%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=GGUF / "coder-1.5b.gguf")
    parser.add_argument("--helper", type=Path, default=GGUF / "coder-0.5b.gguf")
    parser.add_argument("--prm", type=Path, help="a PRM backbone GGUF, to time kvrescue mode as well")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--sequences", default="4,8")
    parser.add_argument("--budgets", default="64,256")
    parser.add_argument("--policies", default="rkv,snapkv,h2o,streaming")
    parser.add_argument("--batch-steps", type=int, default=64)
    parser.add_argument("--solve-tokens", type=int, default=256)
    parser.add_argument("--only", default="1,2,3", help="which measurements to run")
    args = parser.parse_args()
    args.sequences = [int(x) for x in args.sequences.split(",")]
    args.budgets = [int(x) for x in args.budgets.split(",")]
    args.policies = args.policies.split(",")
    base = Model(args.base)
    print(f"base {base.describe()}")
    problem = load_dataset("gsm8k", limit=1).problems[0].problem
    prompt = base.tokenize(RescueConfig().prompt.format(problem=problem))
    only = args.only.split(",")
    if "1" in only:
        eviction_overhead(base, prompt, args)
    if "2" in only:
        batching(base, prompt, args.batch_steps)
    if "3" in only:
        solve_overhead(base, Model(args.helper), args.prm, args.solve_tokens)


if __name__ == "__main__":
    main()
