"""Sweeps: problems × configurations (mode, budget, N, policy, commit rule, base weights, KV cache types), one JSONL
line per pair, resumable.

A configuration's problems run `concurrency` at a time on one engine; each line is flushed as soon as
its problem finishes, so a crash or Ctrl-C loses at most the problems in flight; `resume` skips the
(dataset, problem, configuration) triples already there (a row whose problem's text or gold answer differs from
the data's, by its fingerprint, is not done: it runs again). Rows record the concurrency, the run and the
wall time since the configuration started in it (problems per minute at that concurrency, `report`'s
Table 3), never as a setting: results do not depend on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Callable, Iterable, Iterator, TextIO

from ..errors import KVRescueError
from ..files import check_appendable, compressed_output, json_text, results_target, write_output
from ..rescue import Mode, Models, Rescue, RescueConfig, longest_prompt
from ..rescue.rules import parse_rule
from ..runtime import Model
from .datasets import Dataset, Problem
from .metrics import DEFAULT_CACHE, result_line
from ..quantize import file_type
from ..runtime.context import kv_bytes_per_cell
from .results_file import (BETWEEN_CONFIGURATIONS, check_same_setup, configuration_setups, problem_fingerprint, read_rows,
                           repair_tail, row_key, settings, setup, weights_label, writing)


def cache_label(type_k: str, type_v: str) -> str:
    """A side's KV cache types as the sweep names them: "q8_0" for K and V, "q8_0/f16" when they differ."""
    return type_k if type_k == type_v else f"{type_k}/{type_v}"


def cache_types(label: str) -> tuple[str, str]:
    type_k, _, type_v = label.partition("/")
    return type_k, type_v or type_k


@dataclass(frozen=True)
class Axis:
    mode: Mode
    budget: int
    n: int
    policy: str
    rule: str = "judge"  # the commit rule's spec
    weights: str = ""  # the base model on the sweep's base axis (its weight type, or its file): "" for a run's one base
    kv_cache: str = DEFAULT_CACHE  # the base's KV cache types (cache_label)
    helper_kv_cache: str = DEFAULT_CACHE

    @property
    def key(self) -> str:
        """The configuration's name in its rows: a rule by its key name (its parameters are in the rows' settings),
        "-arith" where it checks arithmetic."""
        rule = parse_rule(self.rule)
        key = f"{self.mode}-b{self.budget}-n{self.n}-{self.policy}" + (
            "" if rule.key_name == "prm" else f"-{rule.key_name}")
        if rule.checks_arithmetic:
            key += "-arith"
        if self.weights:
            key += f"-w{self.weights}"
        if (self.kv_cache, self.helper_kv_cache) != (DEFAULT_CACHE, DEFAULT_CACHE):
            key += f"-kv{self.kv_cache}" + ("" if self.helper_kv_cache == self.kv_cache else f"-hkv{self.helper_kv_cache}")
        return key


def sweep_axes(modes: Iterable[str | Mode], budgets: Iterable[int], ns: Iterable[int], policies: Iterable[str],
               rules: Iterable[str] = ("judge",), weights: Iterable[str] = ("",),
               caches: Iterable[tuple[str, str]] = ((DEFAULT_CACHE, DEFAULT_CACHE),)) -> list[Axis]:
    """The configurations of a sweep; modes without eviction ignore budget and policy, so they appear once, the
    rule (specs) matters only where a round has more than one candidate, the base's weights and
    cache only where the base runs and the helper's cache only where the helper does (`caches`: (base, helper) cache
    labels)."""
    axes = []
    for mode, budget, n, policy, rule, weight, (kv_cache, helper_kv_cache) in product(
            map(Mode.parse, modes), budgets, ns, policies, rules, weights, caches):
        if not mode.evicts:
            budget, policy = 0, "none"
        if n * mode.sides == 1:
            rule = "judge"
        if not mode.uses_base:
            weight, kv_cache = "", helper_kv_cache
        if not mode.uses_helper:
            helper_kv_cache = kv_cache
        axis = Axis(mode, budget, n, policy, parse_rule(rule).spec, weight, kv_cache, helper_kv_cache)
        if axis not in axes:
            axes.append(axis)
    return axes


