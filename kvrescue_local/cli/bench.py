"""`kvrescue-local bench`: run sweeps over datasets, merge shard results."""

from __future__ import annotations

from pathlib import Path

import click

from .. import toy  # noqa: F401  (registers the toy dataset: --dataset toy)
from ..bench.datasets import dataset_names, load_dataset
from ..bench.results_file import read_rows
from ..bench.run import Axis, cache_label, cache_types, merge_results, parse_shard, rescue_config, run_sweep, sweep_axes
from ..compose import (check_calibration_head, fit_defaults, fitted_rule, model_facts, open_model, open_models,
                       rule_needs_judge, rule_note, select_models)
from ..errors import KVRescueError
from ..hub import resolve_gguf
from ..quantize import WEIGHT_TYPES
from ..runtime.context import check_cache_types
from .models import quantized_with_progress
from ..files import check_appendable, check_input_file, check_writable
from ..rescue import MODES, Mode, longest_prompt
from ..rescue.limits import (GIB, available_memory, check_concurrency_fits, check_context_sizes, check_kv_sizes,
                             check_prompts_fit, largest_fitting, models_kv_memory)
from ..settings import POSITIVE, RULE, PolicySpecs
from .common import (DEFAULTS, FITTED_FOR_HELP, RULE_HELP, GroupedOption, SettingsCommand, name_list, note, parse_size,
                     search_options)
from .options import CacheTypeList, IntList, Names, check_cache_fit, check_prm_ctx

MODEL_OPTIONS = {"base": "--base", "helper": "--helper", "prm": "--prm", "prm_head": "the PRM's head"}
DEFAULT_CONCURRENCY_CAP = 16  # more problems at once than this rarely pays, and a default should stay modest


@click.group()
def bench() -> None:
    """Benchmarks over datasets, modes, budgets and N, with the paper's metrics."""


@bench.command("run", cls=SettingsCommand)
@click.option("--dataset", default="math500", show_default=True, help=f"one of {', '.join(dataset_names())}")
@click.option("--data", type=click.Path(dir_okay=False, path_type=Path), help="a JSONL file of {id, problem, answer}")
@click.option("--limit", type=POSITIVE, help="first LIMIT problems only")
@click.option("--skip", type=click.IntRange(min=0), default=0,
              help="start after the first SKIP problems (of the split): --skip 100 --limit 100 runs the next hundred")
@click.option("--split", type=click.Choice(["train", "eval"]),
              help="only the problems of a fixed split (gsm8k: ids 0-899 train, 900-1318 eval; math500: positions "
                   "250-499 train, 0-99 eval, 100-249 in neither)")
@click.option("--modes", default="full,bon,kvrescue", show_default=True, help=f"comma-separated: {', '.join(MODES)}")
@click.option("--budgets", type=IntList(), default=str(DEFAULTS.kv.budget), show_default=True, help="comma-separated base KV budgets")
@click.option("--ns", type=IntList(), default=str(DEFAULTS.n), show_default=True, help="comma-separated candidates per model")
@click.option("--policies", type=PolicySpecs(several=True), help="comma-separated eviction policy specs, e.g. rkv,snapkv or rkv:lam=0.1,kernel=5,h2o "
                                 f"[default: the preset's, else {DEFAULTS.kv.policy}]")
@click.option("--rule", "rules", type=RULE, multiple=True, cls=GroupedOption, group="rule",
              help=f"{RULE_HELP}; repeat it for a sweep, each rule a configuration of its own")
@click.option("--fitted-for", cls=GroupedOption, group="rule", help=FITTED_FOR_HELP)
@click.option("--bases", help="comma-separated base models (GGUF paths or owner/repo:FILE.gguf), a sweep axis "
                               "[default: --base, else the preset's]")
@click.option("--weight-types", type=Names(WEIGHT_TYPES, "weight type", several=True),
              help=f"comma-separated weight types ({', '.join(WEIGHT_TYPES)}), a sweep axis: each base at each type, "
                   "made from it once by `models quantize` into the model cache (a base of that type is used as is)")
@click.option("--allow-requantize", is_flag=True, help="let --weight-types quantize a base that is quantized already")
@click.option("--cache-types", type=CacheTypeList(),
              help="comma-separated KV cache types, a sweep axis: each TYPE (K and V) or K/V, llama.cpp's -ctk/-ctv "
                   "names, for the base and the helper (-ctkh/-ctvh fix the helper's) [default: -ctk/-ctv]")
@search_options(sweep=True)
@click.option("--results", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="JSONL file the results are appended to (plain text: not a .zst)")
@click.option("--resume", is_flag=True, help="continue RESULTS, skipping what is done")
@click.option("--shard", help="i/n: run the i-th of n interleaved slices (merge them with `bench merge`)")
@click.option("--offline", is_flag=True, help="use only the Hugging Face cache for hub datasets")
@click.option("--concurrency", "-k", type=POSITIVE,
              help=f"problems solved at once on one engine [default: on a GPU (-ngl > 0) the most that fit --memory, "
                   f"at most {DEFAULT_CONCURRENCY_CAP}; on a CPU 1, where more measured no faster (docs/throughput.md)]")
