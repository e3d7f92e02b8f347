#!/usr/bin/env python3
"""Detector calibration on real text: base candidates of the evicted and the full-KV 1.5B.

`collect` solves GSM8K and MATH500 problems in each setting (full KV; best-of-N evicted with R-KV
at each budget) with the detector watching every base candidate but killing none, and appends one
JSON line per candidate (setting, dataset, the monitor's statistics) to STATS as each problem ends,
so it can be stopped and resumed. `fit` runs the detector's Otsu calibration on all of them, prints
each signal's separability, the kill rate on full-KV candidates (false kills) vs evicted ones at
the fitted and at the default thresholds, and the zstd ratio of ordinary enumerations next to real
full-KV text; `--write` stores the thresholds with the coder preset.

Usage:
  KVRESCUE_THREADS=1 nice python3 perf/calibrate_real.py collect --stats cal.jsonl --problems 8
  python3 perf/calibrate_real.py fit --stats cal.jsonl [--write models/coder/detector.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from kvrescue_local.bench.datasets import load_dataset
from kvrescue_local.detect import Detector, DetectorParams, calibrate, compression_ratio
from kvrescue_local.detect.calibrate import save_params
from kvrescue_local.eviction import KVBudget
from kvrescue_local.presets import MODELS_CACHE
from kvrescue_local.rescue import Rescue, RescueConfig, longest_prompt
from kvrescue_local.runtime import Model

WATCH_ONLY = DetectorParams(tau_entropy=1e6, tau_compression=1e-6)  # record the signals, kill nothing


def settings(budgets: list[int]) -> dict[str, RescueConfig]:
    common = dict(n=1, max_tokens=384, max_step_tokens=256, temperature=0.7, top_p=0.8)
    out = {"full": RescueConfig(mode="full", **common)}
    for b in budgets:
        out[f"bon@{b}"] = RescueConfig(mode="bon", kv=KVBudget(budget=b, buffer=128, policy="rkv"), **common)
    return out


def collect(args) -> None:
    model = Model(args.base)
    done = set()
    if args.stats.exists():
        done = {(r["dataset"], r["id"], r["setting"]) for r in map(json.loads, args.stats.read_text().splitlines())}
    per_dataset = [[(name, p) for p in load_dataset(name, limit=args.problems).problems] for name in args.datasets.split(",")]
    problems = [pair for row in zip(*per_dataset) for pair in row]  # datasets alternate: a stopped run covers each
    configs = settings([int(b) for b in args.budgets.split(",")])
    reserve = longest_prompt(RescueConfig(), [model], [p.problem for _, p in problems])
    engines = {}
    for label, config in configs.items():
        engines[label] = Rescue(config, model, prompt_tokens_max=reserve)
        engines[label].detector = Detector(WATCH_ONLY)  # bon/full modes have none: watch their base candidates
    with args.stats.open("a") as out:
        for dataset, problem in problems:  # problem-major: a stopped run covers every setting
            for label, engine in engines.items():
                if (dataset, problem.id, label) in done:
                    continue
                record = engine.solve(problem.problem).to_json()
                for step in record["steps"]:
                    for cand in step["candidates"]:
                        out.write(json.dumps({"dataset": dataset, "id": problem.id, "setting": label,
                                              "text": cand["text"], **cand["detector"]}) + "\n")
                out.flush()
                print(f"{dataset} {problem.id} {label}: {record['n_steps']} steps, {record['tokens']['base']} tokens, "
                      f"stop {record['stop']}, answer {record['answer']} (gold {problem.answer})", flush=True)


def enumeration(start: int, step: int, count: int) -> bytes:
    return ", ".join(f"a_{i} = {start + step * (i - 1)}" for i in range(1, count + 1)).encode()


def killed(row: dict, params: DetectorParams) -> bool:
    return row["max_mean_entropy"] > params.tau_entropy or row["min_compression"] < params.tau_compression


def kill_rates(rows: list[dict], params: DetectorParams) -> dict[str, float]:
    settings = sorted({r["setting"] for r in rows})
    return {s: 100 * float(np.mean([killed(r, params) for r in rows if r["setting"] == s])) for s in settings}


MAX_FALSE_KILLS = 1.0  # % of full-KV candidates a fitted threshold may kill; above it the default stays


def fit(args) -> None:
    rows = [json.loads(line) for line in args.stats.read_text().splitlines()]
    defaults = DetectorParams()
    # each signal only where it was measured: a full entropy window, a full text window (zstd checked)
    measured = {"tau_entropy": ("max_mean_entropy", [r for r in rows if r["tokens"] >= defaults.entropy_window]),
                "tau_compression": ("min_compression", [r for r in rows if r["min_compression"] < 1.0])}
    chosen = {}
    for field, (key, subset) in measured.items():
        counts = {s: sum(r["setting"] == s for r in subset) for s in sorted({r["setting"] for r in subset})}
        print(f"{key}: {len(subset)} candidates ({', '.join(f'{s} {n}' for s, n in counts.items())})")
        for s in counts:
            v = np.array([r[key] for r in subset if r["setting"] == s])
            print(f"  {s:8s}: min {v.min():.3f}  p50 {np.median(v):.3f}  max {v.max():.3f}")
        _, report = calibrate(subset)
        threshold, separability = report[field]["threshold"], report[field]["separability"]
        trial = dataclasses.replace(WATCH_ONLY, **{field: threshold})
        false_kills = kill_rates([r for r in subset if r["setting"] == "full"], trial).get("full", 0.0)
        keep = report[field]["used"] and false_kills <= MAX_FALSE_KILLS
        print(f"  Otsu: threshold {threshold:.3f}, separability {separability:.2f}, it would kill "
              + ", ".join(f"{s} {v:.1f}%" for s, v in kill_rates(subset, trial).items())
              + ("" if keep else f": not used (separability < 0.75 or > {MAX_FALSE_KILLS}% full-KV kills), "
                                 f"default {getattr(defaults, field)} kept"))
        if keep:
            chosen[field] = threshold
    full_text = [r["text"].encode() for r in rows if r["setting"] == "full" and len(r["text"].encode()) >= 256]
    ratios = [compression_ratio(t[i:i + 256]) for t in full_text for i in range(0, len(t) - 255, 64)]
    enums = {"a_1 = 2, a_2 = 4, ...": enumeration(2, 2, 40), "a_1 = 3, a_2 = 10, ... (+7)": enumeration(3, 7, 40)}
    for label, text in enums.items():
        print(f"zstd ratio of 256 bytes of {label}: {compression_ratio(text[:256]):.3f}")
    if ratios:
        print(f"zstd ratio of 256-byte windows of full-KV steps ({len(ratios)}): min {min(ratios):.3f}, "
              f"p50 {np.median(ratios):.3f}")
    fitted = dataclasses.replace(defaults, **chosen)
    watched = measured["tau_entropy"][1]
    for label, params in (("default", defaults), ("chosen", fitted)):
        print(f"kill rate at the {label} thresholds (entropy {params.tau_entropy:.3f}, zstd {params.tau_compression:.3f}): "
              + ", ".join(f"{s} {v:.1f}%" for s, v in kill_rates(watched, params).items()))
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {save_params(fitted, args.write)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--base", type=Path, default=MODELS_CACHE / "coder-1.5b.gguf")
    c.add_argument("--stats", type=Path, required=True)
    c.add_argument("--datasets", default="gsm8k,math500")
    c.add_argument("--problems", type=int, default=8, help="first PROBLEMS of each dataset")
    c.add_argument("--budgets", default="64,128")
    f = sub.add_parser("fit")
    f.add_argument("--stats", type=Path, required=True)
    f.add_argument("--write", type=Path, help="store the fitted thresholds here (JSON)")
    args = parser.parse_args()
    collect(args) if args.command == "collect" else fit(args)


if __name__ == "__main__":
    main()
