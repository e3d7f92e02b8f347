"""The paper's tables from a results JSONL file (one line per problem × configuration).

Table 2 (ablation), one row per configuration (dataset, mode, budget, N, policy, setup; seeds pooled):
  problems, pass@1, degeneration, length-cap stops, base tokens, committed steps, the helper's share of
  them, early exits, helper tokens, problems per minute, PRM seconds and, for kvrescue rows, the accuracy recovered; below it,
  per kvrescue row, the share of the accuracy lost to eviction that it recovers and its base tokens
  relative to evicted best-of-N; where a bon row and a helper row of the same N exist, the oracle
  pick between their answers (the paper's Figure 1a); and where KV-Rescue ran with the PRM's choice and
  with random choice, the two on the problems both ran (paired bootstrap interval of the difference), and so
  each further setup of a configuration against its first.
Table 1 (decode cost), per configuration: mean seconds per problem inside llama.cpp for the base and
  the helper, in the PRM, in orchestration (the rest), in total; tokens per second of base and helper.
Table 3 (throughput and KV memory by concurrency, and the memory-capped view), from rows that record
  their engine (see kvrescue_local/bench/throughput.py); several results files of one sweep run at
  different concurrencies are read together, and Tables 2 and 1 count each problem once.
The regime map (rows of several helpers, each alone and in KV-Rescue, beside full KV and evicted best-of-N): per
  helper and budget, its strength alone against full KV's, the share of the gap KV-Rescue recovers (paired
  bootstrap interval), the oracle's share and the helper's share of the committed steps (bench/regime.py).
Every number is defined in kvrescue_local/bench/metrics.py. Rows of one configuration made with different
setups (model files, prompt template, settings; seeds aside) are shown apart, with a setup column and notes
naming what differs, unless pool_setups pools them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KVRescueError
from ..files import check_input_file, decompressed
from .metrics import (DEFAULT_CACHE, ConfigKey, PairedComparison, Summary, check_comparisons, choice_comparisons,
                      config_key, judge_comparisons, oracles, problem_keys, rule_comparisons, setup_comparisons,
                      setup_notes, summaries)
from .regime import RegimePoint, regime_map
from .results_file import REPORTED_ROW_SHAPE, rows_of
from .throughput import Throughput, same_axes, throughputs

MIB = 1024 * 1024


# --- reading -------------------------------------------------------------------------------------

def load_results(path: str | Path) -> list[dict]:
    """Every line of a results file (plain or zstd-compressed), checked; blank lines are skipped."""
    path = Path(path)
    if path.exists():  # a device or FIFO would be read endlessly
        check_input_file(path, "results file")
    try:
        data = decompressed(path.read_bytes(), path)
        data.decode("utf-8")  # a binary file is one error naming the file, not its first line
    except FileNotFoundError:
        raise KVRescueError(f"results file not found: {path}; pass the JSONL written by `kvrescue-local bench`") from None
    except IsADirectoryError:
        raise KVRescueError(f"{path} is a directory; pass the results .jsonl file inside it") from None
    except UnicodeDecodeError:
        raise KVRescueError(f"{path} is not UTF-8 text: pass the results .jsonl written by `kvrescue-local bench`") from None
    except OSError as exc:
        raise KVRescueError(f"cannot read {path} ({exc.strerror}): check the path and its permissions") from None
    rows = rows_of(data, path, REPORTED_ROW_SHAPE)
    if not rows:
        raise KVRescueError(f"{path} holds no results: run `kvrescue-local bench` first (or pass another file)")
    return rows


def distinct_rows(rows: list[dict]) -> tuple[list[dict], int]:
    """The rows less repeats, and how many were left out: a row of the problem, configuration, setup and run of one
    before it is the same result read twice (a file given twice, or a shard given beside the merge holding it),
    which would count twice in Table 3's problems per minute and in the plots."""
    seen: set[tuple] = set()
    out = []
    for row in rows:
        engine = row.get("engine") if isinstance(row.get("engine"), dict) else {}
        key = (config_key(row), json.dumps([row.get("id"), row.get("problem_sha256"), engine.get("run")]))
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out, len(rows) - len(out)


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


def quantized_axes(items: list[Summary]) -> bool:
    """Whether the rows sweep weights or KV cache types (then the tables show them)."""
    return any(s.key.weights or s.key.kv_cache != DEFAULT_CACHE or s.key.helper_kv_cache != DEFAULT_CACHE for s in items)


