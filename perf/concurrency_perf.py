#!/usr/bin/env python3
"""Problems per minute at K problems at once against one at a time, side by side in one run, and where the time
went.

Solves the same problems at each concurrency in --ks, for each preset in --presets (toy: held-out toy problems;
coder: GSM8K) and each flash-attention setting in --flash-attn, KV-Rescue at N = 2 and budget 64 by default. The
configurations are interleaved and the whole grid is run --repeats times, so a neighbour's load on shared cores
falls on all of them alike; per configuration it prints the medians of: problems/min from wall clock, problems
per CPU-minute of this process (llama.cpp runs in it, one thread a context with KVRESCUE_THREADS=1), the ratio of
each to K = 1's (same preset and flash attention), the lanes the engine ran (problems that share one context per
model: `problems_per_context`), accuracy, seconds in llama.cpp per model, in the PRM, and the engine's share
outside both.

Usage: python3 perf/concurrency_perf.py [--presets toy,coder] [--ks 1,4,8,16,32] [--flash-attn off,on]
       [--problems 32] [--coder-problems 4] [--repeats 3] [--mode kvrescue] [-n 2] [--budget 64] [--max-tokens T]
       [--coder-max-tokens 256] [--per-context L] [--n-gpu-layers N]
The coder pair runs at about 20 tokens/s per core on a CPU: limit its grid, e.g. --presets coder --ks 1,4
--flash-attn off --repeats 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from kvrescue_local import toy  # noqa: F401  (registers the toy dataset)
from kvrescue_local.bench.datasets import load_dataset
from kvrescue_local.compose import open_models, select_models
from kvrescue_local.prm import PRM
from kvrescue_local.rescue import Mode, Rescue, longest_prompt


@dataclasses.dataclass
class Run:
    """One solve of the problems at one concurrency: wall and CPU seconds, and where the wall time went."""

    wall: float
    cpu: float
    accuracy: float
    lanes: int
    llama: dict[str, float]  # seconds in llama.cpp per model side
    prm: float
    prm_outside_llama: float  # of which outside the llama columns (all but a head on the helper's context)

    @property
    def outside_share(self) -> float:
        return (self.wall - sum(self.llama.values()) - self.prm_outside_llama) / self.wall


@dataclasses.dataclass
class Setup:
    """A preset's models, opened once, and its problems."""

    name: str
    config: object
    models: object
    dataset: object
    prompt_tokens: int


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="toy,coder")
    parser.add_argument("--ks", default="1,4,8,16,32", help="concurrencies; ratios are to K = 1's")
    parser.add_argument("--flash-attn", default="off,on", help="comma-separated: off, on")
    parser.add_argument("--problems", type=int, default=32, help="toy problems per run")
    parser.add_argument("--coder-problems", type=int, default=4, help="GSM8K problems per run of the coder pair")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the interleaved grid (medians)")
    parser.add_argument("--mode", default="kvrescue")
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, help="the toy preset's trajectory cap [default: the preset's]")
    parser.add_argument("--coder-max-tokens", type=int, default=256, help="the coder pair's trajectory cap")
    parser.add_argument("--per-context", type=int, help="problems per context [default: the engine's choice]")
    parser.add_argument("--n-gpu-layers", "-ngl", type=int, default=0, help="layers of each model offloaded to the GPU")
    return parser


def open_setup(name: str, args: argparse.Namespace, problems: int) -> Setup:
    mode = Mode.parse(args.mode)
    options = {"preset": name, "base": None, "helper": None, "prm": None}
    selection = select_models(options, mode.uses_base, mode.uses_helper, needs_prm=mode.sides * args.n > 1)
    overrides = {"mode": mode, "n": args.n, "kv": {"budget": args.budget}, "n_gpu_layers": args.n_gpu_layers}
    max_tokens = args.max_tokens if name == "toy" else args.coder_max_tokens
    if max_tokens:
        overrides["max_tokens"] = max_tokens
    config = selection.config({}, **overrides)
    dataset = load_dataset("toy" if name == "toy" else "gsm8k", limit=problems)
    texts = [p.problem for p in dataset.problems]
    config, models = open_models(selection, config, mode.uses_base, mode.uses_helper, config.candidates_per_round, texts)
    return Setup(name, config, models, dataset, longest_prompt(config, [models.base, models.helper], texts))


