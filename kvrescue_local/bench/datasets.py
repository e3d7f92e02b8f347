"""Benchmark datasets: vendored MATH500 and GSM8K, hub datasets fetched at run time, the generated toy
task, or a JSONL file; each with the grader that decides a trajectory's answer."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import KVRescueError
from ..hub import not_cached
from ..files import check_encodable, check_input_file, decode_utf8
from ..rescue.limits import check_problem
from .grade import is_correct

DATA_DIR = Path(__file__).parent / "data"
VENDORED = {"math500": DATA_DIR / "math500.jsonl", "gsm8k": DATA_DIR / "gsm8k.jsonl"}


@dataclass(frozen=True)
class HubDataset:
    repo: str
    filename: str
    problem_field: str
    answer_field: str


# No stated license: fetched from the Hugging Face hub into its cache at run time, never committed.
HUB = {
    "aime24": HubDataset("math-ai/aime24", "test.jsonl", "problem", "answer"),
    "amc23": HubDataset("math-ai/amc23", "test.jsonl", "question", "answer"),
    "olympiadbench": HubDataset("math-ai/olympiadbench", "test.jsonl", "question", "final_answer"),
}
# Fixed splits for work that learns from a dataset (the coder PRM, the commit rules' fits): positions in [start, stop)
# of the vendored file (GSM8K's ids are its positions). Training reads only "train" rows and evaluation only "eval"
# rows, so the two are never mixed; MATH500's positions 100-249 are in no split: nothing trains or tunes on them.
SPLITS = {"gsm8k": {"train": (0, 900), "eval": (900, 1319)}, "math500": {"train": (250, 500), "eval": (0, 100)}}
GENERATED = ("toy",)  # kvrescue_local/toy/task.py: the toy ledger task, graded by exact integer match
DATASET_NAMES = sorted([*VENDORED, *HUB, *GENERATED])


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str


@dataclass(frozen=True)
class Dataset:
    label: str
    problems: list[Problem]
    grade: Callable[[str, str | None], bool] = is_correct  # (gold, answer of the last \\boxed{}) -> correct


def toy_dataset() -> Dataset:
    """The toy task's held-out problems (other seeds than training's); loaded only when asked for."""
    from ..toy.task import exact_match, held_out

    return Dataset("toy", [Problem(f"toy-{i}", p.text, str(p.answer)) for i, p in enumerate(held_out())], exact_match)


def field_text(value, where: str, numbers: bool = True) -> str:
    """A field of a JSONL row as the text it is solved or graded with: a string, or (numbers) a finite number as
    JSON writes it. null, true/false, a list or an object would be solved as their Python spelling ("None"), and
    a string holding a lone surrogate ("\\udc80") cannot be written back as UTF-8 JSON: each is refused, with
    `where` (the file, the line and the field)."""
    finite = isinstance(value, int) or isinstance(value, float) and math.isfinite(value)
    if isinstance(value, bool) or not (isinstance(value, str) or numbers and finite):
        kind = "null" if value is None else json.dumps(value, ensure_ascii=True)[:40]
        raise KVRescueError(f"{where} is {kind}, not {'text or a number' if numbers else 'text'}: give it as a JSON "
                            "string")
    return check_encodable(str(value), where, "fix that line")


def read_jsonl(path: Path, problem_field: str = "problem", answer_field: str = "answer") -> list[Problem]:
    """The problems of a JSONL file, each line checked: UTF-8, a JSON object with the two fields, a problem that
    is not empty, a gold answer that is not blank, and an id no other line has (ids compare as text: "1" and 1 are the same problem)."""
    problems = []
    first_line: dict[str, int] = {}
    raw_lines = check_input_file(path, "dataset file").read_bytes().split(b"\n")
    for number, raw in enumerate(raw_lines, start=1):
        line = decode_utf8(raw, f"{path}:{number}")
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise KVRescueError(f"{path}:{number}: not a JSON object ({exc.msg}): fix or remove that line") from None
        if not isinstance(row, dict):
            raise KVRescueError(f"{path}:{number}: not a JSON object but {type(row).__name__}: each line needs "
                                f"{{\"id\", \"{problem_field}\", \"{answer_field}\"}}")
        missing = [k for k in (problem_field, answer_field) if k not in row]
        if missing:
            raise KVRescueError(f"{path}:{number}: the row has no {' or '.join(repr(m) for m in missing)} field; "
                                f"each line needs {{\"id\", \"{problem_field}\", \"{answer_field}\"}}")
        where = f"{path}:{number}: the"
        problem = check_problem(field_text(row[problem_field], f"{where} {problem_field!r} field", numbers=False),
                                f"{where} {problem_field!r} field")
        answer = row[answer_field]
        if isinstance(answer, list):  # OlympiadBench stores a list of final answers
            if not answer:
                raise KVRescueError(f"{where} {answer_field!r} field is an empty list: give the gold answer")
            answer = answer[0]
        answer = field_text(answer, f"{where} {answer_field!r} field")
        if not answer.strip():  # no answer grades right against it: every run of the problem would count as wrong
            raise KVRescueError(f"{where} {answer_field!r} field is blank: give the gold answer")
        problem_id = field_text(row["id"], f"{where} 'id' field") if "id" in row else f"{path.stem}-{number}"
        if problem_id in first_line:
            raise KVRescueError(f"{path}:{number}: id {problem_id!r} is already the id of line {first_line[problem_id]} "
                                "(ids compare as text): give every problem its own id")
        first_line[problem_id] = number
        problems.append(Problem(problem_id, problem, answer))
    if not problems:
        raise KVRescueError(f"{path} holds no problems")
    return problems


def fetch_hub_dataset(spec: HubDataset, cache_dir: str | Path | None = None, offline: bool | None = None) -> Path:
    """Download (with progress) or reuse the hub cache; offline uses the cache only."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") if offline is None else offline
    try:
        return Path(hf_hub_download(spec.repo, spec.filename, repo_type="dataset", cache_dir=cache_dir,
                                    local_files_only=offline))
    except LocalEntryNotFoundError:
        raise KVRescueError(not_cached(f"{spec.repo}/{spec.filename}", offline, "fetch it once online, or pass "
                                       "--data FILE.jsonl")) from None
    except Exception as exc:  # network, auth, missing repo: one line, with the fix
        raise KVRescueError(f"could not fetch {spec.repo}/{spec.filename} from the Hugging Face hub "
                            f"({type(exc).__name__}): check the network or pass --data FILE.jsonl") from None


