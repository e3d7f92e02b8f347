"""Sweeps: problems × configurations (mode, budget, N, policy), one JSONL line per pair, resumable.

Each line is flushed as soon as its problem finishes, so a crash or Ctrl-C loses at most the
problem in flight; `resume` skips the (dataset, problem, configuration) triples already there.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Callable, Iterable

from ..errors import KVRescueError
from ..prm import PRM
from ..rescue import Mode, Rescue, RescueConfig, longest_prompt
from ..runtime import Model
from .datasets import Dataset
from .metrics import result_line

# settings that must be the same for every line of one results file (the sweep axes may differ)
SHARED = ("buffer", "n_sink", "window", "protect_prompt", "tau_entropy", "tau_compression", "max_tokens",
          "max_steps", "max_step_tokens", "temperature", "top_p", "seed")


@dataclass(frozen=True)
class Axis:
    mode: Mode
    budget: int
    n: int
    policy: str

    @property
    def key(self) -> str:
        return f"{self.mode}-b{self.budget}-n{self.n}-{self.policy}"


def sweep_axes(modes: Iterable[str | Mode], budgets: Iterable[int], ns: Iterable[int], policies: Iterable[str]) -> list[Axis]:
    """The configurations of a sweep; modes without eviction ignore budget and policy, so they appear once."""
    axes = []
    for mode, budget, n, policy in product(map(Mode.parse, modes), budgets, ns, policies):
        if not mode.evicts:
            budget, policy = 0, "none"
        axis = Axis(mode, budget, n, policy)
        if axis not in axes:
            axes.append(axis)
    return axes


def rescue_config(axis: Axis, template: RescueConfig) -> RescueConfig:
    kv = dataclasses.replace(template.kv, budget=axis.budget, policy=axis.policy) if axis.budget else template.kv
    return dataclasses.replace(template, mode=axis.mode, n=axis.n, kv=kv)


def shared_settings(config: RescueConfig) -> dict:
    flat = {**dataclasses.asdict(config.kv), **dataclasses.asdict(config.detector), **dataclasses.asdict(config)}
    return {k: flat[k] for k in SHARED}


def results_config(axis: Axis, config: RescueConfig) -> dict:
    """The settings a results line records: the sweep axes, the shared settings and the prompt template."""
    return {**dataclasses.asdict(axis), **shared_settings(config), "prompt": config.prompt}


def read_results(path: Path) -> list[dict]:
    """Lines of a results file; a truncated last line (a crash mid-write) is dropped, any other bad line refused."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise KVRescueError(f"{path}:{number} is not a results line: restore the file or start a new one") from None
    return rows


def check_same_settings(rows: list[dict], settings: dict, path: Path) -> None:
    for row in rows:
        theirs = {k: row["config"].get(k) for k in SHARED}
        if theirs != settings:
            diff = ", ".join(f"{k} {theirs[k]!r} vs {settings[k]!r}" for k in SHARED if theirs[k] != settings[k])
            raise KVRescueError(f"{path} holds results of a different configuration ({diff}): resume with the same "
                                "options or write to a new results file")


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
    prm: PRM | None


def run_sweep(dataset: Dataset, axes: list[Axis], template: RescueConfig, models: Models,
              results: Path, resume: bool = False, shard: tuple[int, int] = (0, 1),
              on_result: Callable[[dict], None] | None = None, on_skip: Callable[[int], None] | None = None) -> int:
    """Run what is not done yet; returns the number of lines written."""
    label, problems = dataset.label, dataset.problems
    rows = read_results(results)
    if rows and not resume:
        raise KVRescueError(f"{results} already holds {len(rows)} results: pass --resume to continue it or choose a "
                            "new file")
    check_same_settings(rows, shared_settings(template), results)
    done = done_keys(rows)
    index, count = shard
    tasks = [(axis, p) for axis in axes for p in problems][index::count]
    todo = [(axis, p) for axis, p in tasks if (label, p.id, axis.key) not in done]
    if on_skip:
        on_skip(len(tasks) - len(todo))
    results.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    engines: dict[Axis, Rescue] = {}
    prompt_tokens = longest_prompt(template, [models.base, models.helper], [p.problem for _, p in todo]) if todo else 0
    with results.open("a", encoding="utf-8") as out:
        for axis, problem in todo:
            if axis not in engines:
                engines.clear()  # one configuration's contexts at a time
                engines[axis] = Rescue(rescue_config(axis, template), models.base, models.helper, models.prm,
                                       prompt_tokens_max=prompt_tokens)
            engine = engines[axis]
            trajectory = engine.solve(problem.problem)
            line = result_line(label, problem.id, problem.answer, dataset.grade(problem.answer, trajectory.answer),
                               axis.key, results_config(axis, engine.config), trajectory)
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
            os.fsync(out.fileno())
            written += 1
            if on_result:
                on_result(line)
    return written


def merge_results(inputs: list[Path], output: Path) -> int:
    """Union of shard files without duplicates; refuses files of different configurations."""
    merged: dict[tuple[str, str, str], dict] = {}
    settings = None
    for path in inputs:
        if not path.exists():
            raise KVRescueError(f"results file not found: {path}")
        rows = read_results(path)
        if rows and settings is None:
            settings = {k: rows[0]["config"].get(k) for k in SHARED}
        check_same_settings(rows, settings, path)
        for row in rows:
            merged.setdefault((row["dataset"], row["id"], row["config_key"]), row)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in merged.values()), encoding="utf-8")
    os.replace(tmp, output)
    return len(merged)

