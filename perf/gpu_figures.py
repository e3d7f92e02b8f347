#!/usr/bin/env python3
"""The figures a GPU decides, each a ratio of runs measured side by side in one process, as one table.

perf/gpu_check.sh runs each part in a process of its own, with a time limit, each appending its rows to
--rows (JSON lines) as it measures them; then --render turns whatever rows there are into the table
(text, and JSON with --json), so a part that crashed or ran out of time costs its own rows only.

Parts, with --n-gpu-layers of each model offloaded:
  decode    tokens/s of 8 candidates in one batch against one llama_decode each (perf/decode_perf.py), on
            --base and --helper, flash attention off and on;
  eviction  4 sequences x --tokens on --base, side by side: full KV, R-KV per (layer, KV head) and R-KV with
            one shared set, at B = 64 and 256, with the share of wall time spent evicting and compacting
            (perf/eviction_perf.py); --flash-attn off or on;
  toy       KV-Rescue N = 8 (budget 64) on the toy preset, problems/min at K = 1, 8 and 16 problems at once
            (perf/concurrency_perf.py), flash attention on.

Usage: python3 perf/gpu_figures.py --part decode|eviction|toy --rows ROWS.jsonl [--base M.gguf] [--helper M.gguf]
                                   [--flash-attn off|on] [--steps 100] [--tokens 2000] [--problems 16]
                                   [--n-gpu-layers 99]
       python3 perf/gpu_figures.py --failed PART --reason TEXT --rows ROWS.jsonl
       python3 perf/gpu_figures.py --render --rows ROWS.jsonl [--table T.txt] [--json T.json] [--meta KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvrescue_local.files import write_output

PARTS = ("decode", "eviction", "toy")
BUDGETS = (64, 256)
POLICIES = (("rkv", "R-KV per head"), ("rkv:heads=shared", "R-KV shared"))
KS = (1, 8, 16)
COLUMNS = (("figure", "figure"), ("configuration", "configuration"), ("measured", "measured"),
           ("reference", "reference"), ("ratio", "ratio"), ("eviction", "evicting"), ("compaction", "compacting"),
           ("goal", "goal"))


def row(part: str, figure: str, configuration: str, value: float, unit: str, reference: float | None = None,
        versus: str = "", goal: str = "-", evicting: float | None = None, compacting: float | None = None) -> dict:
    """One measured line of the table: value against its reference (measured in the same process)."""
    return {"part": part, "figure": figure, "configuration": configuration, "value": round(value, 2), "unit": unit,
            "reference": None if reference is None else round(reference, 2), "versus": versus,
            "ratio": None if not reference else round(value / reference, 3), "goal": goal,
            "evicting_share": None if evicting is None else round(evicting, 4),
            "compacting_share": None if compacting is None else round(compacting, 4)}


def decode_rows(models: dict[str, Path], args: argparse.Namespace):
    import decode_perf

    from kvrescue_local.runtime import Model

    for role, path in models.items():
        model = Model(path, n_gpu_layers=args.n_gpu_layers)
        print(f"{role}: {model.describe()}", flush=True)
        for flash_attn in ("off", "on"):
            batched, sequential = decode_perf.batched_and_sequential(model, args.steps, flash_attn)
            yield row("decode", f"decode, {decode_perf.N_CANDIDATES} candidates batched", f"{role}, FA {flash_attn}",
                      batched, "tokens/s", sequential, "sequential", ">= 3x")
        del model


def eviction_rows(models: dict[str, Path], args: argparse.Namespace):
    import eviction_perf

    from kvrescue_local.eviction import KVBudget
    from kvrescue_local.runtime import Model

    model = Model(models["base"], n_gpu_layers=args.n_gpu_layers)
    print(f"base: {model.describe()}; {eviction_perf.N_SEQ} sequences x {args.tokens} tokens, FA {args.flash_attn}",
          flush=True)
    budgets = [KVBudget(budget=b, policy=policy) for policy, _ in POLICIES for b in BUDGETS]
    full, *evicted = eviction_perf.side_by_side(model, eviction_perf.ledger_prompt(model), args.tokens,
                                                [(None, "f16"), *((b, "f16") for b in budgets)],
                                                flash_attn=args.flash_attn)
    figure = f"decode, {eviction_perf.N_SEQ} x {args.tokens} tokens"
    yield row("eviction", figure, f"full KV, FA {args.flash_attn}", full.rate, "tokens/s")
    names = dict(POLICIES)
    for budget, run in zip(budgets, evicted):
        yield row("eviction", figure, f"{names[budget.policy]} B = {budget.budget}, FA {args.flash_attn}", run.rate,
                  "tokens/s", full.rate, "full KV", ">= 0.95x", run.evicting / run.seconds,
                  run.seqs.compaction_seconds / run.seconds)


def toy_rows(args: argparse.Namespace):
    import concurrency_perf

    options = concurrency_perf.parser().parse_args(
        ["--presets", "toy", "--problems", str(args.problems), "-n", "8", "--budget", "64",
         "--n-gpu-layers", str(args.n_gpu_layers)])
    setup = concurrency_perf.open_setup("toy", options, args.problems)
    one = None
    for k in KS:
        run = concurrency_perf.solve(setup, k, "on", None)
        per_minute = 60 * len(setup.dataset.problems) / run.wall
        one = one or per_minute
        yield row("toy", "toy KV-Rescue N = 8, B = 64", f"K = {k}, FA on (outside llama.cpp {100 * run.outside_share:.0f}% "
                  f"of wall, accuracy {run.accuracy:.0f}%)", per_minute, "problems/min", one, "K = 1",
                  ">= 3x" if k == 8 else "-")


def measure(args: argparse.Namespace) -> int:
    models = {role: path for role, path in (("base", args.base), ("helper", args.helper)) if path}
    if args.part != "toy" and "base" not in models:
        raise SystemExit(f"Error: --part {args.part} needs --base (perf/gpu_models.py writes one)")
    rows = {"decode": lambda: decode_rows(models, args), "eviction": lambda: eviction_rows(models, args),
            "toy": lambda: toy_rows(args)}[args.part]()
    for line in rows:  # each row kept as soon as it is measured: a later crash or time-out loses only the rest
        with args.rows.open("a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")
        print(f"  {line['figure']} | {line['configuration']}: {cells(line)['measured']} ({cells(line)['ratio']})",
              flush=True)
    return 0


def share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def cells(line: dict) -> dict[str, str]:
    if "failed" in line:
        return {"figure": line["part"], "configuration": "-", "measured": f"not measured: {line['failed']}",
                "reference": "-", "ratio": "-", "eviction": "-", "compaction": "-", "goal": "-"}
    reference = "-" if line["reference"] is None else f"{line['versus']} {line['reference']:,.1f}"
    return {"figure": line["figure"], "configuration": line["configuration"],
            "measured": f"{line['value']:,.1f} {line['unit']}", "reference": reference,
            "ratio": "-" if line["ratio"] is None else f"{line['ratio']:.2f}x", "eviction": share(line["evicting_share"]),
            "compaction": share(line["compacting_share"]), "goal": line["goal"]}


def table(lines: list[dict], meta: dict[str, str]) -> str:
    body = [cells(line) for line in lines]
    header = {key: title for key, title in COLUMNS}
    widths = {key: max(len(r[key]) for r in [header, *body]) for key, _ in COLUMNS}

    def text(r: dict[str, str]) -> str:
        return "  ".join(r[key].ljust(widths[key]) for key, _ in COLUMNS).rstrip()

    out = [f"{key}: {value}" for key, value in meta.items()]
    out += [text(header), "  ".join("-" * widths[key] for key, _ in COLUMNS), *map(text, body)]
    return "\n".join(out) + "\n"


def render(args: argparse.Namespace) -> int:
    lines = []
    if args.rows.exists():
        lines = [json.loads(text) for text in args.rows.read_text(encoding="utf-8").splitlines() if text.strip()]
    meta = dict(item.split("=", 1) for item in args.meta)
    text = table(lines, meta)
    print(text, end="")
    if args.table:
        write_output(args.table, text, "--table")
    if args.json:
        write_output(args.json, json.dumps({"meta": meta, "rows": lines}, indent=1) + "\n", "--json")
    return 0 if lines and not any("failed" in line for line in lines) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, help="measure this part, appending its rows to --rows")
    parser.add_argument("--failed", choices=PARTS, help="record that this part measured nothing more (--reason)")
    parser.add_argument("--reason", default="failed", help="why --failed's part stopped")
    parser.add_argument("--render", action="store_true", help="print the table of --rows")
    parser.add_argument("--rows", type=Path, required=True, help="the rows, one JSON object a line")
    parser.add_argument("--base", type=Path, help="the base model (perf/gpu_models.py's base.gguf)")
    parser.add_argument("--helper", type=Path, help="the helper model (perf/gpu_models.py's helper.gguf)")
    parser.add_argument("--n-gpu-layers", "-ngl", type=int, default=99, help="layers of each model offloaded")
    parser.add_argument("--flash-attn", choices=("off", "on"), default="off", help="the eviction part's")
    parser.add_argument("--steps", type=int, default=100, help="decode steps of the batched-vs-sequential figure")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per sequence of the eviction figure")
    parser.add_argument("--problems", type=int, default=16, help="toy problems solved at each K")
    parser.add_argument("--table", type=Path, help="with --render: also write the table to this file")
    parser.add_argument("--json", type=Path, help="with --render: also write the rows and --meta as JSON here")
    parser.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                        help="with --render: a line above the table (the machine, the build, the tests)")
    args = parser.parse_args()
    if sum(map(bool, (args.part, args.failed, args.render))) != 1:
        parser.error("give one of --part, --failed and --render")
    if args.failed:
        with args.rows.open("a", encoding="utf-8") as out:
            out.write(json.dumps({"part": args.failed, "failed": args.reason}) + "\n")
        return 0
    return render(args) if args.render else measure(args)


if __name__ == "__main__":
    sys.exit(main())
