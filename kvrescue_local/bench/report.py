"""The paper's tables from a results JSONL file (one line per problem × configuration).

Table 2 (ablation), one row per configuration (dataset, mode, budget, N, policy, setup; seeds pooled):
  problems, pass@1 %, degeneration rate % (degenerate among the incorrect trajectories), mean base
  tokens per problem (all base candidates, killed ones included), mean committed steps, early-exit %
  (killed / all base candidates, pooled over problems), mean helper tokens, problems per minute
  (problems / sum of timings.total), mean PRM seconds per problem, and for kvrescue rows the accuracy
  recovered, (acc_kvrescue - acc_bon) / (acc_full - acc_bon), against the bon row of the same dataset,
  budget, N and policy and the full row of the same dataset and N.
Table 1 (decode cost), per configuration: mean seconds per problem inside llama.cpp for the base and
  the helper, in the PRM, in orchestration (the rest), in total; tokens per second of base and helper
  (tokens generated / seconds inside llama.cpp for that model).

`full` and `helper` do not evict: their budget and policy are shown as "-" and ignored when grouping.
A setup is what a row records beyond its axes (model files, prompt template, settings; see results_file.py):
rows of one configuration with different setups (seeds aside) are never pooled unless asked (pool_setups);
they become rows of their own with a setup column, and the notes name what differs.
"""

from __future__ import annotations

import hashlib
import json
import math
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KVRescueError
from .results_file import differences

REQUIRED = ("config", "correct", "n_steps", "tokens", "timings")
REQUIRED_CONFIG = ("mode", "n")
EVICTING = ("bon", "kvrescue")
MODE_ORDER = {"full": 0, "helper": 1, "bon": 2, "kvrescue": 3}
DEGENERATE_STEPS = 256


# --- reading -------------------------------------------------------------------------------------

