#!/usr/bin/env python3
"""Problems per minute at K problems at once vs one at a time, side by side in one run, and the engine's
share of wall time outside llama.cpp and the PRM.

Solves the same problems at each concurrency in --ks (toy preset: held-out toy problems, KV-Rescue, N = 8,
budget 64; --preset coder: GSM8K), then prints per K: problems/min from wall clock, accuracy, seconds in
llama.cpp (per model: decoding, sampling, and memory and patch calls, the last also shown alone), in the
PRM and outside both (the engine's Python; goal <= 10% at K = 16), and the ratio of the second K's
problems/min to the first's (goal >= 3x for K = 8 vs 1).

Usage: python3 perf/concurrency_perf.py [--preset toy|coder] [--problems 16] [--ks 1,8,16] [--mode kvrescue]
       [-n 8] [--budget 64] [--max-tokens T] [--prm PRM.gguf] [--flash-attn off|on|concurrent] [--n-gpu-layers N]
(the preset's PRM unless --prm names another)
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from kvrescue_local.bench.datasets import load_dataset
from kvrescue_local.compose import open_models, select_models
from kvrescue_local.rescue import Mode, Rescue, longest_prompt


@dataclasses.dataclass
class Row:
    """One concurrency's run: problems/min from wall clock, and where the wall time went."""

    k: int
    flash_attn: str
    per_minute: float
    accuracy: float
    wall: float
    llama: dict[str, float]  # seconds in llama.cpp per model
    memory: float  # of which in memory and patch calls
    prm: float
    outside: float  # seconds outside llama.cpp and the PRM: the engine's

    @property
    def outside_share(self) -> float:
        return self.outside / self.wall


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="toy")
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--ks", default="1,8,16", help="concurrencies; the ratio compares the second to the first")
    parser.add_argument("--mode", default="kvrescue")
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, help="trajectory cap [default: the preset's]")
    parser.add_argument("--prm", help="a PRM GGUF [default: the preset's]")
    parser.add_argument("--flash-attn", choices=("off", "on", "concurrent"),
                        help="concurrent: off at K = 1, on above (the faster of each on a CPU) [default: the preset's]")
    parser.add_argument("--n-gpu-layers", "-ngl", type=int, default=0, help="layers of each model offloaded to the GPU")
    return parser


def measure(args: argparse.Namespace):
    """Yield a Row per K of args.ks, each K's engine solving the same problems; prints what was set up first."""
    mode = Mode.parse(args.mode)
    options = {"preset": args.preset, "base": None, "helper": None, "prm": args.prm}
    selection = select_models(options, mode.uses_base, mode.uses_helper, needs_prm=mode.sides * args.n > 1)
    overrides = {"mode": mode, "n": args.n, "kv": {"budget": args.budget}, "n_gpu_layers": args.n_gpu_layers}
    if args.max_tokens:
        overrides["max_tokens"] = args.max_tokens
    if args.flash_attn in ("on", "off"):  # the PRM's first context is made with it
        overrides["flash_attn"] = args.flash_attn
    config = selection.config({}, **overrides)
    dataset = load_dataset("toy" if args.preset == "toy" else "gsm8k", limit=args.problems)
    texts = [p.problem for p in dataset.problems]
    config, models = open_models(selection, config, mode.uses_base, mode.uses_helper, config.candidates_per_round, texts)
    prompt_tokens = longest_prompt(config, [models.base, models.helper], texts)
    print(f"preset {args.preset}: {mode} N={args.n} budget {args.budget}, {len(texts)} problems, "
          f"max {config.max_tokens} tokens, {args.n_gpu_layers} layers offloaded")
    for k in [int(x) for x in args.ks.split(",")]:
        flash_attn = ("on" if k > 1 else "off") if args.flash_attn == "concurrent" else args.flash_attn or config.flash_attn
        config = dataclasses.replace(config, flash_attn=flash_attn)
        if models.prm:  # reserve() makes its context for another K with these params
            models.prm.params = dataclasses.replace(models.prm.params, flash_attn=flash_attn)
        engine = Rescue(config, models.base, models.helper, models.prm, prompt_tokens_max=prompt_tokens, concurrency=k)
        llama = {name: g.llama_seconds for name, g in engine.sides.items()}
        memory = sum(g.ctx.memory_seconds for g in engine.sides.values())
        started = time.perf_counter()
        correct = sum(dataset.grade(p.answer, t.answer) for p, t, _ in engine.run(dataset.problems, text=lambda p: p.problem))
        wall = time.perf_counter() - started
        llama = {name: g.llama_seconds - llama[name] for name, g in engine.sides.items()}
        memory = sum(g.ctx.memory_seconds for g in engine.sides.values()) - memory
        yield Row(k, flash_attn, 60 * len(texts) / wall, 100 * correct / len(texts), wall, llama, memory,
                  engine.prm_seconds, wall - sum(llama.values()) - engine.prm_seconds)
        del engine  # its contexts go before the next K's are made


def main() -> None:
    rows = []
    for row in measure(parser().parse_args()):
        if not rows:
            print(f"{'K':>3s} {'FA':>3s} {'prob/min':>9s} {'acc %':>6s} {'wall s':>8s} {'llama base':>11s} "
                  f"{'llama helper':>13s} {'(memory)':>9s} {'PRM':>7s} {'outside':>8s}")
        print(f"{row.k:3d} {row.flash_attn:>3s} {row.per_minute:9.2f} {row.accuracy:6.1f} {row.wall:8.2f} "
              f"{row.llama.get('base', 0):11.2f} {row.llama.get('helper', 0):13.2f} {row.memory:9.2f} {row.prm:7.2f} "
              f"{100 * row.outside_share:7.1f}%")
        rows.append(row)
    if len(rows) > 1:
        first, second = rows[:2]
        print(f"K = {second.k} solves {second.per_minute / first.per_minute:.2f}x the problems per minute of K = {first.k} "
              "(goal >= 3x for 8 vs 1); outside = the engine's share of wall time (goal <= 10% at K = 16)")


if __name__ == "__main__":
    main()