def _config_cells(s: Summary, with_dataset: bool, with_setup: bool, with_quantization: bool = False) -> list[str]:
    cells = [s.key.dataset] if with_dataset else []
    if with_quantization:
        cells += [s.key.weights or "-", s.key.kv_cache if s.key.uses_base else "-",
                  s.key.helper_kv_cache if s.key.uses_helper else "-"]
    cells += [s.key.mode_label, "-" if s.key.budget is None else str(s.key.budget), str(s.key.n), s.key.policy or "-"]
    if with_quantization:
        cells.append("-" if s.budget_kv_bytes is None else fmt(s.budget_kv_bytes / MIB, 3))
    return cells + ([s.key.setup] if with_setup else [])


def _config_headers(with_dataset: bool, with_setup: bool, with_quantization: bool = False) -> list[str]:
    return ((["dataset"] if with_dataset else []) + (["weights", "KV", "helper KV"] if with_quantization else [])
            + ["mode", "budget", "N", "policy"] + (["KV MiB/seq"] if with_quantization else [])
            + (["setup"] if with_setup else []))


def table2(items: list[Summary]) -> Table:
    with_dataset = len({s.key.dataset for s in items}) > 1
    setups = setup_notes(items)
    with_setup = bool(setups)
    quant = quantized_axes(items)
    config_headers = _config_headers(with_dataset, with_setup, quant)
    headers = config_headers + ["problems", "pass@1 %", "degen %", "cap %", "base tok", "steps", "helper steps %",
                                "early exit %", "helper tok", "prob/min", "PRM s", "recovered %"]
    watched = any(s.helper_kills is not None for s in items)  # the helper's kills, where a detector watched it
    headers += ["helper kills", "fallbacks"] if watched else []
    checked = any(s.key.check_arithmetic for s in items)
    headers += ["set aside"] if checked else []
    rows = []
    for s in items:
        rows.append(_config_cells(s, with_dataset, with_setup, quant) + [
            str(s.problems), fmt(s.pass1), fmt(s.degeneration), fmt(s.length_capped),
            fmt(s.base_tokens, 0) if s.key.uses_base else "-", fmt(s.steps), fmt(s.helper_step_share),
            fmt(s.early_exit),
            fmt(s.helper_tokens, 0) if s.key.uses_helper else "-", fmt(s.problems_per_minute, 2), fmt(s.prm_s, 3),
            fmt(s.recovered)]
            + ([fmt(s.helper_kills), "-" if s.fallbacks is None else str(s.fallbacks)] if watched else [])
            + (["-" if s.set_aside is None else str(s.set_aside)] if checked else []))
    align = ["l"] * len(config_headers) + ["r"] * (len(headers) - len(config_headers))
    notes = setups + ["degen %: wrong and >= 256 committed steps (or the step cap, if lower), among all trajectories; "
             "cap %: stopped by the token or step cap; helper steps %: of the committed steps, the helper's; "
             "early exit %: killed / all base candidates; "
             + ("helper kills: helper candidates killed per problem, where the detector watched the helper; fallbacks: "
                "rounds whose candidates all died, committing the least degenerate (summed); " if watched else "") +
             ("set aside: survivors whose step stated false arithmetic while another of their round stated none "
              "(summed, +arith rows); " if checked else "") +
             "recovered %: (kvrescue - bon) / (full - bon) pass@1 at the same budget and N, on the problems all three "
             "ran (full: at the smallest N run when not at that N, named below); tokens and seconds are "
             "means per problem; prob/min = problems / summed wall time."]
    for s in items:
        if s.recovered is not None:
            full = "" if s.recovered_full_n == s.key.n else f" (full KV at N = {s.recovered_full_n}: none at N = {s.key.n})"
            notes.append(f"{s.key.label}: KV-Rescue recovers {s.recovered:.0f}% of the accuracy eviction costs{full}, "
                         f"with {fmt(s.base_token_ratio, 2)}x the base tokens of evicted best-of-N, on the "
                         f"{s.recovered_problems} problems all three ran")
    return Table("Table 2: ablation", headers, rows, align, notes)


def table1(items: list[Summary]) -> Table:
    with_dataset = len({s.key.dataset for s in items}) > 1
    setups = setup_notes(items)
    with_setup = bool(setups)
    quant = quantized_axes(items)
    headers = _config_headers(with_dataset, with_setup, quant) + ["problems", "llama base s", "llama helper s", "PRM s",
                                                           "orch s", "total s", "base tok/s", "helper tok/s"]
    rows = []
    for s in items:
        rows.append(_config_cells(s, with_dataset, with_setup, quant) + [
            str(s.problems), fmt(s.llama_base_s, 3) if s.key.uses_base else "-",
            fmt(s.llama_helper_s, 3) if s.key.uses_helper else "-", fmt(s.prm_s, 3), fmt(s.orchestration_s, 3),
            fmt(s.total_s, 3), fmt(s.base_tok_s, 0) if s.key.uses_base else "-",
            fmt(s.helper_tok_s, 0) if s.key.uses_helper else "-"])
    align = ["l"] * len(_config_headers(with_dataset, with_setup, quant)) + ["r"] * 8
    notes = setups + ["seconds are means per problem; tok/s = tokens generated / seconds inside llama.cpp for that model "
             "(killed candidates' tokens included)."]
    return Table("Table 1: decode cost", headers, rows, align, notes)


