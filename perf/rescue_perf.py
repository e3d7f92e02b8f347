#!/usr/bin/env python3
"""Cost of each mode of the stepwise search on the tiny models, side by side in one run.

Prints per mode: wall time per problem, tokens generated per model, and the share of wall
time spent outside llama.cpp (neither in llama_decode nor in PRM scoring).

Usage: python3 perf/rescue_perf.py [--problems 5] [--n 8] [--preset tiny]
"""

from __future__ import annotations

import argparse

from kvrescue_local.detect import DetectorParams
from kvrescue_local.eviction import KVBudget
from kvrescue_local.presets import load_preset
from kvrescue_local.prm import PRM, PRMParams
from kvrescue_local.rescue import MODES, Rescue, RescueConfig
from kvrescue_local.runtime import Model

PROBLEMS = ["Let a=17 and b=25. What is a+b?", "Compute 3*(4+5).", "What is the sum of the first ten odd numbers?",
            "If x+3=10, what is x?", "How many primes are below 30?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=5)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--preset", default="tiny")
    args = parser.parse_args()
    preset = load_preset(args.preset)
    base, helper = Model(preset.base), Model(preset.helper)
    prm = PRM(preset.prm, PRMParams(n_ctx=2048, max_candidates=2 * args.n))
    problems = (PROBLEMS * args.problems)[: args.problems]
    print(f"preset {preset.name} ({preset.note or 'trained'}), N={args.n}, {len(problems)} problems")
    print(f"{'mode':9s} {'s/problem':>10s} {'base tok':>9s} {'helper tok':>10s} {'steps':>6s} {'outside llama.cpp':>18s}")
    for mode in MODES:
        # random-weight models have near-uniform logits: keep the detector from killing every candidate
        detector = DetectorParams(tau_entropy=50.0) if preset.name == "tiny" else DetectorParams()
        config = RescueConfig(mode=mode, n=args.n, kv=KVBudget(budget=64, buffer=128), detector=detector,
                              max_tokens=512, max_step_tokens=64, temperature=1.0, top_p=0.95)
        engine = Rescue(config, base, helper, prm)
        totals = {"total": 0.0, "outside": 0.0, "base": 0, "helper": 0, "steps": 0}
        for i, problem in enumerate(problems):
            trajectory = engine.solve(problem)
            totals["total"] += trajectory.timings["total"]
            totals["outside"] += trajectory.timings["orchestration"]
            totals["base"] += trajectory.tokens["base"]
            totals["helper"] += trajectory.tokens["helper"]
            totals["steps"] += trajectory.n_steps
        k = len(problems)
        print(f"{mode:9s} {totals['total'] / k:10.3f} {totals['base'] / k:9.0f} {totals['helper'] / k:10.0f} "
              f"{totals['steps'] / k:6.1f} {100 * totals['outside'] / totals['total']:17.1f}% (goal <= 15%)")


if __name__ == "__main__":
    main()