def _number(value, where: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise KVRescueError(f"{where}: {name} is {value!r}, not a number: rewrite this line (or re-run its problem)")
    return float(value)


def check_line(row, where: str) -> dict:
    """A results line with the fields the tables need, or a one-line error naming the line and field."""
    if not isinstance(row, dict):
        raise KVRescueError(f"{where} is not a JSON object but {type(row).__name__}: every line must be one result")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise KVRescueError(f"{where} misses {', '.join(missing)}: it is not a results line of `kvrescue-local bench` "
                            "(re-run the benchmark or remove the line)")
    config = row["config"]
    if not isinstance(config, dict) or any(k not in config for k in REQUIRED_CONFIG):
        raise KVRescueError(f"{where}: config misses mode or n: it is not a results line of `kvrescue-local bench`")
    if not isinstance(row["tokens"], dict) or not isinstance(row["timings"], dict):
        raise KVRescueError(f"{where}: tokens and timings must be objects: re-run its problem or remove the line")
    if "total" not in row["timings"]:
        raise KVRescueError(f"{where} misses timings.total: re-run its problem or remove the line")
    for name, value in row["timings"].items():
        _number(value, where, f"timings.{name}")
    for name, value in row["tokens"].items():
        _number(value, where, f"tokens.{name}")
    _number(row["n_steps"], where, "n_steps")
    return row


def load_results(path: str | Path) -> list[dict]:
    """Every line of a results file, checked; blank lines are skipped."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KVRescueError(f"results file not found: {path}; pass the JSONL written by `kvrescue-local bench`") from None
    except IsADirectoryError:
        raise KVRescueError(f"{path} is a directory; pass the results .jsonl file inside it") from None
    except UnicodeDecodeError:
        raise KVRescueError(f"{path} is not UTF-8 text: pass the results .jsonl written by `kvrescue-local bench`") from None
    except OSError as exc:
        raise KVRescueError(f"cannot read {path} ({exc.strerror}): check the path and its permissions") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise KVRescueError(f"{where} is not JSON ({exc.msg}): fix or remove that line (a crash mid-write leaves "
                                "a truncated last line)") from None
        rows.append(check_line(row, where))
    if not rows:
        raise KVRescueError(f"{path} holds no results: run `kvrescue-local bench` first (or pass another file)")
    return rows


# --- aggregation ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConfigKey:
    dataset: str
    mode_rank: int
    budget: int | None
    n: int
    policy: str | None
    mode: str
    setup: str = ""  # setup_label of its rows; "" when setups are pooled

    @property
    def label(self) -> str:
        return f"{self.mode} b{self.budget if self.budget is not None else '-'} n{self.n} {self.policy or '-'}"


UNRECORDED = "unrecorded"  # rows written before setups were recorded


def setup_label(row: dict) -> str:
    """A short id of the row's setup, seeds aside (the report pools seeds)."""
    setup = row.get("setup")
    if setup is None:
        return UNRECORDED
    without_seed = {**setup, "settings": {k: v for k, v in setup["settings"].items() if k != "seed"}}
    return hashlib.sha256(json.dumps(without_seed, sort_keys=True).encode()).hexdigest()[:6]


def config_key(row: dict, pool_setups: bool = False) -> ConfigKey:
    cfg = row["config"]
    mode = str(cfg["mode"])
    evicts = mode in EVICTING
    budget = cfg.get("budget", (cfg.get("kv") or {}).get("budget")) if evicts else None
    policy = cfg.get("policy", (cfg.get("kv") or {}).get("policy")) if evicts else None
    return ConfigKey(str(row.get("dataset", "")), MODE_ORDER.get(mode, 9), None if budget is None else int(budget),
                     int(cfg["n"]), None if policy is None else str(policy), mode,
                     "" if pool_setups else setup_label(row))


def group_rows(rows: list[dict], pool_setups: bool = False) -> dict[ConfigKey, list[dict]]:
    groups: dict[ConfigKey, list[dict]] = {}
    for row in rows:
        groups.setdefault(config_key(row, pool_setups), []).append(row)
    def order(item):
        k = item[0]
        return (k.dataset, k.mode_rank, k.mode, -1 if k.budget is None else k.budget, k.n, k.policy or "", k.setup)

    return dict(sorted(groups.items(), key=order))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def is_degenerate(row: dict) -> bool:
    if "degenerate" in row:
        return bool(row["degenerate"])
    return not row["correct"] and row["n_steps"] >= DEGENERATE_STEPS


@dataclass
class Summary:
    """One configuration's numbers (Table 2 and Table 1)."""

    key: ConfigKey
    problems: int
    pass1: float  # %
    degeneration: float | None  # % of incorrect trajectories; None when none is incorrect
    base_tokens: float
    steps: float
    early_exit: float | None  # % of base candidates; None without base candidates
    helper_tokens: float
    problems_per_minute: float | None
    prm_s: float
    llama_base_s: float
    llama_helper_s: float
    orchestration_s: float
    total_s: float
    base_tok_s: float | None
    helper_tok_s: float | None
    steps_from: dict = field(default_factory=dict)  # committed steps per source, summed
    recovered: float | None = None  # %, kvrescue rows with matching full and bon rows
    setup: dict | None = None  # its first row's setup (None: unrecorded or pooled)

    @property
    def uses_base(self) -> bool:
        return self.key.mode != "helper"

    @property
    def uses_helper(self) -> bool:
        return self.key.mode in ("helper", "kvrescue")


def summarize(key: ConfigKey, rows: list[dict]) -> Summary:
    n = len(rows)
    timing = lambda r, k: float(r["timings"].get(k) or 0.0)  # noqa: E731
    tokens = lambda r, k: float(r["tokens"].get(k) or 0.0)  # noqa: E731
    incorrect = [r for r in rows if not r["correct"]]
    base_candidates = sum(int(r.get("base_candidates") or 0) for r in rows)
    killed = sum(int(r.get("killed") or 0) for r in rows)
    total_time = sum(timing(r, "total") for r in rows)
    base_llama = sum(timing(r, "llama_base") for r in rows)
    helper_llama = sum(timing(r, "llama_helper") for r in rows)
    base_tokens = sum(tokens(r, "base") for r in rows)
    helper_tokens = sum(tokens(r, "helper") for r in rows)
    steps_from: dict[str, int] = {}
    for r in rows:
        for side, count in (r.get("steps_from") or {}).items():
            steps_from[side] = steps_from.get(side, 0) + int(count or 0)
    return Summary(
        key=key, problems=n,
        pass1=100.0 * sum(bool(r["correct"]) for r in rows) / n,
        degeneration=100.0 * sum(is_degenerate(r) for r in incorrect) / len(incorrect) if incorrect else None,
        base_tokens=base_tokens / n, steps=_mean(float(r["n_steps"]) for r in rows),
        early_exit=100.0 * killed / base_candidates if base_candidates else None,
        helper_tokens=helper_tokens / n,
        problems_per_minute=60.0 * n / total_time if total_time > 0 else None,
        prm_s=_mean(timing(r, "prm") for r in rows),
        llama_base_s=base_llama / n, llama_helper_s=helper_llama / n,
        orchestration_s=_mean(timing(r, "orchestration") for r in rows), total_s=total_time / n,
        base_tok_s=base_tokens / base_llama if base_llama > 0 else None,
        helper_tok_s=helper_tokens / helper_llama if helper_llama > 0 else None,
        steps_from=steps_from, setup=rows[0].get("setup") if key.setup else None)


def accuracy_recovered(kvrescue: float, bon: float, full: float) -> float | None:
    """(acc_kvrescue - acc_bon) / (acc_full - acc_bon) in %; None when full does not beat bon."""
    if full - bon <= 0:
        return None
    return 100.0 * (kvrescue - bon) / (full - bon)


def same_setup(a: Summary, b: Summary) -> bool:
    """Comparable: pooled, or the same settings and prompt and the same file for each model both used."""
    if a.setup is None or b.setup is None:
        return a.key.setup == b.key.setup
    return not differences(a.setup, b.setup, ignore=("seed",))


def summaries(rows: list[dict], pool_setups: bool = False) -> list[Summary]:
    out = [summarize(key, group) for key, group in group_rows(rows, pool_setups).items()]

    def reference(mode: str, s: Summary, *axes: str) -> Summary | None:
        return next((r for r in out if r.key.mode == mode and r.key.dataset == s.key.dataset and
                     all(getattr(r.key, a) == getattr(s.key, a) for a in axes) and same_setup(r, s)), None)

    for s in out:
        if s.key.mode != "kvrescue":
            continue
        f = reference("full", s, "n")
        b = reference("bon", s, "budget", "n", "policy")
        if f and b:
            s.recovered = accuracy_recovered(s.pass1, b.pass1, f.pass1)
    return out


def setup_notes(items: list[Summary]) -> list[str]:
    """When one configuration holds several setups: what each differs in from the first."""
    keys = [dataclasses.replace(s.key, setup="") for s in items]
    if len(set(keys)) == len(keys):
        return []
    first: dict[str, dict] = {}
    for s in items:
        first.setdefault(s.key.setup, s.setup or {})
    labels = list(first)
    notes = [f"setups (model files, prompt template, settings; seeds aside) differ: {labels[0]} is the first"]
    for label in labels[1:]:
        theirs = first[label]
        diff = differences(first[labels[0]], theirs, ignore=("seed",)) if theirs and first[labels[0]] else []
        notes.append(f"{label} vs {labels[0]}: {'; '.join(diff) or 'setup not recorded in one of them'}")
    return notes


# --- rendering -----------------------------------------------------------------------------------

@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    align: list[str]  # "l" or "r" per column
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h)
                  for i, h in enumerate(self.headers)]

        def line(cells: list[str]) -> str:
            return "  ".join(c.rjust(w) if a == "r" else c.ljust(w)
                             for c, w, a in zip(cells, widths, self.align)).rstrip()

        out = [self.title, line(self.headers), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in self.rows]
        out += self.notes
        return "\n".join(out)

    def markdown(self) -> str:
        def cell(text: str) -> str:
            return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")

        out = [f"**{cell(self.title)}**", "", "| " + " | ".join(cell(h) for h in self.headers) + " |",
               "|" + "|".join("---:" if a == "r" else ":---" for a in self.align) + "|"]
        out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in self.rows]
        if self.notes:
            out += [""] + [f"{cell(n)}  " for n in self.notes]
        return "\n".join(out)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _config_cells(s: Summary, with_dataset: bool, with_setup: bool) -> list[str]:
    cells = [s.key.dataset] if with_dataset else []
    cells += [s.key.mode, "-" if s.key.budget is None else str(s.key.budget), str(s.key.n), s.key.policy or "-"]
    return cells + ([s.key.setup] if with_setup else [])