def comparison_notes(rows: list[dict], pool_setups: bool) -> list[str]:
    notes = []
    for o in oracles(rows, pool_setups):
        full = "" if o.full_pass1 is None else f", full KV {fmt(o.full_pass1)}%"
        gap = "" if o.gap_closed is None else f": it closes {o.gap_closed:.0f}% of the gap eviction opens"
        notes.append(f"oracle pick, {o.bon.label} or helper n{o.bon.n}, on the {o.problems} problems both ran: "
                     f"{fmt(o.oracle_pass1)}% (evicted {fmt(o.bon_pass1)}%, helper {fmt(o.helper_pass1)}%{full}){gap}")
    for c in rule_comparisons(rows, pool_setups):
        notes.append(f"{c.a.label} vs {c.b.label}, on the {c.problems} problems both ran: {paired_text(c)}")
    judged = judge_comparisons(rows, pool_setups)
    for c in judged:
        twice = sum(other.a == c.a for other in judged) > 1  # the judge's rows of several setups: told apart
        notes.append(f"{c.a.label} vs the judge's pick, {c.b.label}{f' (setup {c.b.setup})' if twice else ''}, on "
                     f"the {c.problems} problems both ran: {paired_text(c)}")
    checks = check_comparisons(rows, pool_setups)
    for c in checks:
        twice = sum(other.a.label == c.a.label for other in checks) > 1  # told apart by their setups
        notes.append(f"{c.a.label}{f' (setup {c.a.setup})' if twice else ''} vs the same unchecked, {c.b.label}, on "
                     f"the {c.problems} problems both ran: {paired_text(c)}")
    choices = choice_comparisons(rows, pool_setups)
    for c in choices:
        twice = sum(other.a.label == c.a.label for other in choices) > 1  # told apart by their setups
        notes.append(f"PRM vs random choice, {c.a.label}{f' (setup {c.a.setup})' if twice else ''}, on the "
                     f"{c.problems} problems both ran: {paired_text(c)}")
    if not pool_setups:
        for c in setup_comparisons(rows):
            notes.append(f"setup {c.a.setup} vs {c.b.setup}, {c.b.label}, on the {c.problems} problems both ran: "
                         f"{paired_text(c)}")
    return notes


def paired_text(c: PairedComparison) -> str:
    return (f"{fmt(c.a_pass1)}% vs {fmt(c.b_pass1)}% (difference {c.a_pass1 - c.b_pass1:+.1f} points, 95% paired "
            f"bootstrap interval {c.low:+.1f} to {c.high:+.1f})")


def once_each(rows: list[dict], pool_setups: bool) -> list[dict]:
    """The first row of each problem and configuration: runs at other concurrencies repeat the same results. A row
    written before problems were fingerprinted is the same problem as the fingerprinted rows of its id (problem_keys)."""
    problem = {dataset: problem_keys([r for r in rows if r.get("dataset") == dataset])
               for dataset in {row.get("dataset") for row in rows}}
    first: dict[tuple, dict] = {}
    for row in rows:
        first.setdefault((row.get("dataset"), problem[row.get("dataset")](row), config_key(row, pool_setups)), row)
    return list(first.values())


def render(rows: list[dict], markdown: bool = False, pool_setups: bool = False, kv_cap: int | None = None) -> str:
    unique = once_each(rows, pool_setups)
    items = summaries(unique, pool_setups)
    tables = [table2(items), table1(items)]
    tables[0].notes += comparison_notes(unique, pool_setups)
    points = regime_map(unique)
    if points:
        tables.append(regime_table(points))
    speeds = throughputs(rows, pool_setups)
    if speeds:
        tables += [table3(speeds), memory_capped(speeds, kv_cap)]
    return "\n\n".join(t.markdown() if markdown else t.text() for t in tables) + "\n"


