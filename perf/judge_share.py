#!/usr/bin/env python3
"""The PRM's share of KV-Rescue's time in results files of one configuration, on the problems all of them ran,
side by side, and whether their trajectories agree step for step (a change to the timers must move no step).

Share: the PRM's seconds over the problem's total, summed over the common problems (the per-problem timings
of `bench run`; the same as Table 1's PRM s over total s on those problems).

Usage: python3 perf/judge_share.py RESULTS.jsonl RESULTS.jsonl... [--config kvrescue-b64-n4-rkv]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvrescue_local.bench.results_file import read_rows


def rows_of(path: str, config: str) -> dict[str, dict]:
    if not Path(path).is_file():
        raise SystemExit(f"Error: no results file {path}: give JSONL files that `bench run --results` wrote")
    return {r["id"]: r for r in read_rows(Path(path)) if r["config_key"] == config}


def steps_of(row: dict) -> list[tuple[str, str]]:
    return [(s["source"], s["text"]) for s in row["trajectory"]["steps"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+")
    parser.add_argument("--config", default="kvrescue-b64-n4-rkv", help="the rows' config_key")
    args = parser.parse_args()
    files = {path: rows_of(path, args.config) for path in args.results}
    common = sorted(set.intersection(*(set(rows) for rows in files.values())))
    if not common:
        raise SystemExit(f"Error: no problem of {args.config} is in every file: give files of one configuration")
    print(f"{args.config}, {len(common)} problems in every file")
    print(f"{'file':<48} {'right':>5} {'PRM s':>8} {'total s':>8} {'share':>7}")
    for path, rows in files.items():
        prm = sum(rows[i]["timings"].get("prm", 0.0) for i in common)
        total = sum(rows[i]["timings"]["total"] for i in common)
        right = sum(bool(rows[i]["correct"]) for i in common)
        print(f"{path:<48} {right:>5} {prm / len(common):>8.2f} {total / len(common):>8.2f} {prm / total:>7.1%}")
    first, *others = files.values()
    same = sum(all(steps_of(first[i]) == steps_of(rows[i]) for rows in others) for i in common)
    print(f"trajectories the same step for step in every file: {same} of {len(common)}")


if __name__ == "__main__":
    main()