@click.option("--memory", help="memory the KV caches may take, e.g. 4G [default: half of the available memory]")
def run_command(dataset, data, limit, skip, split, modes, budgets, ns, policies, rules, fitted_for, bases, weight_types,
                allow_requantize, cache_types, results, resume, shard, offline, concurrency, memory, **options) -> None:
    """Run a sweep; one result line per problem and configuration, written as each finishes."""
    shard_index, shard_count = parse_shard(shard)
    check_writable(results, "--results", special=False, reads=[("--data", data)])
    check_appendable(results, "--results")
    data_set = load_dataset(None if data else dataset, data, limit, offline=offline or None, split=split, skip=skip)
    modes = [Mode(m) for m in name_list(modes, MODES, "mode")]
    needs_base = any(m.uses_base for m in modes)
    needs_helper = any(m.uses_helper for m in modes)
    most_sides = max(m.sides for m in modes)
    selection = select_models(options, needs_base, needs_helper, note=note,
                              needs_prm=most_sides * max(ns) > 1 and any(rule_needs_judge({"rule": r})
                                                                         for r in rules or [None]))
    fitted = fitted_for or (None if data else dataset)  # whose fitted rules apply: --data's problems are no dataset's
    template = selection.config({**options, "fitted_for": fitted_for}, fitted, mode=Mode.KVRESCUE, n=1,
                                kv={"budget": max(budgets)})
    template = fit_defaults(template, model_facts(selection, needs_base, needs_helper, 1), options, note)
    given = list(rules)
    rules = [fitted_rule(selection.preset, fitted, rule).spec for rule in given] or [template.rule.spec]
    caches = cache_axis(cache_types, template, options)

    def axes_of(weights: list[str]) -> list[Axis]:
        return sweep_axes(modes, budgets, ns, policies or [template.kv.policy], rules, weights, caches)

    # a configuration's rule does not depend on its base: checked before --weight-types quantizes anything
    check_calibration_head(selection, fitted, [rescue_config(axis, template) for axis in axes_of([""])])
    base_files = base_axis(bases, weight_types, allow_requantize, options, selection) if needs_base else {}
    check_writable(results, "--results", special=False,
                   reads=[*((MODEL_OPTIONS.get(role, role), path) for role, path in selection.paths.items()
                            if isinstance(path, Path)),  # not `--prm helper`'s name
                          *(("--bases", path) for path in base_files.values())])
    axes = axes_of(list(base_files) or [""])
    # refuses a bad budget, policy, N or cache type before any model is loaded
    configs = [rescue_config(axis, template) for axis in axes]
    candidates = max((c.candidates_per_round for c in configs if c.needs_prm), default=1)
    check_prm_ctx(template, options["prm_ctx"])
    allowed = parse_size(memory, "--memory") if memory else available_memory() // 2
    problems = [p.problem for p in data_set.problems]
    facts = model_facts(selection, needs_base, needs_helper, candidates)
    for config in configs:
        check_context_sizes(config, facts, allowed, f"the memory allowed (--memory {memory})" if memory else
                            "half of the available memory (--memory)", options["prm_ctx"],
                            max(len(p.encode()) for p in problems))
    named = {f"{data_set.label} problem {p.id}": p.problem for p in data_set.problems}
    template, models = open_models(selection, template, needs_base, needs_helper, candidates, problems,
                                   prompt_given=options["prompt_template"] is not None, prm_ctx=options["prm_ctx"],
                                   before_prm=lambda config, opened: check_prompts_fit(config, opened, named))
    base_models = {label: models.base if path == models.base.path else open_model(selection, template, path)
                   for label, path in base_files.items()}
    every_base = list(base_models.values()) or [models.base]
    for base in every_base:
        if base is not models.base:  # the one open_models opened is checked there
            check_prompts_fit(template, [base], named)
        check_cache_fit(configs, base, models.helper)
        if base is not None:
            check_kv_sizes(configs, base, longest_prompt(template, [base], problems))
    prompt_tokens = longest_prompt(template, [*every_base, models.helper], problems)

    def need(config, slots: int) -> int:
        return max(models_kv_memory(config, slots, base, models.helper, models.prm, prompt_tokens) for base in every_base)

    fits = largest_fitting(configs, allowed, need)
    check_concurrency_fits(configs, concurrency or 1, allowed, need)
    if concurrency is None:
        # on a CPU the attention over the other problems' cells outweighs what a shared batch saves, so problems
        # run in lanes of their own contexts (rescue/loop.py: problems_per_context): more at once measured no
        # faster than one (docs/throughput.md), and one holds the memory of one
        concurrency = min(fits, DEFAULT_CONCURRENCY_CAP) if template.n_gpu_layers else 1
    note(f"concurrency {concurrency} (at most {fits} fit in {allowed / GIB:.2f} GiB of KV memory; "
         f"{'' if template.n_gpu_layers else 'on a CPU the default is 1; '}--concurrency, --memory)")
    if concurrency > 1 and template.flash_attn != "on" and not template.n_gpu_layers:
        note("on a CPU with flash attention off each problem runs in contexts of its own, about as fast as one at a "
             "time; --flash-attn on lets a model whose weights outweigh the attention share one context (faster on "
             "the coder pair, docs/throughput.md), and with it a trajectory depends on its batch mates by rounding")
    for rule in rules:  # once all is checked
        note(rule_note(selection, rule, "--rule" if given else None, fitted_for, None if data else dataset))
    total = len(range(shard_index, len(axes) * len(data_set.problems), shard_count))
    tally = {"done": 0, "correct": 0}

    def accuracy(_item=None) -> str:
        return f"acc {100 * tally['correct'] / tally['done']:.1f}%" if tally["done"] else ""

    with click.progressbar(length=total, label=f"{data_set.label}: {len(axes)} configurations",
                           item_show_func=accuracy) as bar:
        def on_result(line: dict) -> None:
            tally["done"] += 1
            tally["correct"] += line["correct"]
            bar.update(1)

        try:
            written = run_sweep(data_set, axes, template, models, results, resume, (shard_index, shard_count),
                                concurrency, on_result=on_result, on_skip=bar.update, bases=base_models,
                                on_cut=lambda cut: click.echo(f"\ncut a partial last line ({cut} bytes, a crash "
                                                              f"mid-write) from {results}; its problem runs again",
                                                              err=True),
                                on_changed=lambda n: click.echo(f"\n{n} problem{'s' if n > 1 else ''} run again: the "
                                                                f"data's text or gold answer differs from what the "
                                                                f"rows of {results} solved", err=True))
        except KeyboardInterrupt:
            # counted in the file: Ctrl-C can land between a row's write and its count
            click.echo(f"\ninterrupted: {len(read_rows(results))} results kept in {results}; continue with --resume",
                       err=True)
            raise SystemExit(130)
    click.echo(f"{written} new results in {results} ({accuracy() or 'nothing new to run'})")