def rescue_config(axis: Axis, template: RescueConfig) -> RescueConfig:
    kv = dataclasses.replace(template.kv, budget=axis.budget, policy=axis.policy) if axis.budget else template.kv
    (type_k, type_v), (helper_k, helper_v) = cache_types(axis.kv_cache), cache_types(axis.helper_kv_cache)
    return dataclasses.replace(template, mode=axis.mode, n=axis.n, kv=kv, rule=axis.rule, cache_type_k=type_k,
                               cache_type_v=type_v, helper_cache_type_k=helper_k, helper_cache_type_v=helper_v)


def results_config(axis: Axis, config: RescueConfig) -> dict:
    """The settings a results line records: the sweep axes, every setting and the prompt template."""
    return {**dataclasses.asdict(axis), **settings(config), "prompt": config.prompt}


def undone(tasks: list[tuple[Axis, Problem]], label: str, rows: list[dict]) -> tuple[list[tuple[Axis, Problem]], int]:
    """The tasks no row has done yet, and how many of them have a row of another problem under their id (an edited
    --data: its text or gold answer differs). A row from before problems were fingerprinted counts as done."""
    done = {row_key(r) for r in rows}
    ran = {key[:3] for key in done}
    todo = [(axis, p) for axis, p in tasks
            if not {(label, p.id, axis.key, problem_fingerprint(p.problem, p.answer)), (label, p.id, axis.key, None)}
            & done]
    return todo, sum((label, p.id, axis.key) in ran for axis, p in todo)


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise KVRescueError(f"--shard takes i/n (e.g. 0/4), not {text!r}") from None
    if not 0 <= index < count:
        raise KVRescueError(f"--shard {text}: i must be in [0, n)")
    return index, count


def axis_setup(axis: Axis, template: RescueConfig, models: Models) -> dict:
    """A row's setup (results_file.setup) with what its axes made of the models: each side's KV cache types and the
    real bytes a cell of them takes, and the base's weights (its label on the sweep and the file's weight type)."""
    config = rescue_config(axis, template)
    out = setup(config, models.files(), models.prm and models.prm.head_file)
    sides = {"base": models.base if config.uses_base else None, "helper": models.helper if config.uses_helper else None}
    out["kv"] = {side: {"type_k": k, "type_v": v, "cell_bytes": kv_bytes_per_cell(model, k, v)}
                 for side, model in sides.items() if model is not None for k, v in [config.cache_types(side)]}
    if sides["base"] is not None:
        out["weights"] = {"label": axis.weights, "type": file_type(models.base.path)}
    servers = sorted({endpoint for model in sides.values() if model is not None for endpoint in model.rpc})
    if servers:  # where the layers ran (--rpc) and how many went there: recorded, not compared on --resume
        out["rpc"] = {"servers": servers, "n_gpu_layers": next(m for m in sides.values() if m and m.rpc).n_gpu_layers}
    return out