def solve(setup: Setup, k: int, flash_attn: str, per_context: int | None) -> Run:
    config = dataclasses.replace(setup.config, flash_attn=flash_attn)
    models = setup.models
    prm = models.prm
    if isinstance(prm, PRM):  # a context of its own made with these params at every K (K = 1's included)
        prm.params = dataclasses.replace(prm.params, flash_attn=flash_attn)
        prm = prm.sibling()
    engine = Rescue(config, models.base, models.helper, prm, prompt_tokens_max=setup.prompt_tokens,
                    concurrency=k, per_context=per_context)
    llama, prm_before = engine.llama_seconds(), engine.prm_seconds
    wall, cpu = time.perf_counter(), time.process_time()
    dataset = setup.dataset
    correct = sum(dataset.grade(p.answer, t.answer) for p, t, _ in engine.run(dataset.problems, text=lambda p: p.problem))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    llama = {name: seconds - llama[name] for name, seconds in engine.llama_seconds().items()}
    prm = engine.prm_seconds - prm_before
    return Run(wall, cpu, 100 * correct / len(dataset.problems), max(1, len(engine.lanes)), llama, prm,
               prm if isinstance(models.prm, PRM) else 0.0)


def main() -> None:
    args = parser().parse_args()
    ks = [int(x) for x in args.ks.split(",")]
    settings = args.flash_attn.split(",")
    setups = [open_setup(name, args, args.problems if name == "toy" else args.coder_problems)
              for name in args.presets.split(",")]
    for s in setups:
        print(f"preset {s.name}: {s.config.mode} N={s.config.n} budget {s.config.kv.budget}, "
              f"{len(s.dataset.problems)} problems, max {s.config.max_tokens} tokens, {args.n_gpu_layers} layers offloaded")
    grid = [(s, fa, k) for s in setups for fa in settings for k in ks]
    runs: dict[tuple, list[Run]] = {}
    for repeat in range(args.repeats):  # interleaved: each pass runs every configuration once
        for setup, fa, k in grid:
            run = solve(setup, k, fa, args.per_context)
            runs.setdefault((setup.name, fa, k), []).append(run)
            print(f"  pass {repeat + 1}: {setup.name} FA {fa} K={k}: {run.wall:.1f} s wall, {run.cpu:.1f} s CPU",
                  flush=True)
    print(f"{'preset':>6s} {'FA':>3s} {'K':>3s} {'lanes':>5s} {'prob/min':>9s} {'x K=1':>6s} {'prob/CPU-min':>13s} "
          f"{'x K=1':>6s} {'acc %':>6s} {'llama base':>11s} {'llama helper':>13s} {'PRM':>7s} {'outside':>8s}")
    for setup, fa, k in grid:
        done = runs[(setup.name, fa, k)]
        median = {f: statistics.median(getattr(r, f) for r in done) for f in ("wall", "cpu", "prm", "outside_share")}
        llama = {side: statistics.median(r.llama.get(side, 0.0) for r in done) for side in ("base", "helper")}
        first = runs.get((setup.name, fa, 1))
        per_min, per_cpu = 60 * len(setup.dataset.problems) / median["wall"], 60 * len(setup.dataset.problems) / median["cpu"]
        ratio = ratio_cpu = float("nan")
        if first:
            ratio = statistics.median(r.wall for r in first) / median["wall"]
            ratio_cpu = statistics.median(r.cpu for r in first) / median["cpu"]
        print(f"{setup.name:>6s} {fa:>3s} {k:3d} {done[0].lanes:5d} {per_min:9.2f} {ratio:6.2f} {per_cpu:13.2f} "
              f"{ratio_cpu:6.2f} {done[0].accuracy:6.1f} {llama['base']:11.2f} {llama['helper']:13.2f} "
              f"{median['prm']:7.2f} {100 * median['outside_share']:7.1f}%")
    print("x K=1: problems per minute (per CPU-minute) against K = 1's of the same preset and flash attention, "
          "medians of the passes (goal: >= 1 at K = 8 and 32 on the toy, >= 1.3 at K = 4 on the coder pair)")


if __name__ == "__main__":
    main()
