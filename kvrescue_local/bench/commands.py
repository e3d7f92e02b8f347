"""`kvrescue-local bench`: run sweeps over datasets, merge shard results."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import KVRescueError
from ..eviction import POLICIES
from ..options import open_models, search_options, template_config
from ..rescue import MODES
from .datasets import DATASET_NAMES, load_problems
from .run import Models, merge_results, parse_shard, rescue_config, run_sweep, sweep_axes


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KVRescueError(f"expected comma-separated integers, not {text!r}") from None


def name_list(text: str, allowed, what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in allowed]
    if unknown or not names:
        raise KVRescueError(f"unknown {what} {', '.join(unknown) or repr(text)}: use {', '.join(sorted(allowed))}")
    return names


@click.group()
def bench() -> None:
    """Benchmarks over datasets, modes, budgets and N, with the paper's metrics."""


@bench.command("run")
@click.option("--dataset", default="math500", show_default=True, help=f"one of {', '.join(DATASET_NAMES)}")
@click.option("--data", type=click.Path(dir_okay=False, path_type=Path), help="a JSONL file of {id, problem, answer}")
@click.option("--limit", type=int, help="first LIMIT problems only")
@click.option("--modes", default="full,bon,kvrescue", show_default=True, help=f"comma-separated: {', '.join(MODES)}")
@click.option("--budgets", default="64", show_default=True, help="comma-separated base KV budgets")
@click.option("--ns", default="8", show_default=True, help="comma-separated candidates per model")
@click.option("--policies", default="rkv", show_default=True, help="comma-separated eviction policies")
@search_options
@click.option("--results", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="JSONL file the results are appended to")
@click.option("--resume", is_flag=True, help="continue RESULTS, skipping what is done")
@click.option("--shard", help="i/n: run the i-th of n interleaved slices (merge them with `bench merge`)")
@click.option("--offline", is_flag=True, help="use only the Hugging Face cache for hub datasets")
def run_command(dataset, data, limit, modes, budgets, ns, policies, results, resume, shard, offline, **options) -> None:
    """Run a sweep; one result line per problem and configuration, written as each finishes."""
    label, problems = load_problems(None if data else dataset, data, limit, offline=offline or None)
    axes = sweep_axes(name_list(modes, MODES, "mode"), int_list(budgets), int_list(ns),
                      name_list(policies, POLICIES, "policy"))
    template = template_config("kvrescue", 1, max(int_list(budgets)), "streaming", options)
    for axis in axes:
        rescue_config(axis, template)  # refuses a bad budget or policy before any model is loaded
    needs_base = any(a.mode != "helper" for a in axes)
    needs_helper = any(a.mode in ("helper", "kvrescue") for a in axes)
    most_candidates = max(rescue_config(axis, template).candidates_per_round for axis in axes)
    base, helper, prm = open_models(options, needs_base, needs_helper, most_candidates, [p.problem for p in problems])
    shard_index, shard_count = parse_shard(shard)
    total = len(range(shard_index, len(axes) * len(problems), shard_count))
    tally = {"done": 0, "correct": 0}

    def accuracy(_item=None) -> str:
        return f"acc {100 * tally['correct'] / tally['done']:.1f}%" if tally["done"] else ""

    with click.progressbar(length=total, label=f"{label}: {len(axes)} configurations", item_show_func=accuracy) as bar:
        def on_result(line: dict) -> None:
            tally["done"] += 1
            tally["correct"] += line["correct"]
            bar.update(1)

        try:
            written = run_sweep(label, problems, axes, template, Models(base, helper, prm), results, resume,
                                (shard_index, shard_count), on_result=on_result, on_skip=bar.update)
        except KeyboardInterrupt:
            click.echo(f"\ninterrupted: {tally['done']} results kept in {results}; continue with --resume", err=True)
            raise SystemExit(130)
    click.echo(f"{written} new results in {results} ({accuracy() or 'nothing new to run'})")


@bench.command("merge")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
def merge_command(inputs, out) -> None:
    """Merge shard result files into one, without duplicates."""
    click.echo(f"{merge_results(list(inputs), out)} results in {out}")
