#!/usr/bin/env python3
"""Kept-set overlap of the `rkv` policy with R-KV's own per-(layer, KV head) selection.

R-KV (github Zefan-Cai/R-KV) keeps a different set of entries in every layer and KV head. On keys and
attention captured from a real model at the moment R-KV would compress (budget + buffer entries), this
prints the mean share of each (layer, head)'s own choice outside the recent window that a choice keeps:

- rkv, per head: the default policy as it runs (the patch's per-KV-head scores, each head its own top);
- rkv: heads=shared as it runs (per-(layer, head) scores from the patch's per-layer attention, one set
  by votes);
- mean score: the same per-(layer, head) scores averaged, then the top entries;
- rkv, last layer: the policy's votes over the last layer's heads only (the cheaper subset);
- best token-level: the top of the votes of the reference's own choices (no single set does better).

The reference sees what R-KV computes: the logits of the window queries (`kq-<il>`, captured through
cb_eval), max-pooled over each KV head's query group, softmaxed over the keys before the window and
averaged over the window. The policy sees what it sees in a run: the patch's per-layer scores. Also
prints the policy's scoring time per eviction (all layers vs the last layer).

Usage: python3 perf/rkv_overlap.py [--model PATH.gguf] [--budgets 64,256] [--buffer 128] [--texts 3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from kvrescue_local.eviction import EvictionInputs, KVBudget, reference
from kvrescue_local.eviction.budget import choose_per_head
from kvrescue_local.presets import MODELS_CACHE
from kvrescue_local.wheels import WHEEL_MODELS, cached_path
from kvrescue_local.eviction.rkv import RKVPolicy
from kvrescue_local.rescue.config import QWEN_MATH_COT
from kvrescue_local.runtime import Context, ContextParams, Model
from kvrescue_local.runtime.attention import (GraphCapture, cell_scores, enable_scores, head_scores, key_rows,
                                              n_head_kv, observe_scores, reset_scores)

ROOT = Path(__file__).resolve().parent.parent
MODELS = (cached_path(WHEEL_MODELS["coder-1.5b"], MODELS_CACHE), ROOT / "models" / "toy" / "base.gguf")
DATA = ROOT / "kvrescue_local" / "bench" / "data" / "math500.jsonl"


def greedy_tokens(model: Model, prompt: str, n: int) -> np.ndarray:
    tokens = list(model.tokenize(prompt)[:n])
    ctx = Context(model, ContextParams(n_ctx=n + 64, flash_attn="off"))
    row = ctx.prefill(0, tokens)
    while len(tokens) < n:
        tokens.append(int(np.argmax(ctx.logits(row))))
        ctx.step([0], [tokens[-1]])
        row = 0
    return np.array(tokens[:n], np.int32)


def capture(model: Model, tokens: np.ndarray, window: int) -> dict:
    """Keys, the patch's per-layer window attention and R-KV's per-head window attention after `tokens`."""
    graph = GraphCapture(prefixes=("kq-",))
    ctx = graph.context(model, ContextParams(n_ctx=len(tokens) + 64, type_k="f32", type_v="f32", flash_attn="off"))
    enable_scores(ctx, window)
    graph.enabled = False
    ctx.prefill(0, tokens[:-window])
    reset_scores(ctx, 0)
    graph.enabled = True
    ctx.prefill(0, tokens[-window:])
    if graph.skipped:
        raise SystemExit(f"the logits {sorted(graph.skipped)} came out non-contiguous: this bench needs the CPU backend")
    cells, positions = ctx.cells(0)
    layers = range(model.n_layer)
    rows = np.stack([key_rows(ctx, layer, cells) for layer in layers])
    heads = n_head_kv(ctx)
    keys = rows.reshape(len(layers), len(cells), heads, -1).transpose(0, 2, 1, 3)
    scale = 1.0 / np.sqrt(keys.shape[-1])
    theirs = np.stack([reference.window_attention(graph.tensors[f"kq-{layer}"][:, :, cells] * scale, heads, window)
                       for layer in layers])
    ours = np.stack([cell_scores(ctx, 0, layer)[cells] for layer in layers]).astype(np.float64)
    return {"positions": positions, "keys": keys, "patch_attention": ours, "reference_attention": theirs,
            "patch_head_attention": per_head_attention(model, tokens, window)}


def per_head_attention(model: Model, tokens: np.ndarray, window: int) -> np.ndarray:
    """[n_layer, n_head_kv, n]: the patch's per-KV-head window attention, as a per-head eviction reads it."""
    ctx = Context(model, ContextParams(n_ctx=len(tokens) + 64, type_k="f32", type_v="f32", flash_attn="off"))
    enable_scores(ctx, window, per_head=True)
    observe_scores(ctx, 0, False)
    ctx.prefill(0, tokens[:-window])
    observe_scores(ctx, 0, True)
    ctx.prefill(0, tokens[-window:])
    cells, _ = ctx.cells(0)
    return np.stack([head_scores(ctx, 0, layer)[:, cells] for layer in range(model.n_layer)]).astype(np.float64)


