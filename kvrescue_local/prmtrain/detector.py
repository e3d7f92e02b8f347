"""The detector's thresholds fitted on a pair's own text: the base's candidates watched (killing none) with full KV and
evicted at each budget, one statistics line per candidate (`collect`), then Otsu's split of each signal kept only
where it separates two modes and kills at most MAX_FALSE_KILLS% of the candidates of the normal setting (full KV:
the base's text that no eviction broke), else the starting thresholds stay (`fit_detector`).

`kvrescue-local fit` runs both; perf/calibrate_real.py's `collect` and `fit` call them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import numpy as np

from ..bench.results_file import writing
from ..detect import Detector, DetectorParams, compression_ratio
from ..detect.calibrate import MIN_SEPARABILITY, otsu_threshold
from ..errors import KVRescueError
from ..files import write_output
from ..rescue import Rescue, RescueConfig
from ..runtime import Model

WATCH_ONLY = DetectorParams(tau_entropy=1e6, tau_compression=1e-6)  # record the signals, kill nothing
MAX_FALSE_KILLS = 1.0  # % of full-KV candidates a fitted threshold may kill; above it the starting one stays
MIN_CANDIDATES = 8  # a signal measured on fewer candidates keeps its starting threshold


def settings(template: RescueConfig, budgets: list[int]) -> dict[str, RescueConfig]:
    """The base alone at N = 1: full KV ("full") and evicted best-of-N at each budget ("bon@B"), from the template's
    sampling, caps and eviction."""
    common = dict(n=1, rule="judge")
    out = {"full": dataclasses.replace(template, mode="full", **common)}
    for b in budgets:
        out[f"bon@{b}"] = dataclasses.replace(template, mode="bon", kv=dataclasses.replace(template.kv, budget=b),
                                              **common)
    return out


def complete_lines(stats: Path) -> tuple[list[str], set[tuple[str, str, str]]]:
    """The lines of a statistics file whose problem is whole (each line counts its problem's candidates, so a
    problem a crash cut short is told apart; a line without the count is whole), and those problems' (dataset,
    problem id, setting)."""
    lines: dict[tuple[str, str, str], list[str]] = {}
    expected: dict[tuple[str, str, str], int] = {}
    if stats.exists():
        for line in stats.read_text().splitlines():
            try:
                row = json.loads(line)
                key = (row["dataset"], row["id"], row["setting"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut off by a crash
            lines.setdefault(key, []).append(line)
            expected[key] = row.get("candidates", 0)
    whole = {key for key, found in lines.items() if len(found) >= expected[key]}
    return [line for key in lines if key in whole for line in lines[key]], whole


def collect(model: Model, configs: dict[str, RescueConfig], problems: list[tuple[str, str, str]], stats: Path,
            prompt_tokens_max: int, on_solved: Callable[[str, str, dict], None] = lambda label, dataset, record: None,
            on_skip: Callable[[int], None] = lambda n: None) -> int:
    """Solve each (dataset, id, problem) in each setting with the detector watching every base candidate and
    killing none, appending one line per candidate to `stats` as each problem ends (what it holds whole already is
    skipped, and a problem a crash cut short dropped: a stopped run resumes); returns the problems solved."""
    with writing(stats, "the detector's statistics"):  # one writer per file, from before it reads what is done
        kept, done = complete_lines(stats)
        if stats.exists() and stats.read_text() != "".join(line + "\n" for line in kept):
            write_output(stats, "".join(line + "\n" for line in kept), "the detector's statistics")
        engines = {}
        for label, config in configs.items():
            engines[label] = Rescue(config, model, prompt_tokens_max=prompt_tokens_max)
            engines[label].detector = Detector(dataclasses.replace(config.detector, tau_entropy=WATCH_ONLY.tau_entropy,
                                                                   tau_compression=WATCH_ONLY.tau_compression))
        solved = 0
        with stats.open("a") as out:
            for dataset, problem_id, problem in problems:  # problem-major: a stopped run covers every setting
                for label, engine in engines.items():
                    if (dataset, problem_id, label) in done:
                        on_skip(1)
                        continue
                    record = engine.solve(problem).to_json()
                    candidates = [cand for step in record["steps"] for cand in step["candidates"]]
                    out.write("".join(json.dumps({"dataset": dataset, "id": problem_id, "setting": label,
                                                  "candidates": len(candidates), "text": cand["text"],
                                                  **cand["detector"]}) + "\n" for cand in candidates))
                    out.flush()
                    solved += 1
                    on_solved(label, dataset, record)
    return solved


def read_stats(paths: list[Path]) -> list[dict]:
    """The candidates' lines of statistics files (`collect`'s, or perf/calibrate_real.py replay's)."""
    rows = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                row["setting"], row["min_compression"], row["tokens"]  # noqa: B018  (the fields the fit reads)
            except (ValueError, KeyError, TypeError):
                raise KVRescueError(f"{path}:{number} is not a line of detector statistics: pass the statistics "
                                    "`kvrescue-local fit` collects (rows/detector.jsonl)") from None
            rows.append(row)
    return rows


