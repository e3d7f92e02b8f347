"""Sweeps: problems × configurations (mode, budget, N, policy), one JSONL line per pair, resumable.

A configuration's problems run `concurrency` at a time on one engine; each line is flushed as soon as
its problem finishes, so a crash or Ctrl-C loses at most the problems in flight; `resume` skips the
(dataset, problem, configuration) triples already there. Rows record the concurrency, the run and the
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
from ..files import results_target, write_output
from ..prm import PRM
from ..rescue import Mode, Rescue, RescueConfig, longest_prompt
from ..rescue.judge import HelperHead
from ..runtime import Model
from .datasets import Dataset
from .metrics import result_line
from .results_file import check_same_setup, distinct_setups, read_rows, repair_tail, settings, setup, writing


@dataclass(frozen=True)
class Axis:
    mode: Mode
    budget: int
    n: int
    policy: str
    choice: str = "prm"

    @property
    def key(self) -> str:
        return f"{self.mode}-b{self.budget}-n{self.n}-{self.policy}" + ("" if self.choice == "prm" else f"-{self.choice}")


def sweep_axes(modes: Iterable[str | Mode], budgets: Iterable[int], ns: Iterable[int], policies: Iterable[str],
               choices: Iterable[str] = ("prm",)) -> list[Axis]:
    """The configurations of a sweep; modes without eviction ignore budget and policy, so they appear once, and
    the choice matters only where a round has more than one candidate."""
    axes = []
    for mode, budget, n, policy, choice in product(map(Mode.parse, modes), budgets, ns, policies, choices):
        if not mode.evicts:
            budget, policy = 0, "none"
        if n * mode.sides == 1:
            choice = "prm"
        axis = Axis(mode, budget, n, policy, choice)
        if axis not in axes:
            axes.append(axis)
    return axes


def rescue_config(axis: Axis, template: RescueConfig) -> RescueConfig:
    kv = dataclasses.replace(template.kv, budget=axis.budget, policy=axis.policy) if axis.budget else template.kv
    return dataclasses.replace(template, mode=axis.mode, n=axis.n, kv=kv, choice=axis.choice)


def results_config(axis: Axis, config: RescueConfig) -> dict:
    """The settings a results line records: the sweep axes, every setting and the prompt template."""
    return {**dataclasses.asdict(axis), **settings(config), "prompt": config.prompt}


def done_keys(rows: list[dict]) -> set[tuple[str, str, str]]:
    return {(r["dataset"], r["id"], r["config_key"]) for r in rows}


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


@dataclass
class Models:
    base: Model | None
    helper: Model | None
    prm: PRM | HelperHead | None  # HelperHead: `--prm helper`, the helper's own context (its model is the helper)

    def files(self) -> dict[str, Path | None]:
        return {"base": self.base and self.base.path, "helper": self.helper and self.helper.path,
                "prm": self.prm and self.prm.model.path}


def run_sweep(dataset: Dataset, axes: list[Axis], template: RescueConfig, models: Models,
              results: Path, resume: bool = False, shard: tuple[int, int] = (0, 1), concurrency: int = 1,
              on_result: Callable[[dict], None] | None = None, on_skip: Callable[[int], None] | None = None,
              on_cut: Callable[[int], None] | None = None) -> int:
    """Run what is not done yet; returns the number of lines written. on_cut hears of a partial last line cut
    off (bytes) before resuming."""
    label, problems = dataset.label, dataset.problems
    with writing(results):
        cut = repair_tail(results)
        if cut and on_cut:
            on_cut(cut)
        rows = read_rows(results)
        if rows and not resume:
            raise KVRescueError(f"{results} already holds {len(rows)} results: pass --resume to continue it or "
                                "choose a new file")
        setups = {axis: setup(rescue_config(axis, template), models.files(), models.prm and models.prm.head_file)
                  for axis in axes}
        every_model = {role: f for s in setups.values() for role, f in s["models"].items()}
        check_same_setup({**setups[axes[0]], "models": every_model}, distinct_setups(rows, results), results,
                         "resume with the same models and options or write to a new results file")
        done = done_keys(rows)
        index, count = shard
        tasks = [(axis, p) for axis in axes for p in problems][index::count]
        todo = [(axis, p) for axis, p in tasks if (label, p.id, axis.key) not in done]
        if on_skip:
            on_skip(len(tasks) - len(todo))
        written = 0
        prompt_tokens = longest_prompt(template, [models.base, models.helper], [p.problem for _, p in todo]) if todo else 0
        run_id = uuid.uuid4().hex[:12]
        with open_on_first_write(results) as out:
            for axis in dict.fromkeys(axis for axis, _ in todo):  # one configuration's contexts at a time
                engine = Rescue(rescue_config(axis, template), models.base, models.helper, models.prm,
                                prompt_tokens_max=prompt_tokens, concurrency=concurrency)
                started = time.perf_counter()
                # a problem that cannot finish here becomes a row that says why, and the sweep goes on
                for problem, trajectory, error in engine.run([p for a, p in todo if a == axis], text=lambda p: p.problem):
                    line = result_line(label, problem.id, problem.answer,
                                       dataset.grade(problem.answer, trajectory.answer), axis.key,
                                       results_config(axis, engine.config), trajectory)
                    line["setup"] = setups[axis]
                    line["engine"] = {"concurrency": concurrency, "flash_attn": engine.config.flash_attn, "run": run_id,
                                      "elapsed": round(time.perf_counter() - started, 4),
                                      "kv_peak_bytes": engine.peak_kv_bytes()}
                    if error:
                        line["error"] = error
                    out().write(json.dumps(line, ensure_ascii=False) + "\n")
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
    rows, and (unless force) replacing an existing output that is not one of the inputs."""
    target = results_target(output, "--out")
    if target.exists() and not force and not any(p.exists() and os.path.samefile(p, target) for p in inputs):
        raise KVRescueError(f"--out {output} already exists and is not one of the inputs: choose a new file, "
                            "list it among the inputs to merge it too, or pass --force to replace it")
    merged: dict[tuple[str, str, str], dict] = {}
    setups: list[dict] = []
    for path in inputs:
        if not path.exists():
            raise KVRescueError(f"results file not found: {path}")
        rows = read_rows(path)
        if not rows:
            raise KVRescueError(f"{path} holds no results lines: pass the results files of `bench run` (an empty, "
                                "binary or cut-off file has none)")
        for theirs in distinct_setups(rows, path):
            check_same_setup(theirs, setups, path, "merge only shards of one sweep (same models and options)")
            setups.append(theirs)
        for row in rows:
            merged.setdefault((row["dataset"], row["id"], row["config_key"]), row)
    with writing(output, "--out"):
        write_output(output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in merged.values()), "--out")
    return len(merged)
