#!/usr/bin/env python3
"""Fit the commit rules' parameters on rows of training problems, and store them with a preset:
- from KV-Rescue rows with the PRM choosing (`bench run --split train --modes kvrescue --ns 1`): the `calibrated`
  rule's per-source calibration and `lead:base`'s margin, per dataset (kvrescue_local/prmtrain/commit.py);
- from evicted best-of-N and helper-alone rows at N = 1 (`bench run --split train --modes bon,helper --ns 1
  --budgets ...`): the budget of `by-budget`, per dataset (kvrescue_local/prmtrain/regime.py), which makes that
  rule the preset's default; below it the judge's pick, calibrated, on the datasets both of the rows the
  judge was trained on (--judge-rows, the rollouts `prm train` read) and of a calibration (fitted here, or stored in
  the --write file), the helper's step first on the others.
A row of an evaluation problem is refused. With --write, the fitted parameters are laid over those of the rule specs
the file holds, and the specs written back (prmtrain/regime.py: regime_rule).

Usage:
  python3 perf/fit_commit.py ROWS.jsonl [more.jsonl ...] [--judge-rows ROLLOUTS.jsonl ...] [--write models/coder/commit.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvrescue_local.bench.results_file import read_rows
from kvrescue_local.errors import KVRescueError
from kvrescue_local.prmtrain.commit import fit
from kvrescue_local.prmtrain.regime import default_rule, fit_regime, regime_rule, rule_parameters
from kvrescue_local.rescue.rules import parse_rule


def kvrescue_of(dataset: str, rows: list[dict]) -> list[dict]:
    """The KV-Rescue rows of one dataset."""
    return [r for r in rows if str(r.get("dataset")) == dataset and (r.get("config") or {}).get("mode") == "kvrescue"]


def rows_in(path: Path, what: str) -> list[dict]:
    """A results file's rows; a missing or empty file is an error (read_rows gives nothing for it, as a sweep about to
    start one needs), which would otherwise fit on less than was meant without a word."""
    rows = read_rows(path)
    if not rows:
        raise KVRescueError(f"{path} holds no rows: pass {what}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", type=Path, nargs="+", help="results files of training problems")
    parser.add_argument("--write", type=Path, help="store the fitted rule here (a preset's commit.json)")
    parser.add_argument("--judge-rows", type=Path, nargs="+", default=[],
                        help="the rollouts the judge's head was trained on (`prm train --rollouts`)")
    args = parser.parse_args()
    where = ", ".join(map(str, args.rows))
    try:
        stored = json.loads(args.write.read_text()) if args.write and args.write.exists() else {}
    except (OSError, ValueError) as exc:
        sys.exit(f"Error: cannot read {args.write} ({exc}): restore it from the repository or remove it")
    fitted_on = dict(stored.get("fit", {}))
    try:
        rule = rule_parameters(parse_rule(stored["rule"])) if "rule" in stored else {}
        datasets = {name: rule_parameters(parse_rule(spec)) for name, spec in (stored.get("datasets") or {}).items()}
        rows_of = {path: rows_in(path, "results files of `bench run --split train`") for path in args.rows}
        rows = [row for path in args.rows for row in rows_of[path]]
        modes = {(r.get("config") or {}).get("mode") for r in rows}
        if not modes & {"kvrescue", "bon"}:
            raise KVRescueError(f"{where} hold no KV-Rescue or evicted best-of-N rows to fit on: pass results of "
                                "`bench run --split train` (see the usage above)")
        if "kvrescue" in modes:
            for dataset in sorted({str(r.get("dataset")) for r in rows if (r.get("config") or {}).get("mode") == "kvrescue"}):
                result = fit(kvrescue_of(dataset, rows), f"{where} ({dataset})")
                base_slope, base_bias, helper_slope, helper_bias = result.calibration
                print(f"{dataset}: {result.rounds} scored rounds with a base and a helper survivor, of {result.problems} "
                      "training problems")
                for source, (steps, right) in result.steps.items():
                    print(f"  committed {source} steps: {steps}, {right} in trajectories that ended right")
                print(f"  calibration: P(right) = sigmoid({base_slope:.3f} r + {base_bias:.3f}) for the base, "
                      f"sigmoid({helper_slope:.3f} r + {helper_bias:.3f}) for the helper")
                print(f"  base-first helper margin: {result.helper_margin}")
                (false_steps, false_right), (true_steps, true_right) = (result.arithmetic["false"],
                                                                        result.arithmetic["true"])
                check = "on" if result.check_arithmetic else "off"
                print(f"  committed steps stating false arithmetic: {false_steps}, {false_right} right; the others: "
                      f"{true_steps}, {true_right} right: the arithmetic check {check}")
                datasets[dataset] = {**datasets.get(dataset, {}), **result.rule()}
                fitted_on.setdefault("calibration", {})[dataset] = {
                    "rows": [p.name for p in args.rows if kvrescue_of(dataset, rows_of[p])],
                    "head_sha256": result.head, "problems": result.problems, "rounds": result.rounds,
                    "steps": {k: list(v) for k, v in result.steps.items()},
                    "arithmetic": {k: list(v) for k, v in result.arithmetic.items()}}
        if "bon" in modes:
            judged = {str(r.get("dataset")) for path in args.judge_rows
                      for r in rows_in(path, "to --judge-rows the rollouts the judge's head was trained on")}
            calibrated = {dataset for dataset, fitted in datasets.items() if "calibration" in fitted}
            regimes = fit_regime(rows, where, judged, calibrated)
            for regime in regimes:
                print(f"{regime.dataset}: {regime.weak_base_choice} up to budget {regime.judge_max_budget} (evicted "
                      "best-of-N / helper alone, solved of the training problems both ran)")
                for s in regime.scores:
                    print(f"  budget {s.budget}: {s.evicted} / {s.helper} of {s.problems}"
                          f"{'  (the base is the weaker)' if s.base_weaker else ''}")
                datasets[regime.dataset] = {**datasets.get(regime.dataset, {}), **regime.rule()}
                fitted_on.setdefault("regime", {})[regime.dataset] = {
                    "rows": [p.name for p in args.rows if any(str(r.get("dataset")) == regime.dataset for r in rows_of[p])],
                    "budgets": {str(s.budget): [s.problems, s.evicted, s.helper] for s in regime.scores},
                    "judge_rows": [p.name for p in args.judge_rows]}
            rule.update(default_rule(datasets.values()))
            print(f"default (no dataset): {rule['weak_base_choice']} up to budget {rule['judge_max_budget']}")
    except KVRescueError as exc:
        sys.exit(f"Error: {exc}")
    if args.write:
        specs = {name: regime_rule(**params).spec for name, params in datasets.items()}
        args.write.write_text(json.dumps({"rule": regime_rule(**rule).spec, **({"datasets": specs} if specs else {}),
                                          "fit": fitted_on}, indent=2) + "\n")
        print(f"wrote {args.write}")


if __name__ == "__main__":
    main()
