#!/usr/bin/env python3
"""How much the batch's layout moves the PRM's scores, and how often it changes the round's pick.

Replays the rounds of KV-Rescue rows in a results file through the preset's PRM: each round's survivors are
scored together, as the loop scores them (one group, forked from the committed prefix), and each alone (a
decode of its own), and the scores recorded in the row (the loop's, on the machine that ran it) are read
beside them. Prints the mean and largest score differences and the share of rounds whose favourite differs.

Usage: python3 perf/prm_layout.py RESULTS.jsonl [--preset coder] [--config kvrescue-b64-n4-rkv] [--rounds 60]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from kvrescue_local.presets import load_preset
from kvrescue_local.prm import PRM, PRMParams


def rounds(path: str, config_key: str):
    """(problem, committed steps before the round, the round's distinct survivors, their recorded scores)."""
    with open(path, encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines]
    for row in rows:
        if row["config_key"] != config_key or row["config"].get("choice", "prm") != "prm" or "trajectory" not in row:
            continue
        steps = row["trajectory"]["steps"]
        for i, step in enumerate(steps):
            recorded = {c["text"]: c["score"] for c in step["candidates"] if c["finished"] != "killed"}
            if len(recorded) > 1:
                yield row["trajectory"]["problem"], [s["text"] for s in steps[:i]], list(recorded), list(recorded.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results")
    parser.add_argument("--preset", default="coder")
    parser.add_argument("--config", default="kvrescue-b64-n4-rkv", help="the rows' config_key")
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    preset = load_preset(args.preset)
    prm = PRM(preset.prm, PRMParams(n_ctx=4096, max_candidates=16), head=preset.prm_head)
    diffs = {"together vs alone": [], "recorded vs together": []}
    flips = {"together vs alone": 0, "recorded vs together": 0}
    seen = 0
    for problem, committed, survivors, recorded in rounds(args.results, args.config):
        if seen == args.rounds:
            break
        seen += 1
        prm.start(problem)
        for text in committed:
            prm.commit(text)
        together = prm.score(survivors)
        alone = np.array([prm.score([text])[0] for text in survivors])
        for name, (a, b) in {"together vs alone": (together, alone),
                             "recorded vs together": (np.array(recorded), together)}.items():
            diffs[name] += np.abs(a - b).tolist()
            flips[name] += int(np.argmax(a) != np.argmax(b))
    print(f"{seen} rounds of {args.config} with 2 or more survivors ({sum(map(len, diffs.values())) // 2} scores)")
    for name, values in diffs.items():
        print(f"  {name:22s}: |score difference| mean {np.mean(values):.4f}, max {np.max(values):.4f}; "
              f"favourite differs in {flips[name]} of {seen} rounds ({100 * flips[name] / seen:.0f}%)")


if __name__ == "__main__":
    main()
