"""Results files you can trust: one writer at a time, a clean tail, and rows that say what produced them.

- `writing(path)` holds an exclusive lock (flock on the file itself, so one lock per file whatever names it:
  a symlink, a hard link, a bind mount) for as long as a sweep or a merge writes the file, and a merge
  from before it reads; a second writer is refused, naming the PID that holds it.
- `repair_tail(path)` cuts a partial last line (a crash or a full disk mid-write) before anything is
  appended, so the next row starts on a line of its own.
- `setup(...)` is what a row records beyond its sweep axes: a fingerprint of each model file it used
  (size + SHA-256 of the GGUF header and tensor index: cheap on multi-GiB files, yet any re-quantisation,
  re-conversion or other model changes it), the prompt template's hash and every sampling, detector and
  KV setting. `differences(a, b)` names what differs; resume and merge refuse rows that differ.

Every row read is checked field by field against ROW_SHAPE (types and ranges; a row written by any version of
`bench run` has it), so that a hand-edited or foreign line is one error naming its file, line and field.

Rows written before setups were recorded (no "setup" field) cannot be checked: `--resume` and `bench merge`
refuse files holding them (start a new file), `report` still reads them as their own setup ("unrecorded").
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from ..errors import KVRescueError
from ..files import check_input_file, decompressed, file_hash, results_target, same_file
from ..prm import head_path
from ..rescue import MODES, RescueConfig
from ..rescue.config import SOME_SETTINGS
from ..rescue.record import TRAJECTORY_SHAPE
from ..rescue.rules import Arith, ByBudget, Calibrated, Judge, Lead, Random, Rule
from ..shape import BOOLEAN, COUNT, SECONDS, TEXT, ListOf, Maybe, Number, Record, ShapeError, Text, check

# the sweep axes (recorded in "config") and settings that change speed, not results
SOME_CONFIGURATIONS = SOME_SETTINGS  # settings only configurations they matter to record: compared where both do
BETWEEN_CONFIGURATIONS = ("rule",)  # a configuration's own: compared between rows of one configuration only
NOT_SETTINGS = ("mode", "n", "budget", "policy", "prompt", "n_gpu_layers", "n_threads",
                "flash_attn", "n_batch", "helper_ctx", "kv", "detector", "cache_type_k", "cache_type_v",
                "helper_cache_type_k", "helper_cache_type_v")
# what a setup records of its axes (the KV cache types and their bytes, the base's weights): part of the row's
# configuration, so never compared as a setting
AXIS_RECORDS = ("kv", "weights")


# the fields of a row its readers rely on; other fields pass (rows that record more). Resume and merge need what
# tells rows apart (row_key); `report` reads rows from elsewhere too, and needs what its tables count.
CONFIG_SHAPE = Record({"mode": Text(MODES), "n": Number(low=1, integer=True), "budget": Maybe(COUNT),
                       "policy": Maybe(TEXT), "choice": TEXT, "rule": TEXT, "weights": TEXT, "kv_cache": TEXT, "helper_kv_cache": TEXT,
                       "check_arithmetic": BOOLEAN, "max_steps": COUNT})
MODEL_SHAPE = Record({"file": TEXT, "size": COUNT, "sha256": TEXT, "head_sha256": TEXT},
                     required=("file", "size", "sha256"))
SETUP_SHAPE = Record({"models": Record(other=MODEL_SHAPE), "prompt_sha256": TEXT, "settings": Record(),
                      "kv": Record(other=Record({"type_k": TEXT, "type_v": TEXT, "cell_bytes": Number(low=0)})),
                      "weights": Record({"label": TEXT, "type": TEXT}), "rpc": Record()},
                     required=("models", "prompt_sha256", "settings"))
ENGINE_SHAPE = Record({"concurrency": Number(low=1, integer=True), "flash_attn": TEXT, "run": TEXT,
                       "elapsed": SECONDS, "kv_peak_bytes": Record(other=COUNT)})
ROW_SHAPE = Record({"schema": Number(low=1, integer=True), "dataset": TEXT, "id": TEXT, "config_key": TEXT,
                    "config": CONFIG_SHAPE, "gold": TEXT, "answer": Maybe(TEXT), "correct": BOOLEAN, "stop": TEXT,
                    "degenerate": BOOLEAN, "length_capped": BOOLEAN, "n_steps": COUNT, "steps_from": Record(other=COUNT),
                    "tokens": Record(other=COUNT), "base_candidates": COUNT, "killed": COUNT,
                    "early_exit_fraction": Number(low=0, high=1), "helper_killed": COUNT, "fallbacks": COUNT,
                    "arithmetic_demoted": COUNT, "detector": ListOf(Record()),
                    "timings": Record({"total": SECONDS}, required=("total",), other=SECONDS),
                    "trajectory": TRAJECTORY_SHAPE, "setup": SETUP_SHAPE, "problem_sha256": TEXT,
                    "engine": ENGINE_SHAPE, "error": TEXT},
                   required=("dataset", "id", "config_key", "config"))
REPORTED_ROW_SHAPE = Record({**ROW_SHAPE.fields, "config": dataclasses.replace(CONFIG_SHAPE, required=("mode", "n"))},
                            required=("dataset", "id", "config", "correct", "n_steps", "tokens", "timings"))


# --- one writer, a clean tail ----------------------------------------------------------------------

@contextmanager
def writing(path: Path, option: str = "--results") -> Iterator[None]:
    """Hold the exclusive right to write path; refused (naming the holder's PID) while another process has it.
    The lock is the file's own (flock on it, made empty if it is not there yet): every name of the file (a
    symlink, a hard link, a bind mount, `./x`) takes the same one. A file this made and nobody wrote is
    removed again."""
    target = results_target(path, option)
    handle, made = lock_file(target, path, option)
    try:
        yield
    finally:
        try:
            if made and os.fstat(handle.fileno()).st_size == 0 and same_file(handle.fileno(), target):
                target.unlink()  # while still held: a writer that opened it sees it is gone
        except OSError as exc:  # a folder made read-only meanwhile: the file stays, empty, and nothing is lost
            print(f"warning: could not remove the empty {target} ({exc.strerror})", file=sys.stderr)
        handle.close()


def lock_file(target: Path, path: Path, option: str) -> tuple[BinaryIO, bool]:
    """target opened and flocked (made empty where it is not there: whether it was made comes back too)."""
    while True:
        try:
            handle, made = open(target, "xb"), True
        except FileExistsError:
            try:
                handle, made = open(target, "rb"), False
            except FileNotFoundError:  # removed meanwhile by a writer that made it and wrote nothing
                continue
        except OSError as exc:
            raise KVRescueError(f"cannot write {option} {path} ({exc.strerror}): choose a path in a writable "
                                "folder") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = lock_holder(handle)
            handle.close()
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise KVRescueError(f"{path} is being written by another process (PID {holder or 'unknown'}): wait for "
                                "it to finish or stop it, or write to another results file and `bench merge` "
                                "them") from None
        # a writer that finished meanwhile removed or replaced (merge) the file it held: lock the one now there
        if same_file(handle.fileno(), target):
            return handle, made
        handle.close()


def lock_holder(handle) -> str | None:
    """The PID holding a flock on handle's file, from /proc/locks (Linux; None elsewhere or when it is gone)."""
    info = os.fstat(handle.fileno())
    inode = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if fields[1:2] == ["FLOCK"] and fields[5:6] == [inode]:
            return fields[4] if fields[4] != "0" else None  # 0: a process outside this PID namespace
    return None


