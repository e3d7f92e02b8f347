#!/usr/bin/env python3
"""The helper's weight type: how much the context's layout moves its final hidden state, and what it costs in speed.

For each GGUF (default: the pulled Q4_K_M 0.5B and the F16 copy the coder preset's helper runs at), two parts,
measured side by side in one run:

  1. layout: recorded KV-Rescue rounds (their committed steps and distinct survivors) replayed as the judge reads
     them: each survivor decoded alone on the committed prefix, the prefix written in one of three ways (in batches;
     one token a decode, as sampled steps are written; in batches after another problem's prompt). Printed: the
     relative change of the hidden state and of the head's score against the batched layout, and the rounds whose
     favourite differs. The same layout twice must give 0 (llama.cpp is deterministic for one layout).
  2. speed: a 300-token prefill, 4 sequences decoded together for 32 steps, and 40-token candidates decoded
     alone on a forked prefix, in tokens/s, the files interleaved over 3 repetitions.

Usage: KVRESCUE_THREADS=1 python3 perf/helper_weights.py [--models A.gguf,B.gguf] [--results FILE] [--rounds 8]
           [--config kvrescue-b64-n4-rkv:heads=shared] [--head FILE] [--cache-type f16]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from prm_layout import OTHER_PROBLEM, rounds
from kvrescue_local.compose import preset_config
from kvrescue_local.paths import SHIPPED_MODELS
from kvrescue_local.presets import CODER_MODELS, MODELS_CACHE, coder_helper, load_preset
from kvrescue_local.prm import RewardHead, prm_format
from kvrescue_local.runtime import Context, ContextParams, Model

LAYOUTS = {"one token a decode": (False, True), "after another problem": (True, False), "batched again": (False, False)}


def layout_part(model: Model, args, prompt_template: str, head: RewardHead) -> None:
    fmt = prm_format("helper-value")
    ctx = Context(model, ContextParams(n_ctx=8192, n_seq_max=3, type_k=args.cache_type, type_v=args.cache_type))

    def hidden(problem: str, committed: list[str], survivors: list[str], other: bool, stepped: bool) -> np.ndarray:
        for seq in range(3):
            ctx.drop(seq)
        if other:
            ctx.prefill(1, model.tokenize(prompt_template.format(problem=OTHER_PROBLEM)))
        ctx.prefill(0, model.tokenize(prompt_template.format(problem=problem)))
        for text in committed:
            tokens = model.tokenize(text, special=False)
            if stepped:
                for token in tokens:
                    ctx.step([0], [int(token)])
            else:
                ctx.prefill(0, tokens)
        rows = []
        with ctx.hidden_states():
            for text in survivors:
                ctx.fork(0, 2)
                rows.append(ctx.embedding(ctx.prefill(2, fmt.step_tokens(model, text))))
                ctx.drop(2)
        return np.array(rows)

    tally = {name: ([], [], 0) for name in LAYOUTS}
    seen = 0
    for problem, committed, survivors, _ in rounds(args.results, args.config):
        if seen == args.rounds:
            break
        seen += 1
        batched = hidden(problem, committed, survivors, False, False)
        scores = head.rewards(batched)
        for name, (other, stepped) in LAYOUTS.items():
            moved = hidden(problem, committed, survivors, other, stepped)
            relative, differences, flips = tally[name]
            relative.extend((np.linalg.norm(moved - batched, axis=1) / np.linalg.norm(batched, axis=1)).tolist())
            differences.extend(np.abs(head.rewards(moved) - scores).tolist())
            tally[name] = (relative, differences, flips + int(np.argmax(head.rewards(moved)) != np.argmax(scores)))
    print(f"{model.path.name}, KV {args.cache_type}: {seen} rounds, against the prefix written in batches")
    for name, (relative, differences, flips) in tally.items():
        print(f"  {name:22s}: hidden state moves {np.mean(relative):.2e} (mean, relative), score "
              f"{np.mean(differences):.5f} mean / {np.max(differences):.5f} max; favourite differs in {flips} of {seen}")


def speed_part(models: list[Model]) -> None:
    contexts = {m.path.name: Context(m, ContextParams(n_ctx=4096, n_seq_max=6, n_threads=0)) for m in models}
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 20000, 300).astype(np.int32)
    seconds = {name: np.zeros(3) for name in contexts}
    for _ in range(3):
        for name, ctx in contexts.items():
            for seq in range(6):
                ctx.drop(seq)
            started = time.perf_counter()
            ctx.prefill(0, prompt)
            prefilled = time.perf_counter()
            for seq in (1, 2, 3, 4):
                ctx.fork(0, seq)
            for _ in range(32):
                ctx.step([1, 2, 3, 4], rng.integers(100, 20000, 4))
            stepped = time.perf_counter()
            for _ in range(4):
                ctx.fork(0, 5)
                ctx.prefill(5, rng.integers(100, 20000, 40).astype(np.int32))
                ctx.drop(5)
            seconds[name] += np.array([prefilled - started, stepped - prefilled, time.perf_counter() - stepped])
    tokens = np.array([3 * 300, 3 * 32 * 4, 3 * 4 * 40])
    first = tokens / next(iter(seconds.values()))
    for name, spent in seconds.items():
        rates = tokens / spent
        ratios = rates / first
        print(f"{name:32s} prefill {rates[0]:6.0f} tok/s ({ratios[0]:.2f}x), 4 sequences {rates[1]:5.1f} tok/s "
              f"({ratios[1]:.2f}x), candidates alone {rates[2]:6.0f} tok/s ({ratios[2]:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated GGUFs [default: the pulled 0.5B and the helper's F16 copy]")
    parser.add_argument("--results", default="results/coder-gsm8k-table2.jsonl.zst", help="KV-Rescue rows to replay")
    parser.add_argument("--config", default="kvrescue-b64-n4-rkv:heads=shared", help="the rows' config_key")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--cache-type", default="f16", help="the KV cache type of the layout part (K and V)")
    parser.add_argument("--head", default=str(SHIPPED_MODELS / "coder" / "prm.head.npz"),
                        help="the head the scores are read with (a layout test, not a quality one)")
    args = parser.parse_args()
    pulled = MODELS_CACHE / f"{CODER_MODELS[1]}.gguf"
    paths = args.models.split(",") if args.models else [pulled, coder_helper(pulled)]
    models = [Model(path) for path in paths]
    prompt_template = preset_config(load_preset("coder")).prompt
    head = RewardHead.load(args.head)
    for model in models:
        layout_part(model, args, prompt_template, head)
    speed_part(models)


if __name__ == "__main__":
    main()
