#!/usr/bin/env python3
"""Fit a preset's commit rules on rows of training problems and store them in its commit.json: a thin caller of
kvrescue_local/prmtrain/rules_file.py, which `kvrescue-local fit --rows` runs too (docs/prm.md). With --write, the
fitted parameters are laid over those of the rule specs the file holds.

Usage:
  python3 perf/fit_commit.py ROWS.jsonl [more.jsonl ...] [--judge-rows ROLLOUTS.jsonl ...] [--write models/coder/commit.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvrescue_local.errors import KVRescueError
from kvrescue_local.prmtrain.rules_file import fit_rules, rows_in


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", type=Path, nargs="+", help="results files of training problems")
    parser.add_argument("--write", type=Path, help="store the fitted rule here (a preset's commit.json)")
    parser.add_argument("--judge-rows", type=Path, nargs="+", default=[],
                        help="the rollouts the judge's head was trained on (`prm train --rollouts`)")
    args = parser.parse_args()
    try:
        stored = json.loads(args.write.read_text()) if args.write and args.write.exists() else {}
    except (OSError, ValueError) as exc:
        sys.exit(f"Error: cannot read {args.write} ({exc}): restore it from the repository or remove it")
    try:
        rows_of = {path: rows_in(path, "results files of `bench run --split train`") for path in args.rows}
        judge_rows_of = {path: rows_in(path, "to --judge-rows the rollouts the judge's head was trained on")
                         for path in args.judge_rows}
        commit = fit_rules(rows_of, judge_rows_of, stored, say=print)
    except KVRescueError as exc:
        sys.exit(f"Error: {exc}")
    if args.write:
        args.write.write_text(json.dumps(commit, indent=2) + "\n")
        print(f"wrote {args.write}")


if __name__ == "__main__":
    main()