def regime_table(points: list[RegimePoint]) -> Table:
    """The regime map (bench/regime.py): one row per helper and KV-Rescue configuration, by helper ratio."""
    with_dataset = len({p.key.dataset for p in points}) > 1
    headers = (["dataset"] if with_dataset else []) + [
        "helper", "ratio", "budget", "N", "policy", "problems", "helper %", "full %", "bon %", "kvrescue %",
        "recovered %", "95% interval", "oracle %", "oracle recovered %", "helper steps %"]
    rows = []
    for p in points:
        interval = "-" if p.low is None else f"{p.low:.0f} to {p.high:.0f}"
        rows.append(([p.key.dataset] if with_dataset else []) + [
            p.helper, fmt(p.ratio, 2), str(p.key.budget), str(p.key.n), p.key.policy or "-", str(p.problems),
            fmt(p.helper_pass1), fmt(p.full_pass1), fmt(p.bon_pass1), fmt(p.kvrescue_pass1), fmt(p.recovered, 0),
            interval, fmt(p.oracle_pass1), fmt(p.oracle_recovered, 0), fmt(p.helper_steps)])
    notes = ["ratio: the helper's pass@1 alone / full KV's; recovered %: (kvrescue - bon) / (full - bon) at the row's "
             "budget and N, with its 95% paired bootstrap interval (problems resampled); oracle: the better of "
             "best-of-N's and the helper's whole answers, problem by problem, and the share of the gap it recovers; "
             "helper steps %: of KV-Rescue's committed steps, the helper's; all on the problems the four "
             "configurations ran."]
    align = ["l"] * (len(headers) - 14) + ["r"] * 14
    return Table("Regime map: KV-Rescue by the helper's strength", headers, rows, align, notes)


def _throughput_cells(key: ConfigKey) -> list[str]:
    return [key.mode_label, "-" if key.budget is None else str(key.budget), str(key.n)]


def table3(items: list[Throughput]) -> Table:
    headers = ["mode", "budget", "N", "K", "FA", "problems", "pass@1 %", "prob/min", "vs bon", "peak KV MiB",
               "base / helper / PRM MiB", "KV MiB per problem"]
    rows = []
    for t in items:
        bon = next((b for b in items if b.key.mode == "bon" and same_axes(b.key, t.key) and
                    (b.concurrency, b.flash_attn) == (t.concurrency, t.flash_attn)), None)
        ratio = t.per_minute / bon.per_minute if t.key.mode == "kvrescue" and bon and bon.per_minute and \
            t.per_minute else None
        parts = " / ".join(fmt(t.kv_parts[p] / MIB, 2) if p in t.kv_parts else "-" for p in ("base", "helper", "prm"))
        rows.append(_throughput_cells(t.key) + [str(t.concurrency), t.flash_attn, str(t.problems), fmt(t.pass1),
                                            fmt(t.per_minute, 2), fmt(ratio, 2) + ("x" if ratio else ""),
                                            fmt(t.kv_peak / MIB, 2), parts, fmt(t.kv_per_problem / MIB, 3)])
    notes = ["K: problems solved at once; FA: flash attention (on a CPU faster at K > 1, slower at K = 1); prob/min: "
             "problems / wall-clock seconds at that K (runs summed); vs bon: KV-Rescue's prob/min over evicted "
             "best-of-N's at the same budget, N, K and FA; peak KV: the most bytes the KV caches held at the end of a "
             "round (shared cells once), base + helper + PRM."]
    return Table("Table 3: throughput and KV memory by concurrency", headers, rows, ["l"] * 3 + ["r"] * 9, notes)


def memory_capped(items: list[Throughput], cap: int | None = None) -> Table:
    """How many problems each configuration fits in `cap` KV bytes (default: the largest peak measured)."""
    cap = cap or max(t.kv_peak for t in items)
    largest: dict[ConfigKey, Throughput] = {}
    for t in items:
        if t.key not in largest or t.concurrency > largest[t.key].concurrency:
            largest[t.key] = t
    rows = []
    for key, biggest in largest.items():
        fits = int(cap // biggest.kv_per_problem) if biggest.kv_per_problem > 0 else 0
        measured = [t for t in items if t.key == key and t.concurrency <= fits and t.per_minute]
        best = max(measured, key=lambda t: t.per_minute) if measured else None
        rows.append(_throughput_cells(key) + [
            fmt(biggest.kv_per_problem / MIB, 3), str(fits), "-" if best is None else str(best.concurrency),
            "-" if best is None else best.flash_attn, "-" if best is None else fmt(best.per_minute, 2)])
    notes = [f"At {cap / MIB:,.2f} MiB of KV caches (base, helper and PRM counted): fits = that budget / KV per "
             "problem (peak / K at the largest K measured); prob/min: the best measured at a K that fits (at K, with "
             "flash attention FA)."]
    return Table(f"Table 3, memory-capped: problems at once in {cap / MIB:,.2f} MiB of KV",
                 ["mode", "budget", "N", "KV MiB per problem", "fits", "at K", "FA", "prob/min"], rows,
                 ["l"] * 3 + ["r"] * 5, notes)


def report(path: str | Path, markdown: bool = False) -> str:
    return render(load_results(path), markdown)