def _config_headers(with_dataset: bool, with_setup: bool) -> list[str]:
    return (["dataset"] if with_dataset else []) + ["mode", "budget", "N", "policy"] + (["setup"] if with_setup else [])


def table2(items: list[Summary]) -> Table:
    with_dataset = len({s.key.dataset for s in items}) > 1
    notes = setup_notes(items)
    with_setup = bool(notes)
    headers = _config_headers(with_dataset, with_setup) + ["problems", "pass@1 %", "degen %", "base tok", "steps",
                                                           "early exit %", "helper tok", "prob/min", "PRM s",
                                                           "recovered %"]
    rows = []
    for s in items:
        rows.append(_config_cells(s, with_dataset, with_setup) + [
            str(s.problems), fmt(s.pass1), fmt(s.degeneration),
            fmt(s.base_tokens, 0) if s.uses_base else "-", fmt(s.steps), fmt(s.early_exit),
            fmt(s.helper_tokens, 0) if s.uses_helper else "-", fmt(s.problems_per_minute, 2), fmt(s.prm_s, 3),
            fmt(s.recovered)])
    align = ["l"] * len(_config_headers(with_dataset, with_setup)) + ["r"] * 10
    notes += ["degen %: degenerate among incorrect trajectories; early exit %: killed / all base candidates; "
             "recovered %: (kvrescue - bon) / (full - bon) pass@1 at the same budget and N; tokens and seconds are "
             "means per problem; prob/min = problems / summed wall time."]
    return Table("Table 2: ablation", headers, rows, align, notes)