def top(scores: np.ndarray, forced: np.ndarray, n_choose: int) -> np.ndarray:
    free = np.flatnonzero(~forced)
    kept = forced.copy()
    kept[free[np.argsort(-scores[free], kind="stable")[:n_choose]]] = True
    return kept


def choices(captured: dict, budget: KVBudget) -> dict[str, tuple[np.ndarray, float]]:
    """Token-level kept sets (with the policy's scoring seconds where it applies)."""
    positions, keys = captured["positions"], captured["keys"]
    forced = budget.forced(positions, 0)
    n_choose = budget.budget - int(forced.sum())
    policy = RKVPolicy()
    out = {}
    for name, layers in (("rkv", slice(None)), ("rkv, last layer", slice(-1, None))):
        inputs = EvictionInputs(positions, forced, n_choose, window_attention=captured["patch_attention"][layers],
                                keys=keys[layers])
        started = time.perf_counter()
        scores = policy.score(inputs)
        out[name] = (budget.keep(positions, scores, 0), time.perf_counter() - started)
    inputs = EvictionInputs(positions, forced, n_choose, window_attention=captured["patch_attention"], keys=keys)
    mean_score = np.zeros(len(positions))
    mean_score[~forced] = policy.head_scores(inputs).mean(axis=(0, 1))
    out["mean score"] = (top(mean_score, forced, n_choose), 0.0)
    inputs = EvictionInputs(positions, forced, n_choose, window_attention=captured["patch_head_attention"], keys=keys)
    started = time.perf_counter()
    scores = policy.head_scores(inputs)
    out["rkv, per head"] = (choose_per_head(scores, forced, n_choose), time.perf_counter() - started)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=next((m for m in MODELS if m.exists()), MODELS[-1]))
    parser.add_argument("--budgets", default="64,256")
    parser.add_argument("--buffer", type=int, default=128)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--texts", type=int, default=3, help="MATH500 problems, greedy-solved by the model")
    args = parser.parse_args()
    model = Model(args.model)
    budgets = [KVBudget(budget=int(b), buffer=args.buffer, window=args.window) for b in args.budgets.split(",")]
    problems = [json.loads(line)["problem"] for line in DATA.read_text().splitlines()[: args.texts]]
    print(f"{model.describe()}; {args.texts} MATH500 problems, greedy; window {args.window}, buffer {args.buffer}")
    texts = [greedy_tokens(model, QWEN_MATH_COT.format(problem=p), max(b.limit for b in budgets)) for p in problems]
    for budget in budgets:
        shares: dict[str, list[float]] = {}
        seconds: dict[str, list[float]] = {}
        for tokens in texts:
            captured = capture(model, tokens[: budget.limit], budget.window)
            per_head = reference.select(captured["keys"], captured["reference_attention"], budget.budget,
                                        budget.window)
            forced = budget.forced(captured["positions"], 0)
            best = top(per_head.sum(axis=(0, 1)).astype(np.float64), forced, budget.budget - int(forced.sum()))
            for name, (kept, spent) in {**choices(captured, budget), "best token-level": (best, 0.0)}.items():
                shares.setdefault(name, []).append(reference.overlap(kept, per_head, budget.window))
                seconds.setdefault(name, []).append(spent)
        print(f"B={budget.budget} (compressing {budget.limit} entries): share of each (layer, head)'s choice kept")
        for name, values in shares.items():
            cost = f", scoring {1000 * np.mean(seconds[name]):6.1f} ms" if np.mean(seconds[name]) else ""
            print(f"  {name:18s}: {100 * np.mean(values):5.1f}% (min {100 * np.min(values):5.1f}%){cost}")

if __name__ == "__main__":
    main()
