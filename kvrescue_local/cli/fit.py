"""`kvrescue-local fit`: a preset folder for any GGUF pair, fitted on training problems in one command
(kvrescue_local/prmtrain/fit_preset.py), or from rows already run (`--rows`)."""

from __future__ import annotations

import json
import sys
from datetime import date
from pathlib import Path

import click

from .. import interrupts
from ..compose import open_models, select_models
from ..detect import DetectorParams
from ..detect.calibrate import save_params
from ..errors import KVRescueError
from ..files import check_input_file, write_output
from ..presets import HELPER
from ..rescue import Mode
from ..settings import POSITIVE
from .common import SettingsCommand, note, setting_options
from .options import IntList

ONE_THREAD = 1  # each sweep runs llama.cpp on one thread: more processes share the cores without competing


class StageBars:
    """One progress bar per stage, on stderr; a stage's bar ends where the next one starts."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, label: str, total: int):
        self.close()
        self.bar = click.progressbar(length=total, label=label, file=sys.stderr)
        self.bar.__enter__()
        return self.bar.update

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def duration(seconds: float) -> str:
    minutes = seconds / 60
    return f"{seconds:.0f} s" if minutes < 2 else f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.1f} h"


@click.command("fit", cls=SettingsCommand)
@click.option("--base", help="the base model (evicted): a GGUF path")
@click.option("--helper", help="the helper model (full context): a GGUF path")
@click.option("--prm", help="a judge of the pair's own: PATH.gguf[:HEAD.npz] (a PRM) or helper:HEAD.npz (a head "
                            "trained on this helper) [default: a head on the helper's context, trained here]")
@click.option("--dataset", help="the training split of gsm8k or math500")
@click.option("--data", type=click.Path(dir_okay=False, path_type=Path),
              help="a JSONL file of training problems {id, problem, answer} (an evaluation problem of gsm8k or "
                   "math500 is refused)")
@click.option("--limit", type=POSITIVE, default=100, show_default=True, help="first LIMIT training problems")
@click.option("--budgets", type=IntList(), default="64,128", show_default=True,
              help="the base KV budgets the rule is fitted for (comma-separated)")
@setting_options("max_tokens", "kv.policy", "seed")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="the preset folder written (and its rows/, which a stopped run resumes from)")
@click.option("--rows", type=click.Path(dir_okay=False, path_type=Path), multiple=True,
              help="fit from results files already run (`bench run --split train`), running nothing; repeat it")
@click.option("--judge-rows", type=click.Path(dir_okay=False, path_type=Path), multiple=True,
              help="with --rows: the rollouts the judge's head was trained on (`prm train --rollouts`); repeat it")
@click.option("--detector-stats", type=click.Path(dir_okay=False, path_type=Path), multiple=True,
              help="with --rows: the detector's statistics lines (a fit's rows/detector.jsonl); repeat it")
def fit(base, helper, prm, dataset, data, limit, budgets, max_tokens, policy, seed, out, rows, judge_rows,
        detector_stats) -> None:
    """Fit a preset for a base and a helper on training problems: the detector's thresholds, the judge (a head on
    the helper's context, unless --prm gives one) and the commit rule, written to the folder --out, which --preset
    loads. Sweeps run at one llama.cpp thread; Ctrl-C stops, and the same command resumes."""
    if rows:
        fit_rows(list(rows), list(judge_rows), list(detector_stats), out)
        return
    if judge_rows or detector_stats:
        raise KVRescueError("--judge-rows and --detector-stats go with --rows (fitting from rows already run)")
    if not base or not helper:
        raise KVRescueError("fit needs the pair: --base BASE.gguf --helper HELPER.gguf (or --rows FILES to fit from "
                            "rows already run)")
    if (dataset is None) == (data is None):
        raise KVRescueError("fit needs training problems: --dataset gsm8k|math500 (its training split) or --data "
                            "FILE.jsonl, one of them")
    if prm == HELPER:
        raise KVRescueError("--prm helper names no head: pass --prm helper:HEAD.npz (a head trained on this helper), "
                            "or leave --prm out and fit trains one")
    from ..prmtrain.fit_preset import (Fitter, Plan, check_own_folder, decode_rate, estimate_seconds,
                                       training_problems)

    for option, path in (("--base", base), ("--helper", helper), ("--data", data)):
        if path is not None:
            check_input_file(path, option, "pass an existing file")
    problems = training_problems(dataset, data, limit)
    options = {"base": base, "helper": helper, "prm": prm, "threads": ONE_THREAD, "max_tokens": max_tokens,
               "policy": policy, "seed": seed, "preset": None}
    selection = select_models(options, True, True, needs_prm=prm is not None, note=note)
    resuming = (out / "rows").is_dir() and any(path.name != "pair.json" for path in (out / "rows").iterdir())
    check_own_folder(out, selection.paths)
    template = selection.config(options, mode=Mode.KVRESCUE, n=1, kv={"budget": max(budgets)})
    template, models = open_models(selection, template, True, True, 2 if prm else 1,
                                   [p.problem for p in problems.problems])
    plan = Plan(out, problems, tuple(sorted(budgets)), template, prm)
    seconds = estimate_seconds(plan, decode_rate(models.base, ONE_THREAD), decode_rate(models.helper, ONE_THREAD))
    click.echo(f"fitting {out} on {len(problems.problems)} {problems.label} training problems, budgets "
               f"{', '.join(map(str, plan.budgets))}: estimated wall time {duration(seconds)} at one thread (every "
               f"trajectory run to the {template.max_tokens}-token cap at the decode rates measured now, most end "
               f"sooner; the judge's training comes on top){'; resuming from ' + str(plan.rows) if resuming else ''}")
    bars = StageBars()
    try:
        record = Fitter(plan, selection, models, say=lambda line: (bars.close(), click.echo(line)),
                        progress=bars).run()
    except KeyboardInterrupt:
        bars.close()
        click.echo(f"\ninterrupted: the rows so far stay in {plan.rows}; the same command resumes from them",
                   err=True)
        sys.exit(interrupts.INTERRUPTED)
    finally:
        bars.close()
    click.echo(f"wrote {out}: preset.json (fitted on {record['problems']['count']} problems, {record['date']}), "
               f"detector.json, commit.json{', helper.head.npz' if prm is None else ''}; run it with --preset {out}")


def fit_rows(rows: list[Path], judge_rows: list[Path], detector_stats: list[Path], out: Path) -> None:
    """commit.json (and detector.json, from --detector-stats) fitted on rows already run, written to --out."""
    from ..prmtrain.detector import fit_detector, read_stats
    from ..prmtrain.rules_file import fit_rules, rows_in
    from ..presets import FITTED

    for option, paths in (("--rows", rows), ("--judge-rows", judge_rows), ("--detector-stats", detector_stats)):
        for path in paths:
            check_input_file(path, option, "pass a results file")
    rows_of = {path: rows_in(path, "results files of `bench run --split train`") for path in rows}
    judged = {path: rows_in(path, "to --judge-rows the rollouts the judge's head was trained on")
              for path in judge_rows}
    commit = fit_rules(rows_of, judged, say=click.echo)
    detector = fit_detector(read_stats(detector_stats), DetectorParams(), say=click.echo) if detector_stats else None
    out.mkdir(parents=True, exist_ok=True)
    write_output(out / "commit.json", json.dumps(commit, indent=2) + "\n", "--out")
    written = ["commit.json"]
    if detector is not None:
        save_params(detector, out / "detector.json")
        written.append("detector.json")
    all_rows = [row for found in rows_of.values() for row in found]
    seen: dict[str, dict] = {}
    for row in all_rows:  # the models by the fingerprints the rows recorded (rows of several files: each once)
        for role, entry in sorted(((row.get("setup") or {}).get("models") or {}).items()):
            if isinstance(entry, dict) and entry.get("sha256"):
                seen.setdefault(role, {})[entry["sha256"]] = {"file": entry.get("file"), "sha256": entry["sha256"]}
    models = {role: next(iter(found.values())) if len(found) == 1 else list(found.values())
              for role, found in seen.items()}
    record = {"models": models, "problems": {"dataset": sorted({str(r.get("dataset")) for r in all_rows}),
                                             "count": len({(r.get("dataset"), r.get("id")) for r in all_rows})},
              "budgets": sorted({int((r.get("config") or {}).get("budget") or 0) for r in all_rows} - {0}),
              "date": date.today().isoformat(), "rows": [p.name for p in rows]}
    spec = out / "preset.json"  # a preset's own (note, prompt, recipe) stays: the record is laid beside them
    kept = json.loads(spec.read_text()) if spec.is_file() else {"note": "fitted by `kvrescue-local fit --rows`"}
    write_output(spec, json.dumps({**kept, FITTED: record}, indent=1) + "\n", "--out")
    click.echo(f"rule: {commit['rule']}")
    if detector is not None:
        click.echo(f"detector: entropy {detector.tau_entropy} nats, zstd {detector.tau_compression}")
    click.echo(f"wrote {', '.join(written)} and preset.json to {out}")