def cache_axis(labels: list[str] | None, template, options: dict) -> list[tuple[str, str]]:
    """(base, helper) cache labels of the sweep: --cache-types, else -ctk/-ctv; the helper's follow the base's unless
    -ctkh/-ctvh fix them. A quantized V without flash attention is refused here, before any model loads."""
    fixed = options.get("cache_type_k_helper") or options.get("cache_type_v_helper")
    helper = cache_label(*template.cache_types("helper"))
    out = []
    for label in labels or [cache_label(*template.cache_types("base"))]:
        if labels:
            check_cache_types(*cache_types(label), template.flash_attn, "--cache-types", "--cache-types")
        out.append((label, helper if fixed else label))
    return out


def base_axis(bases: str | None, weight_types: list[str] | None, allow_requantize: bool, options: dict,
              selection) -> dict[str, Path]:
    """The sweep's base models by label: each of --bases (else the one base) at each of --weight-types, quantized
    into the model cache the first time. Labels: the weight type (one base), the file's stem (several bases, no
    types), stem:type (both); "" for a run with one base and no types (no base axis)."""
    if bases and options.get("base"):
        raise KVRescueError("give --base or --bases, not both")
    sources = [resolve_gguf(b.strip()) for b in bases.split(",") if b.strip()] if bases else [selection.paths["base"]]
    if not sources:
        raise KVRescueError(f"--bases {bases!r} names no model: give comma-separated GGUF paths")
    for source in sources:  # a missing one is named by opening it
        check_input_file(source, "--bases" if bases else "--base", "pass the path of a .gguf model file",
                         missing_ok=True)
    files = {}
    for source in sources:
        for weight_type in weight_types or [None]:
            path = Path(source) if weight_type is None else quantized_with_progress(Path(source), weight_type,
                                                                                    allow_requantize)
            stem = Path(source).stem if len(sources) > 1 else ""
            files[":".join(x for x in (stem, weight_type) if x)] = path
    return files


@bench.command("merge")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="the merged results file (it may be one of the INPUTS); zstd-compressed where it ends in .zst")
@click.option("--force", is_flag=True, help="replace an existing --out that is not one of the INPUTS")
def merge_command(inputs, out, force) -> None:
    """Merge shard result files into one, without duplicates."""
    check_writable(out, "--out", special=False)
    click.echo(f"{merge_results(list(inputs), out, force)} results in {out}")