def table1(items: list[Summary]) -> Table:
    with_dataset = len({s.key.dataset for s in items}) > 1
    notes = setup_notes(items)
    with_setup = bool(notes)
    headers = _config_headers(with_dataset, with_setup) + ["problems", "llama base s", "llama helper s", "PRM s",
                                                           "orch s", "total s", "base tok/s", "helper tok/s"]
    rows = []
    for s in items:
        rows.append(_config_cells(s, with_dataset, with_setup) + [
            str(s.problems), fmt(s.llama_base_s, 3) if s.uses_base else "-",
            fmt(s.llama_helper_s, 3) if s.uses_helper else "-", fmt(s.prm_s, 3), fmt(s.orchestration_s, 3),
            fmt(s.total_s, 3), fmt(s.base_tok_s, 0) if s.uses_base else "-",
            fmt(s.helper_tok_s, 0) if s.uses_helper else "-"])
    align = ["l"] * len(_config_headers(with_dataset, with_setup)) + ["r"] * 8
    notes += ["seconds are means per problem; tok/s = tokens generated / seconds inside llama.cpp for that model "
             "(killed candidates' tokens included)."]
    return Table("Table 1: decode cost", headers, rows, align, notes)


def render(rows: list[dict], markdown: bool = False, pool_setups: bool = False) -> str:
    items = summaries(rows, pool_setups)
    tables = [table2(items), table1(items)]
    return "\n\n".join(t.markdown() if markdown else t.text() for t in tables) + "\n"


def report(path: str | Path, markdown: bool = False) -> str:
    return render(load_results(path), markdown)