def killed(row: dict, params: DetectorParams) -> bool:
    entropy = row.get("max_mean_entropy")  # None in replayed lines
    return (entropy is not None and entropy > params.tau_entropy) or row["min_compression"] < params.tau_compression


def kill_rates(rows: list[dict], params: DetectorParams) -> dict[str, float]:
    names = sorted({r["setting"] for r in rows})
    return {s: 100 * float(np.mean([killed(r, params) for r in rows if r["setting"] == s])) for s in names}


def enumeration(start: int, step: int, count: int) -> bytes:
    return ", ".join(f"a_{i} = {start + step * (i - 1)}" for i in range(1, count + 1)).encode()


def fit_detector(rows: list[dict], start: DetectorParams = DetectorParams(), normal: str = "full",
                 say: Callable[[str], None] = lambda line: None) -> DetectorParams:
    """The thresholds from candidates' statistics: each signal's Otsu split where it was measured (a full entropy
    window; a full text window, zstd checked) on at least MIN_CANDIDATES candidates, kept at separability
    MIN_SEPARABILITY or more and at most MAX_FALSE_KILLS% of `normal`'s candidates killed, else `start`'s; `say`
    hears what each signal showed."""
    measured = {"tau_entropy": ("max_mean_entropy", [r for r in rows if r["tokens"] >= start.entropy_window
                                                     and r.get("max_mean_entropy") is not None]),
                "tau_compression": ("min_compression", [r for r in rows if r["min_compression"] < 1.0])}
    chosen = {}
    for field, (key, subset) in measured.items():
        counts = {s: sum(r["setting"] == s for r in subset) for s in sorted({r["setting"] for r in subset})}
        say(f"{key}: {len(subset)} candidates ({', '.join(f'{s} {n}' for s, n in counts.items())})")
        for s in counts:
            v = np.array([r[key] for r in subset if r["setting"] == s])
            say(f"  {s:8s}: min {v.min():.3f}  p50 {np.median(v):.3f}  max {v.max():.3f}")
        if len(subset) < MIN_CANDIDATES:
            say(f"  not measured (at least {MIN_CANDIDATES} candidates needed): {getattr(start, field)} kept")
            continue
        threshold, separability = otsu_threshold([r[key] for r in subset])  # the detector's own calibration
        trial = dataclasses.replace(WATCH_ONLY, **{field: threshold})
        false_kills = kill_rates([r for r in subset if r["setting"] == normal], trial).get(normal, 0.0)
        keep = separability >= MIN_SEPARABILITY and false_kills <= MAX_FALSE_KILLS
        say(f"  Otsu: threshold {threshold:.3f}, separability {separability:.2f}, it would kill "
            + ", ".join(f"{s} {v:.1f}%" for s, v in kill_rates(subset, trial).items())
            + ("" if keep else f": not used (separability < {MIN_SEPARABILITY} or > {MAX_FALSE_KILLS}% {normal} "
                               f"kills), {getattr(start, field)} kept"))
        if keep:
            chosen[field] = round(threshold, 6)  # a histogram's midpoint: its last digits are the float sum's
    normal_text = [r["text"].encode() for r in rows if r["setting"] == normal and len(r["text"].encode()) >= 256]
    ratios = [compression_ratio(t[i:i + 256]) for t in normal_text for i in range(0, len(t) - 255, 64)]
    for label, text in {"a_1 = 2, a_2 = 4, ...": enumeration(2, 2, 40),
                        "a_1 = 3, a_2 = 10, ... (+7)": enumeration(3, 7, 40)}.items():
        say(f"zstd ratio of 256 bytes of {label}: {compression_ratio(text[:256]):.3f}")
    if ratios:
        say(f"zstd ratio of 256-byte windows of {normal} steps ({len(ratios)}): min {min(ratios):.3f}, "
            f"p50 {np.median(ratios):.3f}")
    fitted = dataclasses.replace(start, **chosen)
    for label, params in (("starting", start), ("chosen", fitted)):
        say(f"kill rate at the {label} thresholds (entropy {params.tau_entropy:.3f}, zstd {params.tau_compression:.3f}): "
            + ", ".join(f"{s} {v:.1f}%" for s, v in kill_rates(rows, params).items()))
    return fitted
