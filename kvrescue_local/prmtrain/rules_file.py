"""A preset's commit.json from rows of training problems: per dataset, the regime's budget (regime.py, from evicted
best-of-N and helper-alone rows at N = 1) and the calibration, margin and arithmetic check (commit.py, from
KV-Rescue rows with the judge choosing), written as rule specs beside what they were fitted on ("fit");
`kvrescue-local fit` writes it, and perf/fit_commit.py calls it.

A pair whose evicted base solved at least as many training problems as the helper alone at every measured budget of
every dataset is one KV-Rescue cannot help: its rule is base-first (`lead:base`), which never lets the helper's
step in, so the loop does not make the base worse than its own best-of-N.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..bench.results_file import read_rows
from ..errors import KVRescueError
from ..rescue.rules import parse_rule
from .commit import fit
from .regime import default_rule, fit_regime, regime_rule, rule_parameters

BASE_FIRST = "lead:base"  # the rule of a pair the helper cannot help (see above)


def rows_in(path: Path, what: str) -> list[dict]:
    """A results file's rows; a missing or empty file is an error (read_rows gives nothing for it, as a sweep about to
    start one needs), which would otherwise fit on less than was meant without a word."""
    rows = read_rows(path)
    if not rows:
        raise KVRescueError(f"{path} holds no rows: pass {what}")
    return rows


def mode_of(row: dict) -> str | None:
    return (row.get("config") or {}).get("mode")


def kvrescue_of(dataset: str, rows: list[dict]) -> list[dict]:
    """The KV-Rescue rows of one dataset."""
    return [r for r in rows if str(r.get("dataset")) == dataset and mode_of(r) == "kvrescue"]


def fit_rules(rows_of: dict[Path, list[dict]], judge_rows_of: dict[Path, list[dict]], stored: dict | None = None,
              say: Callable[[str], None] = lambda line: None) -> dict:
    """commit.json's content fitted on the rows of each results file (`rows_of`); `judge_rows_of`: the rows the
    judge's head was trained on (the datasets whose steps they hold calibrate it into `calibrated`); `stored`: a
    commit.json whose fitted parameters the new ones are laid over. `say` hears what was fitted."""
    stored = stored or {}
    judged = {str(r.get("dataset")) for rows in judge_rows_of.values() for r in rows}
    paths = list(rows_of)
    where = ", ".join(map(str, paths))
    fitted_on = dict(stored.get("fit", {}))
    rule = rule_parameters(parse_rule(stored["rule"])) if "rule" in stored else {}
    datasets = {name: rule_parameters(parse_rule(spec)) for name, spec in (stored.get("datasets") or {}).items()}
    rows = [row for path in paths for row in rows_of[path]]
    modes = {mode_of(r) for r in rows}
    if not modes & {"kvrescue", "bon"}:
        raise KVRescueError(f"{where} hold no KV-Rescue or evicted best-of-N rows to fit on: pass results of "
                            "`bench run --split train` (docs/prm.md)")
    for dataset in sorted({str(r.get("dataset")) for r in rows if mode_of(r) == "kvrescue"}):
        result = fit(kvrescue_of(dataset, rows), f"{where} ({dataset})")
        base_slope, base_bias, helper_slope, helper_bias = result.calibration
        say(f"{dataset}: {result.rounds} scored rounds with a base and a helper survivor, of {result.problems} "
            "training problems")
        for source, (steps, right) in result.steps.items():
            say(f"  committed {source} steps: {steps}, {right} in trajectories that ended right")
        say(f"  calibration: P(right) = sigmoid({base_slope:.3f} r + {base_bias:.3f}) for the base, "
            f"sigmoid({helper_slope:.3f} r + {helper_bias:.3f}) for the helper")
        say(f"  base-first helper margin: {result.helper_margin}")
        (false_steps, false_right), (true_steps, true_right) = result.arithmetic["false"], result.arithmetic["true"]
        say(f"  committed steps stating false arithmetic: {false_steps}, {false_right} right; the others: "
            f"{true_steps}, {true_right} right: the arithmetic check {'on' if result.check_arithmetic else 'off'}")
        datasets[dataset] = {**datasets.get(dataset, {}), **result.rule()}
        fitted_on.setdefault("calibration", {})[dataset] = {
            "rows": [p.name for p in paths if kvrescue_of(dataset, rows_of[p])],
            "head_sha256": result.head, "problems": result.problems, "rounds": result.rounds,
            "steps": {k: list(v) for k, v in result.steps.items()},
            "arithmetic": {k: list(v) for k, v in result.arithmetic.items()}}
    base_first = False
    if "bon" in modes:
        calibrated = {dataset for dataset, fitted in datasets.items() if "calibration" in fitted}
        regimes = fit_regime(rows, where, judged, calibrated)
        for regime in regimes:
            say(f"{regime.dataset}: {regime.weak_base_choice} up to budget {regime.judge_max_budget} (evicted "
                "best-of-N / helper alone, solved of the training problems both ran)")
            for s in regime.scores:
                say(f"  budget {s.budget}: {s.evicted} / {s.helper} of {s.problems}"
                    f"{'  (the base is the weaker)' if s.base_weaker else ''}")
            datasets[regime.dataset] = {**datasets.get(regime.dataset, {}), **regime.rule()}
            fitted_on.setdefault("regime", {})[regime.dataset] = {
                "rows": [p.name for p in paths if any(str(r.get("dataset")) == regime.dataset for r in rows_of[p])],
                "budgets": {str(s.budget): [s.problems, s.evicted, s.helper] for s in regime.scores},
                "judge_rows": [p.name for p in judge_rows_of]}
        rule.update(default_rule(datasets.values()))
        base_first = all(r.judge_max_budget == 0 for r in regimes)
        if base_first:
            say(f"the helper alone solved no more than evicted best-of-N at every budget measured: KV-Rescue will "
                f"not beat best-of-N for this pair, so the rule is base-first ({BASE_FIRST}: the helper's step never "
                "comes in)")
        else:
            say(f"default (no dataset): {rule['weak_base_choice']} up to budget {rule['judge_max_budget']}")
    specs = {name: BASE_FIRST if base_first else regime_rule(**params).spec for name, params in datasets.items()}
    return {"rule": BASE_FIRST if base_first else regime_rule(**rule).spec, **({"datasets": specs} if specs else {}),
            "fit": fitted_on}
