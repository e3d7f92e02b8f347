#!/usr/bin/env python3
"""The figures a GPU decides, each a ratio of two runs measured side by side in this one run, as a table.

On the bundled toy models (the real ones do not travel to a lent GPU machine), with --n-gpu-layers of
each offloaded:
  - decode tokens/s of 8 candidates in one batch against one llama_decode each (perf/decode_perf.py),
    flash attention off and on;
  - R-KV at budget 64 against full KV, tokens/s of 4 sequences x --tokens (perf/eviction_perf.py);
  - KV-Rescue N = 8 (budget 64) problems/min at K = 1, 8 and 16 problems at once, K against K = 1, and the
    engine's share of wall time at K = 16 (perf/concurrency_perf.py; goals >= 3x at K = 8, <= 10%).

Usage: python3 perf/gpu_figures.py [--n-gpu-layers 99] [--steps 200] [--tokens 2000] [--problems 16]
                                   [--table PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import concurrency_perf
import decode_perf
import eviction_perf

from kvrescue_local.eviction import KVBudget
from kvrescue_local.files import write_output
from kvrescue_local.presets import load_preset
from kvrescue_local.runtime import Model
from kvrescue_local.runtime.lib import backends

RKV_BUDGET = 64
KS = (1, 8, 16)
Row = tuple[str, str, str, str]  # figure, what was measured, the ratio, its goal


def table(rows: list[Row]) -> str:
    header = ("figure", "measured", "ratio", "goal")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def batched_decode(base: Model, args: argparse.Namespace, flash_attn: str) -> list[Row]:
    batched, sequential = decode_perf.batched_and_sequential(base, args.steps, flash_attn)
    return [(f"decode, 8 candidates batched vs sequential, FA {flash_attn}",
             f"{batched:.0f} vs {sequential:.0f} tokens/s", f"{batched / sequential:.2f}x", ">= 3x")]


def rkv_decode(base: Model, args: argparse.Namespace) -> list[Row]:
    full, rkv = eviction_perf.side_by_side(base, eviction_perf.ledger_prompt(base), args.tokens,
                                           [(None, "f16"), (KVBudget(budget=RKV_BUDGET, policy="rkv"), "f16")])
    return [(f"decode, R-KV B = {RKV_BUDGET} vs full KV ({eviction_perf.N_SEQ} x {args.tokens} tokens)",
             f"{rkv.rate:.0f} vs {full.rate:.0f} tokens/s (eviction {100 * rkv.evicting / rkv.seconds:.1f}%, "
             f"compaction {100 * rkv.seqs.compaction_seconds / rkv.seconds:.2f}%)", f"{rkv.rate / full.rate:.2f}x",
             "near 1x")]


def problems_at_once(args: argparse.Namespace, flash_attn: str) -> list[Row]:
    options = concurrency_perf.parser().parse_args(
        ["--preset", "toy", "--problems", str(args.problems), "--ks", ",".join(map(str, KS)), "-n", "8",
         "--budget", "64", "--flash-attn", flash_attn, "--n-gpu-layers", str(args.n_gpu_layers)])
    runs = {}
    for row in concurrency_perf.measure(options):
        runs[row.k] = row
        print(f"  K = {row.k:2d}, FA {flash_attn}: {row.per_minute:.1f} problems/min, accuracy {row.accuracy:.1f}%, "
              f"wall {row.wall:.2f} s, engine {100 * row.outside_share:.1f}%", flush=True)
    one, last = runs[KS[0]].per_minute, runs[KS[-1]]
    rows = [(f"toy KV-Rescue N = 8, K = {k} vs K = 1 problems/min, FA {flash_attn}",
             f"{runs[k].per_minute:.1f} vs {one:.1f}", f"{runs[k].per_minute / one:.2f}x", ">= 3x" if k == 8 else "-")
            for k in KS[1:]]
    return rows + [(f"toy KV-Rescue N = 8, engine's share of wall time at K = {KS[-1]}, FA {flash_attn}",
                    f"{last.outside:.2f} of {last.wall:.2f} s", f"{100 * last.outside_share:.1f}%", "<= 10%")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-gpu-layers", "-ngl", type=int, default=99, help="layers of each model offloaded")
    parser.add_argument("--steps", type=int, default=200, help="decode steps of the batched-vs-sequential figure")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per sequence of the R-KV figure")
    parser.add_argument("--problems", type=int, default=16, help="toy problems solved at each K")
    parser.add_argument("--table", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    base = Model(load_preset("toy").base, n_gpu_layers=args.n_gpu_layers)
    print(f"toy base {base.describe()}, {args.n_gpu_layers} layers offloaded; backends "
          + ", ".join(f"{name} ({n} devices)" for name, n in backends()), flush=True)
    figures = [(f"decode batched vs sequential, FA {fa}", lambda fa=fa: batched_decode(base, args, fa)) for fa in ("off", "on")]
    figures.append(("decode R-KV vs full KV", lambda: rkv_decode(base, args)))
    figures += [(f"toy KV-Rescue by K, FA {fa}", lambda fa=fa: problems_at_once(args, fa)) for fa in ("off", "on")]
    rows, failed = [], 0
    for name, measure in figures:
        started = time.perf_counter()
        try:  # one figure's failure leaves the others measured
            new = measure()
        except Exception as exc:  # noqa: BLE001 - reported in the table, the run goes on
            failed += 1
            new = [(name, f"failed: {type(exc).__name__}: {exc}", "-", "-")]
        for row in new:
            print(f"  {row[0]}: {row[1]}, {row[2]}", flush=True)
        print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
        rows += new
    text = table(rows)
    print(text, end="")
    if args.table:
        write_output(args.table, text, "--table")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