def repair_tail(path: Path) -> int:
    """Make path end with a newline: a partial last line is cut off; returns the number of bytes cut."""
    if not path.exists():
        return 0
    with path.open("r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep = last_line_start(f, size)
        f.seek(keep)
        tail = f.read()
        if parse_row(tail) is not None:  # a whole row that only lost its newline
            f.write(b"\n")
            return 0
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
        return size - keep


def last_line_start(f, size: int, block: int = 1 << 16) -> int:
    end = size
    while end > 0:
        start = max(0, end - block)
        f.seek(start)
        newline = f.read(end - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def parse_row(raw: bytes) -> dict | None:
    try:
        row = json.loads(raw)
        check(row, ROW_SHAPE)
    except (UnicodeDecodeError, json.JSONDecodeError, ShapeError):
        return None
    return row


def upgrade(row: dict) -> dict:
    """A row as this version writes it: rows from before KV cache types were sweep axes recorded one `kv_type` for
    both sides among their settings, which becomes their axes' cache labels; KV-Rescue rows from before the helper's
    thresholds were settings did not watch the helper (0 and 0); rows from before commit rules were specs recorded a
    choice and its parameters as fields of their own, which become their rule (old_rule)."""
    config, settings_ = row.get("config"), (row.get("setup") or {}).get("settings") or {}
    if isinstance(config, dict) and settings_ and config.get("mode") == "kvrescue":  # the helper was not watched
        for name in ("helper_tau_entropy", "helper_tau_compression"):
            settings_.setdefault(name, 0.0)
            config.setdefault(name, 0.0)
    if isinstance(config, dict) and "rule" not in config:
        rule = old_rule({**settings_, **config})
        for name in OLD_RULE_FIELDS:
            config.pop(name, None)
            settings_.pop(name, None)
        config["rule"] = rule.spec
        sides = 2 if config.get("mode") == "kvrescue" else 1
        if settings_ and sides * int(config.get("n", 1)) > 1 and rule.at_budget(int(config.get("budget") or 0)).needs_judge:
            settings_["rule"] = rule.spec  # as RescueConfig.records has it: where a judge scores for the rule
    old = settings_.pop("kv_type", None)
    if isinstance(config, dict):
        old = config.pop("kv_type", old)
        if old is not None:
            config.setdefault("kv_cache", old)
            config.setdefault("helper_kv_cache", old)
    return row


# the fields a row recorded its commit rule in before rules were specs
OLD_RULE_FIELDS = ("choice", "pick_margin", "helper_margin", "base_margin", "calibration", "judge_max_budget",
                   "weak_base_choice", "check_arithmetic")


def old_rule(config: dict) -> Rule:
    """The rule of a row that recorded a choice and its parameters: "prm" the judge's pick within pick_margin (0 where
    the row records none), "random", "base-first" and "helper-first" the lead of a side with the other
    side's margin, "calibrated" with its calibration, "regime" weak_base_choice (the judge's pick where unrecorded)
    up to judge_max_budget and base-first above; check_arithmetic wraps it in the arithmetic check."""
    pick = float(config.get("pick_margin", 0.0))

    def simple(choice: str) -> Rule:
        if choice == "random":
            return Random()
        if choice in ("base-first", "helper-first"):
            side = choice.removesuffix("-first")
            return Lead(side, float(config.get("helper_margin" if side == "base" else "base_margin", 1.0)), pick)
        if choice == "calibrated":
            return Calibrated(tuple(float(x) for x in config.get("calibration", (1.0, 0.0, 1.0, 0.0))))
        return Judge(pick)

    choice = str(config.get("choice", "prm"))
    rule = (ByBudget(int(config.get("judge_max_budget", 0)), simple(str(config.get("weak_base_choice", "prm"))),
                     simple("base-first")) if choice == "regime" else simple(choice))
    return Arith(rule) if config.get("check_arithmetic") else rule


def read_rows(path: Path) -> list[dict]:
    """Every row of a results file (plain or zstd-compressed), each checked (rows_of); none where it is not there."""
    if not path.exists():
        return []
    return rows_of(decompressed(check_input_file(path, "results file").read_bytes(), path), path)


def rows_of(data: bytes, path: Path, shape: Record = ROW_SHAPE) -> list[dict]:
    """The rows of a results file's text, each checked against shape and upgraded; a line that is not a row is
    one error naming path:line (and the field). A partial last line (no newline after it, not JSON: a writer died
    mid-line) is left out, saying so on stderr."""
    lines = data.split(b"\n")
    rows = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if number == len(lines):
                print(f"warning: left out {where}, a partial last line ({len(raw):,} bytes: a writer stopped "
                      "mid-line)", file=sys.stderr)
                break
            reason = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else exc.msg
            raise KVRescueError(f"{where} is not JSON ({reason}): fix or remove that line, or write to a new results "
                                "file") from None
        try:
            check(row, shape)
        except ShapeError as exc:
            raise KVRescueError(f"{where} is not a results line of `kvrescue-local bench` ({exc}): re-run its problem "
                                "or remove that line") from None
        rows.append(upgrade(row))
    return rows


# --- which problem a row solved ---------------------------------------------------------------------

def problem_fingerprint(problem: str, answer: str) -> str:
    """A row's `problem_sha256`: the hash of its problem's text and gold answer, so that a row is matched only with
    the problem it solved (an edited or other --data file of the same name holds other problems under its ids)."""
    return hashlib.sha256(json.dumps([problem, answer]).encode()).hexdigest()[:16]


def row_key(row: dict) -> tuple[str, str, str, str | None]:
    """What a row is the result of: its problem (id and, where recorded, fingerprint) under its configuration.
    Rows from before fingerprints were recorded have None there."""
    return row["dataset"], row["id"], row["config_key"], row.get("problem_sha256")


# --- what produced a row ----------------------------------------------------------------------------

def model_fingerprint(path: str | Path, head: str | Path | None = None) -> dict:
    """{"file", "size", "sha256"}: name, size, and the hash of the header and tensor index (for a PRM,
    "head_sha256" too: its reward head, `head` or the one beside the backbone)."""
    path = Path(path)
    out = {"file": path.name, "size": path.stat().st_size, "sha256": file_hash(path)}
    head = Path(head) if head is not None else head_path(path)
    if head.exists():
        out["head_sha256"] = file_hash(head)
    return out


def settings(config: RescueConfig) -> dict:
    """Every sampling, detector and KV setting and length cap: all a row's outcome depends on besides its axes (a
    commit rule's spec only where a judge scores for it)."""
    flat = {**dataclasses.asdict(config.kv), **dataclasses.asdict(config.detector), **config.as_dict()}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(flat.items())
            if k not in NOT_SETTINGS and (k not in SOME_CONFIGURATIONS or config.records(k))}


def setup(config: RescueConfig, model_files: dict[str, Path | None], prm_head: Path | None = None) -> dict:
    """What a row records: the model files its mode uses (by role; the PRM's with its reward head), the prompt
    template, the settings."""
    used = {"base": config.uses_base, "helper": config.uses_helper, "prm": config.needs_prm}
    return {"models": {role: model_fingerprint(path, prm_head if role == "prm" else None)
                       for role, path in model_files.items() if path and used[role]},
            "prompt_sha256": hashlib.sha256(config.prompt.encode()).hexdigest()[:16],
            "settings": settings(config)}


def describe_model(fingerprint: dict) -> str:
    head = f", head {fingerprint['head_sha256'][:8]}" if "head_sha256" in fingerprint else ""
    return f"{fingerprint['file']} ({fingerprint['size']:,} bytes, {fingerprint['sha256'][:8]}{head})"


def weights_label(setup: dict) -> str:
    """The base's label on the sweep's base axis ("" : a run's one base, and rows from before that axis)."""
    return (setup.get("weights") or {}).get("label", "")


def differences(a: dict, b: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """What differs between two setups; models are compared for the roles both used (the base only between rows of
    the same base on the sweep's base axis). A setting only some configurations record is compared where both setups
    record it."""
    out = []
    roles = set(a["models"]) & set(b["models"])
    if weights_label(a) != weights_label(b):
        roles.discard("base")
    for role in sorted(roles):
        if a["models"][role] != b["models"][role]:
            out.append(f"{role} model {describe_model(a['models'][role])} vs {describe_model(b['models'][role])}")
    if a["prompt_sha256"] != b["prompt_sha256"]:
        out.append(f"prompt template {a['prompt_sha256'][:8]} vs {b['prompt_sha256'][:8]}")
    ours, theirs = a["settings"], b["settings"]
    out += [f"{k} {ours.get(k)!r} vs {theirs.get(k)!r}" for k in sorted(set(ours) | set(theirs))
            if k not in ignore and ours.get(k) != theirs.get(k)
            and not (k in SOME_CONFIGURATIONS and (k not in ours or k not in theirs))]
    return out


def configuration_setups(rows: list[dict], path: Path) -> list[tuple[str, dict]]:
    """The different (configuration key, setup) pairs of rows; rows without a setup (written by an older version)
    are refused."""
    seen = {}
    for row in rows:
        if "setup" not in row:
            raise KVRescueError(f"{path} holds results written before model fingerprints were recorded, so they "
                                "cannot be checked against this run: write to a new results file (`report` still "
                                "reads the old one)")
        seen.setdefault((row["config_key"], json.dumps(row["setup"], sort_keys=True)), (row["config_key"], row["setup"]))
    return list(seen.values())


def check_same_setup(ours: dict, setups: list[dict], path: Path, fix: str, ignore: tuple[str, ...] = ()) -> None:
    """Refuse setups that differ from ours; `ignore`: settings that tell configurations apart (the rule, between
    rows of different configurations)."""
    for theirs in setups:
        diff = differences(theirs, ours, ignore)
        if diff:
            raise KVRescueError(f"{path} holds results of a different configuration ({'; '.join(diff)}): {fix}")
