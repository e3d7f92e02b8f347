#!/usr/bin/env python3
"""Fit the commit rules' parameters (`--choice calibrated`'s per-source calibration, `--choice base-first`'s
helper margin) on KV-Rescue rows of training problems, and store them with a preset (kvrescue_local/prmtrain/commit.py).

The rows come from `bench run --split train --modes kvrescue --ns 1` with the PRM choosing: every round with a base
and a helper survivor has both rewards; a row of an evaluation problem is refused.

Usage:
  python3 perf/fit_commit.py ROWS.jsonl [more.jsonl ...] [--write models/coder/commit.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvrescue_local.bench.results_file import read_rows
from kvrescue_local.errors import KVRescueError
from kvrescue_local.prmtrain.commit import fit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", type=Path, nargs="+", help="results files of KV-Rescue on training problems")
    parser.add_argument("--write", type=Path, help="store the fitted rule here (a preset's commit.json)")
    args = parser.parse_args()
    try:
        rows = [row for path in args.rows for row in read_rows(path)]
        result = fit(rows, ", ".join(map(str, args.rows)))
    except KVRescueError as exc:
        sys.exit(f"Error: {exc}")
    base_slope, base_bias, helper_slope, helper_bias = result.calibration
    print(f"{result.rounds} scored rounds with a base and a helper survivor, of {result.problems} training problems")
    for source, (steps, right) in result.steps.items():
        print(f"  committed {source} steps: {steps}, {right} in trajectories that ended right")
    print(f"calibration: P(right) = sigmoid({base_slope:.3f} r + {base_bias:.3f}) for the base, "
          f"sigmoid({helper_slope:.3f} r + {helper_bias:.3f}) for the helper")
    print(f"base-first helper margin: {result.helper_margin}")
    if args.write:
        fitted_on = {"rows": [p.name for p in args.rows], "problems": result.problems, "rounds": result.rounds,
                     "steps": {k: list(v) for k, v in result.steps.items()}}
        args.write.write_text(json.dumps({"rule": result.rule(), "fit": fitted_on}, indent=2) + "\n")
        print(f"wrote {args.write}")


if __name__ == "__main__":
    main()
