#!/usr/bin/env python3
"""The regime map on the toy world: KV-Rescue with helpers of graded strength beside one base and one PRM.

    python3 perf/regime_map.py run --helpers models/toy/helpers/*/*.gguf --limit 300 \\
        --out results/toy-regime-map.jsonl.zst --figure docs/regime-map.png
    kvrescue-local report results/toy-regime-map.jsonl.zst        # the map is its last table

`run` is `bench run` on the toy preset, at one llama.cpp thread per process, --jobs processes at once: full KV and
evicted best-of-N once (they do not use the helper), then, per helper, the helper alone and KV-Rescue, at each
budget with N = 1, each into its own results file under --parts (resumable: rerun the same command to continue).
It then writes every row into --out (zstd where it ends in .zst; the files hold rows of different helpers, which
`bench merge` keeps apart) and, with --figure, the map's figure with the coder pair's measured points on it.
`figure` redraws the figure from a results file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvrescue_local.bench.plots import recovery_by_helper
from kvrescue_local.bench.regime import regime_map
from kvrescue_local.bench.report import load_results
from kvrescue_local.bench.results_file import read_rows
from kvrescue_local.files import compressed_output, write_output
from kvrescue_local.toy.train import HELPER_BLIND_SPOT

ROOT = Path(__file__).resolve().parents[1]

# The coder pair (Qwen2.5-Coder 1.5B base, 0.5B helper), as docs/results.md measures it with each dataset's default
# rule: (label, helper ratio, recovered %). GSM8K ids 900-1099, 768 tokens ("GSM8K at budget 64: 100 more evaluation
# problems"): full KV 55.0%, the helper alone 18.0%, evicted best-of-N 8.0%, KV-Rescue 24.0%. MATH500 positions
# 0-99, 4,096 tokens ("MATH500 with long traces: the regime rule" and "the stronger writer first"): full KV 48.0%,
# the helper alone 9.0%; at B = 32 best-of-N 3.0%, KV-Rescue (the helper's step first) 10.0%; at B = 64 best-of-N
# 18.0%, KV-Rescue (base-first) 18.0%.
CODER_POINTS = (
    ("coder GSM8K B=64", 18.0 / 55.0, 100 * (24.0 - 8.0) / (55.0 - 8.0)),
    ("coder MATH500 B=32", 9.0 / 48.0, 100 * (10.0 - 3.0) / (48.0 - 3.0)),
    ("coder MATH500 B=64", 9.0 / 48.0, 100 * (18.0 - 18.0) / (48.0 - 18.0)),
)
# The paper's 87% at B = 64 (Qwen2.5-Math 7B base, 1.5B helper, MATH500), at the helper ratio of about 0.9 that the
# public model cards give.
PAPER_POINT = ("paper B=64 (ratio from model cards)", 0.9, 87.0)


def bench_command(args, results: Path, modes: str, helper: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "kvrescue_local", "bench", "run", "--dataset", "toy", "--preset", "toy",
            "--modes", modes, "--budgets", args.budgets, "--ns", "1", "--limit", str(args.limit), "-t", "1",
            "--resume", "--results", str(results), *(["--helper", str(helper)] if helper else [])]


def run(args) -> None:
    helpers = [Path(h) for h in args.helpers]
    names = [h.stem for h in helpers]
    missing = [str(h) for h in helpers if not h.is_file()]
    if missing:
        raise SystemExit(f"Error: no helper file {', '.join(missing)}: pass GGUF files (models/toy/helpers/*/*.gguf)")
    if len(set(names)) < len(names):
        raise SystemExit("Error: two helpers share a file name, which the results tell them apart by: rename one")
    if len(helpers) < 2:
        raise SystemExit("Error: the map compares helpers: pass at least two")
    args.parts.mkdir(parents=True, exist_ok=True)
    jobs = [("evicted", "full,bon", None)] + [(name, "helper,kvrescue", h) for name, h in zip(names, helpers)]
    env = {**os.environ, "KVRESCUE_THREADS": "1"}
    started, running, failed = time.perf_counter(), [], []
    for name, modes, helper in jobs:
        while len(running) >= args.jobs:
            running = wait_one(running, failed)
        log = (args.parts / f"{name}.log").open("w")
        print(f"running {name} ({modes}) -> {args.parts / name}.jsonl", flush=True)
        process = subprocess.Popen(bench_command(args, args.parts / f"{name}.jsonl", modes, helper), env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
        running.append((name, process, log))
    while running:
        running = wait_one(running, failed)
    minutes = (time.perf_counter() - started) / 60
    if failed:
        raise SystemExit(f"Error: {', '.join(failed)} failed (see their .log in {args.parts}); rerun to resume")
    rows = [row for name, _, _ in jobs for row in read_rows(args.parts / f"{name}.jsonl")]
    text = "".join(json_line(row) for row in rows)
    write_output(args.out, compressed_output(args.out, text.encode("utf-8")), "--out")
    print(f"{len(rows)} rows in {args.out} ({minutes:.1f} min this run)")
    if args.figure:
        draw(rows, args.figure)


def json_line(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False) + "\n"


def wait_one(running: list, failed: list[str]) -> list:
    """Waits until one of the running jobs ends; returns the others."""
    while True:
        for item in running:
            name, process, log = item
            if process.poll() is not None:
                log.close()
                if process.returncode:
                    failed.append(name)
                print(f"{name} done (exit {process.returncode})", flush=True)
                return [other for other in running if other is not item]
        time.sleep(2)


def helper_kinds(models: Path = ROOT / "models/toy") -> dict[str, str]:
    """How each toy helper was made weak, by file name, from the train.json the trainer writes beside it (the shipped
    helper's, written before blind spots were recorded, has the default's)."""
    kinds = {}
    for log in models.rglob("train.json"):
        for name, entry in json.loads(log.read_text()).items():
            if name.startswith("helper"):
                spot = entry.get("blind_spot", sorted(HELPER_BLIND_SPOT))
                kinds[f"{name}.gguf"] = f"blind spot {','.join(map(str, spot))}" if spot else "no blind spot"
    return kinds


def draw(rows: list[dict], path: Path) -> None:
    points = regime_map(rows)
    if not recovery_by_helper(points, path, "KV-Rescue on the toy world, by the helper's strength (N = 1)",
                              references=(*CODER_POINTS, PAPER_POINT), kinds=helper_kinds()):
        raise SystemExit("Error: no map in these rows: they need full, bon, and helper and kvrescue rows of two helpers")
    print(f"figure written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("run", help="run the map (resumable), write the rows and the figure")
    make.add_argument("--helpers", nargs="+", required=True, help="the helpers' GGUF files (names of their own)")
    make.add_argument("--limit", type=int, default=300, help="the first LIMIT toy problems (seed 0)")
    make.add_argument("--budgets", default="32,48,64", help="comma-separated base KV budgets")
    make.add_argument("--jobs", type=int, default=2, help="bench processes at once, one llama.cpp thread each")
    make.add_argument("--parts", type=Path, default=Path("results/parts/regime-map"),
                      help="one results file and log per helper (and one for full KV and best-of-N)")
    make.add_argument("--out", type=Path, required=True, help="every row, one file (.zst: compressed)")
    make.add_argument("--figure", type=Path, help="also write the figure here (a .png)")
    redraw = commands.add_parser("figure", help="the figure from a results file")
    redraw.add_argument("results", type=Path)
    redraw.add_argument("--out", type=Path, required=True, help="the .png to write")
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    else:
        draw(load_results(args.results), args.out)


if __name__ == "__main__":
    main()