@functools.cache
def positions(dataset: str) -> dict[str, int]:
    """Each problem id of a vendored dataset and its position in the file."""
    return {p.id: i for i, p in enumerate(read_jsonl(VENDORED[dataset]))}


def split_of(dataset: str, problem_id: str) -> str | None:
    """The split ("train" or "eval") a problem of a split dataset belongs to; None for other datasets and problems
    in no split."""
    position = positions(dataset).get(problem_id) if dataset in SPLITS else None
    for split, (start, stop) in SPLITS.get(dataset, {}).items():
        if position is not None and start <= position < stop:
            return split
    return None


def load_dataset(name: str | None = None, path: str | Path | None = None, limit: int | None = None,
                 cache_dir: str | Path | None = None, offline: bool | None = None, split: str | None = None,
                 skip: int = 0) -> Dataset:
    """A dataset by name or from a JSONL path (the problems of one split when given), from its problem `skip` on
    (the next problems of a split after a run on its first ones), its first `limit` of those when given."""
    if split is not None and (path is not None or name not in SPLITS or split not in SPLITS[name]):
        splits = ", ".join(f"{d} ({'/'.join(s)})" for d, s in SPLITS.items())
        raise KVRescueError(f"--split {split} needs a dataset with that split: {splits}")
    if path is not None:
        path = Path(path)
        dataset = Dataset(path.stem, read_jsonl(path))
    elif name in VENDORED:
        dataset = Dataset(name, read_jsonl(VENDORED[name]))
    elif name in HUB:
        spec = HUB[name]
        dataset = Dataset(name, read_jsonl(fetch_hub_dataset(spec, cache_dir, offline), spec.problem_field,
                                           spec.answer_field))
    elif name == "toy":
        dataset = toy_dataset()
    else:
        raise KVRescueError(f"unknown dataset {name!r}: use one of {', '.join(DATASET_NAMES)} or --data FILE.jsonl")
    problems = dataset.problems
    if split is not None:
        problems = [p for p in problems if split_of(dataset.label, p.id) == split]
    if skip and skip >= len(problems):
        raise KVRescueError(f"--skip {skip} leaves no problem: {dataset.label}{f' ({split})' if split else ''} has "
                            f"{len(problems)}; skip fewer")
    problems = problems[skip:]
    return Dataset(dataset.label, problems[:limit] if limit else problems, dataset.grade)
