"""`kvrescue-local prm`: train a value head for a preset's PRM backbone on the pair's own rollouts, and
evaluate it on held-out problems (kvrescue_local/prmtrain)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from .. import toy  # noqa: F401  (registers the toy dataset: --dataset toy)
from ..bench.datasets import dataset_names
from ..errors import KVRescueError
from ..files import check_appendable, check_input_file, check_not_read, file_hash
from ..prm import FORMATS
from ..rescue import MODES
from ..rescue.judge import HelperJudge
from ..settings import POSITIVE, SEED, THREADS
from .common import name_list, note
from .options import IntList


@click.group()
def prm() -> None:
    """A PRM for a preset: a value head on its PRM backbone, trained on step-labelled rollouts of its models."""


@prm.command("train")
@click.option("--preset", default="coder", show_default=True, help="whose models roll out and whose PRM backbone reads")
@click.option("--rollouts", type=click.Path(dir_okay=False, path_type=Path), multiple=True,
              help="results file of the rollouts, extended by stage 1 [default: the cache's "
                   "<preset>-<dataset>-train.jsonl]; repeat it to train on several (with --no-rollouts)")
@click.option("--no-rollouts", is_flag=True, help="skip stage 1: train on the files' rows as they are (another "
                                                  "process may be writing them)")
@click.option("--dataset", default="gsm8k", show_default=True, help=f"one of {', '.join(dataset_names())} (its training "
                                                                    "split where it has one)")
@click.option("--limit", type=POSITIVE, default=100, show_default=True, help="first LIMIT problems of the training split")
@click.option("--modes", default="full,bon,helper", show_default=True, help=f"comma-separated: {', '.join(MODES)}")
@click.option("--budgets", type=IntList(), default="64,128", show_default=True, help="comma-separated base KV budgets")
@click.option("--max-tokens", type=POSITIVE, default=768, show_default=True, help="trajectory length cap")
@click.option("--seed", "-s", type=SEED, default=0, show_default=True)
@click.option("--format", "fmt", type=click.Choice(sorted(FORMATS)), default="chat-value", show_default=True,
              help="how the backbone reads a trajectory (the head records it); helper-value: the helper's own context, "
                   "for `--prm helper`")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="the head file [default: where the preset reads it; coder: models/coder/prm.head.npz, with "
                   "--format helper-value models/coder/helper.head.npz]")
@click.option("--helper", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="with --format helper-value: the model whose context reads the steps [default: the preset's helper]; "
                   "another size's judge (needs --out)")
@click.option("--threads", "-t", type=THREADS, default=0, show_default=True, help="llama.cpp threads (0: KVRESCUE_THREADS, "
                                                                              "else physical cores - 1)")
def train_command(preset, rollouts, no_rollouts, dataset, limit, modes, budgets, max_tokens, seed, fmt, out,
                  helper, threads) -> None:
    """Roll out (resumable), read hidden states (cached), fit a value head in numpy, write it."""
    from ..prmtrain.fit import VALIDATION_SHARE
    from ..prmtrain.pipeline import (Rollouts, Stopwatch, evaluate, features, head_file, labelled_rows, open_backbone,
                                     run_rollouts, train)

    plan = Rollouts(dataset=dataset, limit=limit, modes=tuple(name_list(modes, MODES, "mode")),
                    budgets=tuple(budgets), max_tokens=max_tokens, seed=seed, threads=threads)
    if not rollouts:  # the project's own cache folder, made on first use
        plan.default_file(preset).parent.mkdir(parents=True, exist_ok=True)
    rollouts = list(rollouts) or [plan.default_file(preset)]
    if len(rollouts) > 1 and not no_rollouts:
        raise KVRescueError("stage 1 extends one rollouts file: pass one, merge them with `kvrescue-local bench merge`, "
                            "or add --no-rollouts to train on them as they are")
    for path in rollouts:  # stage 1 makes a missing one
        check_input_file(path, "--rollouts", "pass a results file (JSONL)", missing_ok=True)
    if not no_rollouts:
        check_appendable(rollouts[0], "--rollouts")
    if helper:  # checked before stage 1's rollouts, which use the preset's own models
        check_input_file(helper, "--helper", "pass the path of a .gguf model file")
    if helper and out is None:  # the preset's head file belongs to the preset's own helper
        raise KVRescueError(f"a head on {helper.name} needs --out FILE.head.npz: the {preset} preset's head file is "
                            "trained on its own helper")
    out = out or head_file(preset, fmt)
    check_not_read(out, "--out", [*(("--rollouts", path) for path in rollouts), ("--helper", helper)])
    clock = Stopwatch()
    if not no_rollouts:
        with click.progressbar(length=plan.rows, label="1/3 rollouts",
                               file=sys.stderr) as bar:
            written = run_rollouts(preset, plan, rollouts[0], on_result=lambda row: bar.update(1), on_skip=bar.update)
        click.echo(f"stage 1, rollouts: {written} new rows in {rollouts[0]}, {clock.lap():.0f} s")
    rows, steps, left_out = labelled_rows(rollouts, "train")
    check_rows(rows, rollouts, left_out, "`kvrescue-local prm train` without --no-rollouts rolls some out")
    click.echo(f"{len(rows)} rows ({left_out} left out: no trajectory record or an error), {len(steps)} labelled "
               f"steps ({sum(s.label for s in steps)} right) of {len({s.problem for s in steps})} problems")
    backbone = open_backbone(preset, threads, features_only=fmt, helper=helper, rows=rows)
    clock.lap()
    counts = {"cached": 0, "read": 0}
    with click.progressbar(length=len(rows), label="2/3 features", file=sys.stderr) as bar:
        def progress(cached: bool) -> None:
            counts["cached" if cached else "read"] += 1
            bar.update(1)

        hidden = features(backbone, rows, progress)
    seconds = clock.lap()
    rate = f", {seconds / counts['read']:.1f} s per row read" if counts["read"] else ""
    click.echo(f"stage 2, features: {counts['read']} rows read, {counts['cached']} cached, {seconds:.0f} s{rate}")
    fit = train(hidden, steps, fmt)
    seconds = clock.lap()
    for label, value in fit.validation.items():
        click.echo(f"  validation AUC {label:>16s}: {value:.3f}")
    # the file it was trained on (`--prm helper` refuses a head of another), and the helper's prompt
    dataclasses.replace(fit.head, backbone=file_hash(backbone.model.path),
                        prompt=backbone.prompt if isinstance(backbone, HelperJudge) else None).save(out)
    click.echo(f"stage 3, train: {fit.choice.label} on {fit.steps} steps ({fit.positives} right), training AUC "
               f"{fit.train_auc:.3f}, {seconds:.1f} s; wrote {out}")
    click.echo(f"cross-validated on the training problems ({VALIDATION_SHARE} folds by problem, {fit.choice.label}; "
               "training problems, not the evaluation split):")
    show(evaluate(fit.out_of_fold, steps))


@prm.command("eval")
@click.option("--rollouts", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True, multiple=True,
              help="results file of `bench run --split eval` (evaluation problems only); repeat it for several")
@click.option("--preset", default="coder", show_default=True, help="whose PRM (backbone and head) to evaluate")
@click.option("--head", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a head file [default: the preset's]")
@click.option("--helper", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="for a head read as held: the model it was trained on [default: the preset's helper]")
@click.option("--threads", "-t", type=THREADS, default=0, show_default=True)
def eval_command(rollouts, preset, head, helper, threads) -> None:
    """Step-level AUC and pairwise accuracy (right vs wrong step of one problem and round, by the wrong step's
    origin) on evaluation problems."""
    from ..prmtrain.pipeline import evaluate, features, labelled_rows, open_backbone

    for path in rollouts:
        check_input_file(path, "--rollouts", "pass a results file (JSONL)")
    rows, steps, left_out = labelled_rows(list(rollouts), "eval")
    check_rows(rows, rollouts, left_out, "pass the results of `bench run --split eval`")
    if left_out:
        note(f"{left_out} rows left out (no trajectory record or an error)")
    backbone = open_backbone(preset, threads, head=head, helper=helper, rows=rows)
    with click.progressbar(length=len(rows), label="features", file=sys.stderr) as bar:
        rewards = backbone.rewards(features(backbone, rows, lambda cached: bar.update(1)))
    click.echo(f"{len(rows)} rows of {len({s.problem for s in steps})} problems:")
    show(evaluate(rewards, steps))


def check_rows(rows: list[dict], files, left_out: int, fix: str) -> None:
    """Training and evaluation need rows: an empty, binary or foreign file is an error, not an AUC of nan."""
    if not rows:
        raise KVRescueError(f"{', '.join(map(str, files))} hold{'s' if len(files) == 1 else ''} no usable rows "
                            f"({left_out} without a trajectory record or with an error): {fix}")


def show(result) -> None:
    click.echo(f"{result.steps} labelled steps ({result.positives} right); step-level AUC {result.auc:.3f}")
    click.echo(f"{'wrong step from':>14s}  {'pairs':>6s}  {'problems':>8s}  {'right above wrong':>17s}  95% interval")
    for p in result.pairs:
        click.echo(f"{p.origin:>14s}  {p.pairs:6d}  {p.problems:8d}  {100 * p.accuracy:16.1f}%  "
                   f"{100 * p.low:.1f}-{100 * p.high:.1f}%")
    if not result.pairs:
        click.echo("no pairs: no problem has a right and a wrong trajectory (with different steps) at one round")