def run_sweep(dataset: Dataset, axes: list[Axis], template: RescueConfig, models: Models,
              results: Path, resume: bool = False, shard: tuple[int, int] = (0, 1), concurrency: int = 1,
              on_result: Callable[[dict], None] | None = None, on_skip: Callable[[int], None] | None = None,
              on_cut: Callable[[int], None] | None = None, bases: dict[str, Model] | None = None,
              on_changed: Callable[[int], None] | None = None) -> int:
    """Run what is not done yet; returns the number of lines written. on_cut hears of a partial last line cut
    off (bytes) before resuming, on_changed of the problems run again because their rows solved other text.
    `bases`: the base model of each weights label of the axes ("" : models.base)."""
    check_appendable(results, "--results")  # before repair_tail, which would cut a compressed file
    label, problems = dataset.label, dataset.problems
    bases = {"": models.base, **(bases or {})}

    def models_of(axis: Axis) -> Models:
        return dataclasses.replace(models, base=bases[axis.weights])

    with writing(results):
        cut = repair_tail(results)
        if cut and on_cut:
            on_cut(cut)
        rows = read_rows(results)
        if rows and not resume:
            raise KVRescueError(f"{results} already holds {len(rows)} results: pass --resume to continue it or "
                                "choose a new file")
        setups = {axis: axis_setup(axis, template, models_of(axis)) for axis in axes}
        # what each base of the sweep runs with: every model its configurations use
        ours: dict[str, dict] = {}
        for axis, made in setups.items():
            merged = ours.setdefault(axis.weights, {**made, "models": {}, "settings": {}})
            merged["models"].update(made["models"])
            merged["settings"].update(made["settings"])  # a setting some configurations record (the helper's thresholds)
        fix = "resume with the same models and options or write to a new results file"
        # rows of a configuration this sweep runs: against its own setup, where a setting the rows lack because they
        # were written before it was recorded is compared by the value they ran with; other rows against their base's
        own = {axis.key: made for axis, made in setups.items()}
        for key, theirs in configuration_setups(rows, results):
            if key in own:
                check_same_setup(own[key], [theirs], results, fix)
            else:
                check_same_setup(ours.get(weights_label(theirs)) or next(iter(ours.values())), [theirs], results, fix,
                                 BETWEEN_CONFIGURATIONS)
        index, count = shard
        tasks = [(axis, p) for axis in axes for p in problems][index::count]
        todo, changed = undone(tasks, label, rows)
        if on_skip:
            on_skip(len(tasks) - len(todo))
        if changed and on_changed:
            on_changed(changed)
        written = 0
        prompt_tokens = longest_prompt(template, [models.base, models.helper], [p.problem for _, p in todo]) if todo else 0
        run_id = uuid.uuid4().hex[:12]
        with open_on_first_write(results) as out:
            for axis in dict.fromkeys(axis for axis, _ in todo):  # one configuration's contexts at a time
                engine = Rescue(rescue_config(axis, template), bases[axis.weights], models.helper, models.prm,
                                prompt_tokens_max=prompt_tokens, concurrency=concurrency)
                started = time.perf_counter()
                # a problem that cannot finish here becomes a row that says why, and the sweep goes on
                for problem, trajectory, error in engine.run([p for a, p in todo if a == axis], text=lambda p: p.problem):
                    line = result_line(label, problem.id, problem.answer,
                                       dataset.grade(problem.answer, trajectory.answer), axis.key,
                                       results_config(axis, engine.config), trajectory)
                    line["setup"] = setups[axis]
                    line["problem_sha256"] = problem_fingerprint(problem.problem, problem.answer)
                    line["engine"] = {"concurrency": concurrency, "flash_attn": engine.config.flash_attn, "run": run_id,
                                      "elapsed": round(time.perf_counter() - started, 4),
                                      "kv_peak_bytes": engine.peak_kv_bytes()}
                    if error:
                        line["error"] = error
                    out().write(json_text(line, f"the results line of {problem.id} ({axis.key}):") + "\n")
                    out().flush()
                    os.fsync(out().fileno())
                    written += 1
                    if on_result:
                        on_result(line)
                del engine  # its contexts go before the next configuration's are made
    return written


@contextmanager
def open_on_first_write(path: Path) -> Iterator[Callable[[], TextIO]]:
    """The file opened for appending when first written to: a run refused before its first row (a context
    that does not fit, a bad option) leaves no empty results file behind."""
    handle: list[TextIO] = []

    def out() -> TextIO:
        if not handle:
            handle.append(path.open("a", encoding="utf-8"))
        return handle[0]

    try:
        yield out
    finally:
        for f in handle:
            f.close()


def merge_results(inputs: list[Path], output: Path, force: bool = False) -> int:
    """Union of shard files without duplicates; refuses rows of different models or settings, an input without
    rows, and (unless force) replacing an existing output that is not one of the inputs. An output named .zst is
    written zstd-compressed."""
    target = results_target(output, "--out")
    if target.exists() and not force and not any(p.exists() and os.path.samefile(p, target) for p in inputs):
        raise KVRescueError(f"--out {output} already exists and is not one of the inputs: choose a new file, "
                            "list it among the inputs to merge it too, or pass --force to replace it")
    merged: dict[tuple, dict] = {}
    setups: list[dict] = []
    of_configuration: dict[str, list[dict]] = {}
    # the output's lock before any input is read: a `bench run` appending to it meanwhile would lose its rows
    with writing(output, "--out"):
        for path in inputs:
            if not path.exists():
                raise KVRescueError(f"results file not found: {path}")
            rows = read_rows(path)
            if not rows:
                raise KVRescueError(f"{path} holds no results lines: pass the results files of `bench run` (an "
                                    "empty, binary or cut-off file has none)")
            fix = "merge only shards of one sweep (same models and options)"
            for key, theirs in configuration_setups(rows, path):
                check_same_setup(theirs, setups, path, fix, BETWEEN_CONFIGURATIONS)
                check_same_setup(theirs, of_configuration.get(key, []), path, fix)
                setups.append(theirs)
                of_configuration.setdefault(key, []).append(theirs)
            for row in rows:
                merged.setdefault(row_key(row), row)
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in merged.values())
        write_output(output, compressed_output(output, text.encode("utf-8")), "--out")
    return len(merged)
