#!/usr/bin/env python3
"""Detector calibration on real text: base candidates of the evicted and the full-KV 1.5B.

`collect` solves GSM8K and MATH500 problems in each setting (full KV; best-of-N evicted with R-KV
at each budget) with the detector watching every base candidate but killing none, and appends one
JSON line per candidate (setting, dataset, the monitor's statistics) to STATS as each problem ends,
so it can be stopped and resumed. `replay` writes the same lines from results files of `bench run`
without decoding: each committed base step of a full-KV or evicted best-of-N trajectory is re-tokenized
and fed to a watching monitor after the trajectory's text before it, which gives the zstd signal exactly
as the loop would have seen it (the entropy needs the logits, so it is left out), and it prints where the
shipped thresholds would first kill each trajectory's step. `collect` and `fit` are thin callers of kvrescue_local/prmtrain/detector.py,
which `kvrescue-local fit` runs: `fit` runs the detector's Otsu calibration on all of them, prints each signal's
separability, the kill rate on full-KV candidates (false kills) vs evicted ones at the fitted and at the default
thresholds, and the zstd ratio of ordinary enumerations next to real full-KV text; `--write` stores the thresholds
with the coder preset.

Usage:
  KVRESCUE_THREADS=1 nice python3 perf/calibrate_real.py collect --stats cal.jsonl --problems 8
  KVRESCUE_THREADS=1 python3 perf/calibrate_real.py collect --stats long-0.jsonl --datasets math500 --problems 10 \
      --budgets 64 --max-tokens 4096 --shard 0/2    # and --shard 1/2 into long-1.jsonl, side by side
  python3 perf/calibrate_real.py replay results/coder-math500-table.jsonl.zst --stats replay.jsonl
  python3 perf/calibrate_real.py fit --stats cal.jsonl [more.jsonl ...] [--write models/coder/detector.json]
  # the helper's own thresholds, from its committed steps in rows of training problems
  python3 perf/calibrate_real.py replay --side helper results/coder-gsm8k-n1.jsonl TRAIN.jsonl --stats helper.jsonl
  python3 perf/calibrate_real.py fit --stats helper.jsonl --normal helper  # for --helper-tau-entropy/-compression
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


from kvrescue_local.bench.datasets import load_dataset
from kvrescue_local.bench.run import parse_shard
from kvrescue_local.bench.results_file import read_rows
from kvrescue_local.detect import Detector, DetectorParams
from kvrescue_local.detect.calibrate import load_params, save_params
from kvrescue_local.errors import KVRescueError
from kvrescue_local.eviction import KVBudget
from kvrescue_local.presets import MODELS_CACHE
from kvrescue_local.prmtrain.detector import MAX_FALSE_KILLS, WATCH_ONLY, fit_detector, read_stats, settings
from kvrescue_local.prmtrain.detector import collect as detector_stats
from kvrescue_local.rescue import RescueConfig, longest_prompt
from kvrescue_local.runtime import Model

def collect(args) -> None:
    model = Model(args.base)
    per_dataset = [[(name, p) for p in load_dataset(name, limit=args.problems).problems] for name in args.datasets.split(",")]
    problems = [pair for row in zip(*per_dataset) for pair in row]  # datasets alternate: a stopped run covers each
    index, count = args.shard
    problems = problems[index::count]  # processes of one thread each share the cores without competing
    template = RescueConfig(n=1, max_tokens=args.max_tokens, max_step_tokens=256, temperature=0.7, top_p=0.8,
                            kv=KVBudget(budget=64, buffer=128, policy="rkv"))
    configs = settings(template, [int(b) for b in args.budgets.split(",")])
    reserve = longest_prompt(RescueConfig(), [model], [p.problem for _, p in problems])
    golds = {(dataset, p.id): p.answer for dataset, p in problems}

    def solved(label: str, dataset: str, record: dict) -> None:
        print(f"{dataset} {label}: {record['n_steps']} steps, {record['tokens']['base']} tokens, stop {record['stop']}, "
              f"answer {record['answer']}", flush=True)

    detector_stats(model, configs, [(dataset, p.id, p.problem) for dataset, p in problems], args.stats, reserve,
                   on_solved=solved)


def setting_of(row: dict, side: str = "base") -> str | None:
    """A row's setting in collect's names; None for a mode whose committed steps are not all the base's. For the
    helper's steps (side "helper": of helper-alone and KV-Rescue rows), "helper" where the trajectory ended by itself
    and "helper@cap" where it ran to a length cap (where the helper's loops are)."""
    config = row["config"]
    if side == "helper":
        if config["mode"] not in ("helper", "kvrescue"):
            return None
        return "helper@cap" if row["length_capped"] else "helper"
    if config["mode"] == "full":
        return "full"
    return f"bon@{config['budget']}" if config["mode"] == "bon" and config["n"] == 1 else None


def replay(args) -> None:
    missing = [str(p) for p in [*args.results, args.base, args.detector] if not p.exists()]
    if missing:
        raise SystemExit(f"Error: not found: {', '.join(missing)} (results files of `bench run`, the base's GGUF: "
                         "`kvrescue-local models pull coder`, and the detector's thresholds)")
    model = Model(args.base)
    shipped = load_params(args.detector)
    unique = {(r["dataset"], r["id"], r["config_key"]): r for path in args.results for r in read_rows(path)}
    rows = [r for r in unique.values() if "trajectory" in r and setting_of(r, args.side)]  # a problem in two files once
    if not rows:
        raise SystemExit(f"Error: {', '.join(map(str, args.results))} hold no full-KV or N = 1 best-of-N rows with "
                         "trajectories: pass results files of `bench run --modes full,bon --ns 1`")
    # the shipped windows, killing nothing: a step's first kill is where its zstd minimum falls below the threshold
    watching = dataclasses.replace(shipped, tau_entropy=WATCH_ONLY.tau_entropy, tau_compression=WATCH_ONLY.tau_compression)
    summary: dict[str, dict] = {}
    with args.stats.open("w") as out:
        for row in rows:
            setting, text, kill_at = setting_of(row, args.side), b"", None
            at = 0  # the side's tokens before this step
            for step in row["trajectory"]["steps"]:
                if step["source"] != args.side:  # the other side's step: only the text the monitors start from
                    text += step["text"].encode()
                    continue
                monitor = Detector(watching).monitor(text)
                tokens = model.tokenize(step["text"], special=False)
                for i, token in enumerate(tokens):
                    monitor.update(0.0, model.detokenize_bytes([int(token)], special=False))
                    if i == len(tokens) - 1:
                        monitor.finish()  # as the loop does where a step ends
                    if kill_at is None and monitor.min_compression < shipped.tau_compression:
                        kill_at = at + i + 1
                out.write(json.dumps({"dataset": row["dataset"], "id": row["id"], "setting": setting,
                                      "text": step["text"], **monitor.stats(), "max_mean_entropy": None}) + "\n")
                text += step["text"].encode()
                at += len(tokens)
            s = summary.setdefault(setting, {"trajectories": 0, "capped": 0, "killed": 0, "capped_killed": 0,
                                             "tokens": 0, "after_kill": 0})
            s["trajectories"] += 1
            s["capped"] += bool(row["length_capped"])
            s["tokens"] += at
            if kill_at is not None:
                s["killed"] += 1
                s["capped_killed"] += bool(row["length_capped"])
                s["after_kill"] += at - kill_at
    print(f"zstd threshold {shipped.tau_compression} ({args.detector}), {shipped.text_window}-byte window, checked "
          f"every {shipped.check_every} tokens; wrote {args.stats}")
    print(f"{'setting':8s}  {'trajectories':>12s}  {'at the cap':>10s}  {'a step killed':>13s}  {'of them capped':>14s}  "
          f"{args.side + ' tokens':>11s}  {'after the first kill':>20s}")
    for setting, s in sorted(summary.items()):
        print(f"{setting:8s}  {s['trajectories']:12d}  {s['capped']:10d}  {s['killed']:13d}  {s['capped_killed']:14d}  "
              f"{s['tokens']:11,d}  {s['after_kill']:13,d} ({100 * s['after_kill'] / max(s['tokens'], 1):.1f}%)")


def fit(args) -> None:
    fitted = fit_detector(read_stats(args.stats), DetectorParams(), args.normal, say=print)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {save_params(fitted, args.write)}")


def shard(text: str) -> tuple[int, int]:
    try:
        return parse_shard(text)
    except KVRescueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--base", type=Path, default=MODELS_CACHE / "coder-1.5b.gguf")
    c.add_argument("--stats", type=Path, required=True)
    c.add_argument("--datasets", default="gsm8k,math500")
    c.add_argument("--problems", type=int, default=8, help="first PROBLEMS of each dataset")
    c.add_argument("--budgets", default="64,128")
    c.add_argument("--max-tokens", type=int, default=384, help="a trajectory's length cap (base tokens)")
    c.add_argument("--shard", type=shard, default=(0, 1), metavar="I/N", help="every Nth problem from the Ith")
    r = sub.add_parser("replay")
    r.add_argument("results", type=Path, nargs="+")
    r.add_argument("--base", type=Path, default=MODELS_CACHE / "coder-1.5b.gguf", help="the tokenizer the base used")
    r.add_argument("--detector", type=Path, default=Path(__file__).parent.parent / "models/coder/detector.json")
    r.add_argument("--stats", type=Path, required=True)
    r.add_argument("--side", choices=["base", "helper"], default="base",
                   help="whose committed steps: the base's (full-KV and best-of-N rows) or the helper's (helper-alone "
                        "and KV-Rescue rows; the pair shares one tokenizer)")
    f = sub.add_parser("fit")
    f.add_argument("--stats", type=Path, nargs="+", required=True, help="lines of `collect` or `replay`")
    f.add_argument("--write", type=Path, help="store the fitted thresholds here (JSON)")
    f.add_argument("--normal", default="full", help="the setting whose candidates a threshold must not kill (at most "
                                                    f"{MAX_FALSE_KILLS}%%): full, or helper for the helper's thresholds")
    args = parser.parse_args()
    {"collect": collect, "replay": replay, "fit": fit}[args.command](args)


if __name__ == "__main__":
    main()
