"""Reporting: Table 2 / Table 1 from results JSONL, plots, the HTML trajectory viewer (in headless
Chromium), the KV memory / compute estimate and the `report` / `estimate` commands."""

import json
import math
import re
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvrescue_local.bench.estimate import BUILTIN, estimate, parse_contexts, qwen2_spec, resolve_model, spec_from_gguf
from kvrescue_local.bench.metrics import (accuracy_recovered, choice_comparisons, oracles, result_line,
                                         setup_comparisons, setup_label, summaries)
from kvrescue_local.bench.report import load_results, render
from kvrescue_local.bench.run import results_config, sweep_axes
from kvrescue_local.cli.report import estimate_command, report
from kvrescue_local.bench.viewer import render_html, write_html
from kvrescue_local.cli import ProjectErrorsAsOneLine
from kvrescue_local.detect import DetectorParams
from kvrescue_local.errors import KVRescueError
from kvrescue_local.eviction import KVBudget
from kvrescue_local.gguf_export import TINY_BASE, random_qwen2_weights
from kvrescue_local.rescue import Rescue, RescueConfig

PROBLEMS = [("p1", "What is 2+3?", "5"), ("p2", "Let a=17 and b=25. What is a+b?", "42"), ("p3", "<b>x</b> & y", "0")]
SOME_KILLS = DetectorParams(tau_entropy=5.18, tau_compression=0.01)  # random weights: entropy ~5.13-5.21 nats
NO_KILL = DetectorParams(tau_entropy=50.0, tau_compression=0.01)
INJECTION = '</pre></td><script>document.body.setAttribute("data-pwned","1")</script><img src=x onerror="document.body.setAttribute(\'data-pwned\',\'2\')">\x08\u202e'


def rescue_config(mode, detector=NO_KILL):
    kv = KVBudget(budget=32, buffer=16, n_sink=4, window=8, policy="streaming")  # SOME_KILLS was fitted with it
    return RescueConfig(mode=mode, n=2, kv=kv, detector=detector, max_tokens=96, max_step_tokens=24, temperature=1.0,
                        top_p=0.95, seed=1)


@pytest.fixture(scope="module")
def runs(base_model, helper_model, tiny_prm):
    """Real loop runs on the tiny models: (results lines, one kvrescue trajectory record with kills)."""
    lines, kept = [], None
    for mode, detector in (("full", NO_KILL), ("bon", NO_KILL), ("kvrescue", SOME_KILLS)):
        cfg = rescue_config(mode, detector)
        axis = sweep_axes([mode], [cfg.kv.budget], [cfg.n], [cfg.kv.policy])[0]
        engine = Rescue(cfg, base_model, helper_model, tiny_prm)
        for pid, problem, gold in PROBLEMS:
            trajectory = engine.solve(problem)
            lines.append(result_line("tiny", pid, gold, trajectory.answer == gold, axis.key,
                                     results_config(axis, cfg), trajectory))
            if mode == "kvrescue" and kept is None and trajectory.killed:
                kept = trajectory.to_json()
    assert kept is not None, "the detector threshold kills some random-weight base candidates"
    return lines, kept


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def synthetic(mode, n, budget, correct, degenerate=(), policy="streaming", dataset="math500"):
    """Hand-made lines with known pass@1 / degeneration (the tiny models never answer correctly)."""
    out = []
    for i, ok in enumerate(correct):
        out.append({"dataset": dataset, "id": f"q{i}",
                    "config": {"mode": mode, "n": n, "budget": budget if mode in ("bon", "kvrescue") else 0,
                               "policy": policy if mode in ("bon", "kvrescue") else "none",
                               "tau_entropy": 3.0, "tau_compression": 0.35},
                    "correct": ok, "stop": "max_steps" if i in degenerate else "eos",
                    "n_steps": 256 + i if i in degenerate else 10 + i,
                    "steps_from": {"base": 6, "helper": 4 + i} if mode == "kvrescue" else {"base": 10 + i},
                    "tokens": {"base": 100 * (i + 1), "helper": 50 if mode == "kvrescue" else 0, "committed": 90},
                    "base_candidates": 20, "killed": 2 if mode == "kvrescue" else 0,
                    "detector": [{"max_mean_entropy": 0.5 + 0.1 * i, "min_compression": 0.9, "killed": None},
                                 {"max_mean_entropy": 4.0, "min_compression": 0.2, "killed": "repetition"}]
                    if mode == "kvrescue" else [],
                    "timings": {"llama_base": 1.0, "llama_helper": 0.5 if mode == "kvrescue" else 0.0, "prm": 0.25,
                                "orchestration": 0.25, "total": 2.0 if mode == "kvrescue" else 1.5}})
    return out


SYNTHETIC = (synthetic("full", 8, 0, [True, True, True, False])
             + synthetic("bon", 8, 64, [True, False, False, False], degenerate=(1, 2))
             + synthetic("kvrescue", 8, 64, [True, True, False, False])
             + synthetic("kvrescue", 8, 128, [True, True, True, False]))


def table_lines(text: str, title: str) -> list[str]:
    block = text.split(title, 1)[1].strip("\n").split("\n\n")[0].splitlines()
    return block


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


# --- tables ----------------------------------------------------------------------------------------

def test_tables_from_real_runs(runs, tmp_path):
    lines, _ = runs
    rows = load_results(write_jsonl(tmp_path / "results.jsonl", lines))
    assert len(rows) == 9
    by_mode = {s.key.mode: s for s in summaries(rows)}
    assert list(by_mode) == ["full", "bon", "kvrescue"]  # fixed mode order, not file order
    for mode, s in by_mode.items():
        mine = [r for r in lines if r["config"]["mode"] == mode]
        assert s.problems == 3 and s.pass1 == 0.0
        assert s.base_tokens == pytest.approx(sum(r["tokens"]["base"] for r in mine) / 3)
        assert s.helper_tokens == pytest.approx(sum(r["tokens"]["helper"] for r in mine) / 3)
        assert s.steps == pytest.approx(sum(r["n_steps"] for r in mine) / 3)
        assert s.prm_s == pytest.approx(sum(r["timings"]["prm"] for r in mine) / 3)
        assert s.problems_per_minute == pytest.approx(3 * 60 / sum(r["timings"]["total"] for r in mine))
        assert s.llama_base_s == pytest.approx(sum(r["timings"]["llama_base"] for r in mine) / 3)
        assert s.base_tok_s == pytest.approx(sum(r["tokens"]["base"] for r in mine)
                                             / sum(r["timings"]["llama_base"] for r in mine))
        assert s.degeneration == 0.0  # every trajectory is incorrect, none is 256 steps long
    kv = by_mode["kvrescue"]
    base_candidates = sum(len(r["detector"]) for r in lines if r["config"]["mode"] == "kvrescue")
    assert base_candidates == sum(r["base_candidates"] for r in lines if r["config"]["mode"] == "kvrescue")
    killed = sum(d["killed"] is not None for r in lines if r["config"]["mode"] == "kvrescue" for d in r["detector"])
    assert 0 < killed < base_candidates
    assert kv.early_exit == pytest.approx(100 * killed / base_candidates)
    assert by_mode["bon"].early_exit == 0.0 and by_mode["full"].helper_tok_s is None
    assert kv.recovered is None, "full does not beat bon: nothing to recover"

    text = render(rows)
    t2 = table_lines(text, "Table 2: ablation")
    header, rule, *body = t2
    assert header.split()[:4] == ["mode", "budget", "N", "policy"] and len(body) == 3 + 2  # + the note, the pairing
    assert " vs bon " in body[-1] and "paired bootstrap interval" in body[-1]  # KV-Rescue against best-of-N
    data = body[:3]
    assert all(len(line) == len(rule) for line in data), "right-aligned columns end together"
    kv_line = next(line for line in data if line.startswith("kvrescue"))
    assert kv_line.split()[:6] == ["kvrescue", "32", "2", "streaming", "3", "0.0"]
    assert f"{kv.base_tokens:,.0f}" in kv_line and f"{kv.early_exit:.1f}" in kv_line
    assert next(line for line in data if line.startswith("full")).split()[1:4] == ["-", "2", "-"]
    t1 = table_lines(text, "Table 1: decode cost")
    assert f"{kv.llama_base_s:.3f}" in next(line for line in t1 if line.startswith("kvrescue"))
    full_t1 = next(line for line in t1 if line.startswith("full")).split()
    assert full_t1[6] == "-" and full_t1[-1] == "-", "full has no helper"


def test_pass1_degeneration_and_accuracy_recovered(tmp_path):
    rows = load_results(write_jsonl(tmp_path / "r.jsonl", SYNTHETIC))
    s = {(x.key.mode, x.key.budget): x for x in summaries(rows)}
    assert s["full", None].pass1 == 75.0 and s["bon", 64].pass1 == 25.0 and s["kvrescue", 64].pass1 == 50.0
    assert s["bon", 64].degeneration == 50.0  # 2 wrong trajectories of 256+ steps among all 4, as in the paper
    assert s["bon", 64].length_capped == 50.0 and s["kvrescue", 64].length_capped == 0.0
    assert s["kvrescue", 64].recovered == pytest.approx(50.0)  # (50 - 25) / (75 - 25)
    assert s["kvrescue", 128].recovered is None, "no bon row at budget 128"
    assert s["kvrescue", 64].early_exit == pytest.approx(10.0)  # 8 killed of 80
    assert s["kvrescue", 64].helper_step_share == pytest.approx(100 * 22 / 46)  # helper 4+5+6+7, base 4 x 6
    assert s["bon", 64].helper_step_share is None and s["full", None].helper_step_share is None
    assert s["kvrescue", 64].problems_per_minute == pytest.approx(4 * 60 / 8.0)
    assert s["kvrescue", 64].base_tok_s == pytest.approx(1000 / 4.0)
    assert s["full", None].degeneration == 0.0
    assert accuracy_recovered(80.0, 50.0, 50.0) is None
    assert s["kvrescue", 64].recovered_full_n == 8
    text = render(rows)
    kv64 = next(line for line in table_lines(text, "Table 2: ablation") if line.startswith("kvrescue  64"))
    assert kv64.split()[4:8] == ["4", "50.0", "0.0", "0.0"] and kv64.split()[10] == "47.8" and kv64.split()[-1] == "50.0"
    assert "kvrescue b64 n8 streaming: KV-Rescue recovers 50% of the accuracy eviction costs, with 1.00x" in text


def test_recovered_at_an_n_without_full_rows_compares_with_the_smallest_n_run(tmp_path):
    lines = (SYNTHETIC + synthetic("full", 2, 0, [True, True, False, False])
             + synthetic("bon", 4, 64, [False, False, False, False])
             + synthetic("kvrescue", 4, 64, [True, False, False, False]))
    rows = load_results(write_jsonl(tmp_path / "r.jsonl", lines))
    s = {(x.key.mode, x.key.budget, x.key.n): x for x in summaries(rows)}
    assert s["kvrescue", 64, 8].recovered == pytest.approx(50.0) and s["kvrescue", 64, 8].recovered_full_n == 8
    four = s["kvrescue", 64, 4]
    assert four.recovered_full_n == 2 and four.recovered == pytest.approx(50.0)  # (25 - 0) / (50 - 0)
    t2 = table_lines(render(rows), "Table 2: ablation")
    assert any("kvrescue b64 n4" in line and "(full KV at N = 2: none at N = 4)" in line for line in t2)
    assert not any("kvrescue b64 n8" in line and "full KV at N" in line for line in t2)


def test_recovered_counts_only_the_problems_all_three_configurations_ran(tmp_path):
    """A sweep in progress: full KV has run two problems more than bon and kvrescue (both right); they must not
    raise full's accuracy in the recovered share, and the note says on how many problems it is."""
    extra = synthetic("full", 8, 0, [False, False, False, False, True, True])[4:]
    rows = load_results(write_jsonl(tmp_path / "r.jsonl", SYNTHETIC + extra))
    s = {(x.key.mode, x.key.budget): x for x in summaries(rows)}
    assert s["full", None].problems == 6 and s["full", None].pass1 == pytest.approx(100 * 5 / 6)
    assert s["kvrescue", 64].recovered == pytest.approx(50.0)  # (50 - 25) / (75 - 25) on q0-q3, as without them
    assert s["kvrescue", 64].recovered_problems == 4
    assert s["kvrescue", 64].base_token_ratio == pytest.approx(1.0)
    text = render(rows)
    assert ("kvrescue b64 n8 streaming: KV-Rescue recovers 50% of the accuracy eviction costs, with 1.00x the base "
            "tokens of evicted best-of-N, on the 4 problems all three ran") in text


def test_prm_and_random_choice_are_compared_on_the_problems_both_ran(tmp_path):
    chosen = synthetic("kvrescue", 4, 64, [True, True, True, False])
    drawn = synthetic("kvrescue", 4, 64, [True, False, False])  # q3 not run at random: left out
    for row in drawn:
        row["config"]["rule"] = "random"
    other_budget = synthetic("kvrescue", 4, 128, [False, False])
    for row in other_budget:
        row["config"]["rule"] = "random"
    rows = load_results(write_jsonl(tmp_path / "r.jsonl", chosen + drawn + other_budget))
    (c,) = choice_comparisons(rows)
    assert (c.a.budget, c.problems, c.a_pass1, c.b_pass1) == (64, 3, 100.0, pytest.approx(100 / 3))
    assert 0.0 <= c.low <= 200 / 3 <= c.high <= 100.0
    assert (f"PRM vs random choice, kvrescue b64 n4 streaming, on the 3 problems both ran: 100.0% vs 33.3% "
            f"(difference +66.7 points, 95% paired bootstrap interval {c.low:+.1f} to {c.high:+.1f})") in render(rows)


def test_a_configuration_run_again_counts_each_problem_once_also_beside_rows_from_before_fingerprints(tmp_path):
    """Rows written before problems were fingerprinted and a later run of the same configuration, fingerprinted, are
    the same problems: the table and the pairing both take the first rows given, once each."""
    evicted = synthetic("bon", 1, 64, [False, False, False, False])
    first = synthetic("kvrescue", 1, 64, [True, True, False, False])
    again = synthetic("kvrescue", 1, 64, [True, False, False, False])
    for row in [*evicted, *again]:
        row["problem_sha256"] = f"sha-{row['id']}"
    elsewhere = synthetic("kvrescue", 1, 64, [False, False, False, False], dataset="gsm8k")  # the same ids
    for row in elsewhere:
        row["problem_sha256"] = f"other-{row['id']}"
    text = render(load_results(write_jsonl(tmp_path / "r.jsonl", evicted + first + again + elsewhere)))
    row = next(line.split() for line in table_lines(text, "Table 2") if line.split()[:2] == ["math500", "kvrescue"])
    assert row[5:7] == ["4", "50.0"], "4 problems once each, the first run's 2 right"
    assert "kvrescue b64 n1 streaming vs bon b64 n1 streaming, on the 4 problems both ran: 50.0% vs 0.0%" in text


def test_a_checked_configuration_is_compared_with_the_same_unchecked_and_counts_what_it_set_aside(tmp_path):
    unchecked = synthetic("kvrescue", 1, 64, [True, False, False, False])
    checked = synthetic("kvrescue", 1, 64, [True, True, False])
    rule = "by-budget:64,calibrated:1,0,1,0,lead:base"
    for i, row in enumerate(checked):
        row["config"]["rule"] = f"arith:{rule}"
        row["arithmetic_demoted"] = i
    for row in unchecked:
        row["config"]["rule"] = rule
    refit = synthetic("kvrescue", 1, 64, [False, False, False])  # checked, with another calibration: not paired
    for row in refit:
        row["config"]["rule"] = f"arith:{rule.replace('1,0,1,0', '2,-2,2,-1')}"
    for row in unchecked + checked + refit:
        row["setup"] = {"models": {}, "prompt_sha256": "p", "settings": {"rule": row["config"]["rule"]}}
    rows = load_results(write_jsonl(tmp_path / "r.jsonl", unchecked + checked + refit))
    text = render(rows, markdown=True)
    header, _, *body = text.split("**Table 2: ablation**", 1)[1].strip("\n").split("\n\n")[0].splitlines()
    header = cells(header)
    set_aside = {(cells(line)[0], cells(line)[header.index("pass@1 %")]): cells(line)[header.index("set aside")]
                 for line in body}
    assert set_aside == {("kvrescue/regime", "25.0"): "-", ("kvrescue/regime+arith", "66.7"): "3",  # 0 + 1 + 2
                         ("kvrescue/regime+arith", "0.0"): "0"}
    paired = [line for line in text.splitlines() if "vs the same unchecked" in line]
    assert len(paired) == 1 and re.search(
        r"kvrescue/regime\+arith b64 n1 streaming vs the same unchecked, kvrescue/regime b64 n1 streaming, on the 3 "
        r"problems both ran: 66.7% vs 33.3% \(difference \+33.3 points", paired[0]), paired


def test_two_setups_of_one_configuration_are_compared_on_the_problems_both_ran(tmp_path):
    """Rows of one configuration run with two helper files (a setup each) are paired by problem, the later setup
    against the first, and each is compared with random choice under its setup's name; pooled, there is one
    setup and nothing to compare."""
    rows = []
    for model, outcomes in (("helper-a.gguf", [True, False, False, True]), ("helper-b.gguf", [True, True, True])):
        for row in synthetic("kvrescue", 1, 64, outcomes):
            row["setup"] = {"models": {"helper": {"file": model, "size": 1, "sha256": model * 4}}, "prompt_sha256": "p",
                            "settings": {"seed": 0}}
            rows.append(row)
    drawn = synthetic("kvrescue", 1, 64, [False, False, False])
    for row in drawn:
        row["config"]["rule"] = "random"
        row["setup"] = rows[0]["setup"]
    rows = load_results(write_jsonl(tmp_path / "r.jsonl", rows + drawn))
    assert len(choice_comparisons(rows)) == 2
    assert [line.split(", on the")[0] for line in render(rows).splitlines() if line.startswith("PRM vs random")] == [
        f"PRM vs random choice, kvrescue b64 n1 streaming (setup {c.a.setup})" for c in choice_comparisons(rows)]
    (c,) = setup_comparisons(rows)
    assert c.problems == 3 and sorted([c.a_pass1, c.b_pass1]) == [pytest.approx(100 / 3), 100.0]
    difference = c.a_pass1 - c.b_pass1  # its sign: which setup is first follows their labels
    assert c.a.setup != c.b.setup and c.low <= difference <= c.high and abs(difference) == pytest.approx(200 / 3)
    assert (f"setup {c.a.setup} vs {c.b.setup}, kvrescue b64 n1 streaming, on the 3 problems both ran: "
            f"{c.a_pass1:.1f}% vs {c.b_pass1:.1f}% (difference {difference:+.1f} points, 95% paired bootstrap "
            f"interval {c.low:+.1f} to {c.high:+.1f})") in render(rows)
    assert "setup " not in render(rows, pool_setups=True).replace("setups ", "")


def test_a_setup_note_names_settings_one_setup_records_beside_those_both_do(tmp_path):
    """Rows of one rule by budget fitted twice (its parameters differ), one of them recording one more setting: the note names
    the rule both record, by its spec, and a setting only the later ones record."""
    rows = []
    for settings, outcomes in (({"rule": "by-budget:64,judge,lead:base"}, [True, False]),
                               ({"rule": "by-budget:64,calibrated:2,-2,2,-1,lead:base,margin=0",
                                 "max_step_tokens": 32}, [True, True])):
        for row in synthetic("kvrescue", 1, 64, outcomes):
            row["config"]["rule"] = "by-budget:64,judge,lead:base"
            row["setup"] = {"models": {}, "prompt_sha256": "p", "settings": settings}
            rows.append(row)
    notes = [line for line in render(load_results(write_jsonl(tmp_path / "r.jsonl", rows))).splitlines()
             if "kvrescue/regime b64 n1 streaming: setup " in line]
    assert notes and len(set(notes)) == 1, notes  # under each table that shows setups
    note = notes[0]
    first, later = note.split(": setup ")[1].split(": ")[0].split(" vs ")
    assert {first, later} == {setup_label(rows[0]), setup_label(rows[-1])}
    rules = ["'by-budget:64,judge,lead:base'", "'by-budget:64,calibrated:2,-2,2,-1,lead:base,margin=0'"]
    if first != setup_label(rows[0]):
        rules.reverse()
    assert f"rule {rules[0]} vs {rules[1]}" in note
    assert f"max_step_tokens 32 recorded by {setup_label(rows[-1])} only" in note


def test_the_oracle_pick_takes_either_right_answer_on_the_problems_both_ran(tmp_path):
    rows = (synthetic("full", 1, 0, [True, True, True, False])
            + synthetic("bon", 1, 64, [True, False, False, False])
            + synthetic("helper", 1, 0, [False, True, False]))  # q3 not run by the helper: left out
    settings = {"prompt_sha256": "p", "settings": {"max_tokens": 768, "seed": 0}}
    for row in rows:  # as a sweep records them: the helper's rows name other models than the base's
        model = "helper.gguf" if row["config"]["mode"] == "helper" else "base.gguf"
        row["setup"] = {"models": {"m": {"file": model, "size": 1, "sha256": model}}, **settings}
    (oracle,) = oracles(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    assert (oracle.problems, oracle.bon_pass1, oracle.full_pass1) == (3, pytest.approx(100 / 3), 100.0)
    assert oracle.oracle_pass1 == pytest.approx(200 / 3) and oracle.gap_closed == pytest.approx(50.0)
    assert ("oracle pick, bon b64 n1 streaming or helper n1, on the 3 problems both ran: 66.7% (evicted 33.3%, "
            "helper 33.3%, full KV 100.0%): it closes 50% of the gap eviction opens") in render(load_results(
                write_jsonl(tmp_path / "r.jsonl", rows)))
    assert oracles(load_results(write_jsonl(tmp_path / "s.jsonl", SYNTHETIC))) == [], "no helper row: no oracle"
    for row in rows[-3:]:
        row["setup"] = {**row["setup"], "settings": {"max_tokens": 512, "seed": 0}}
    assert oracles(load_results(write_jsonl(tmp_path / "t.jsonl", rows))) == [], "other settings: not comparable"


def test_table3_keeps_random_choice_apart_and_names_it(tmp_path):
    """KV-Rescue choosing at random loads no PRM: its Table 3 rows are its own, labelled as in Table 2."""
    rows = []
    for choice, kv_parts in (("prm", {"base": 3, "helper": 2, "prm": 1}), ("random", {"base": 3, "helper": 2})):
        for row in synthetic("kvrescue", 4, 64, [True, False]):
            row["config"]["rule"] = {"prm": "judge"}.get(choice, choice)
            row["engine"] = {"concurrency": 1, "run": choice, "elapsed": 30.0, "flash_attn": "off",
                             "kv_peak_bytes": {part: size * 2**20 for part, size in kv_parts.items()}}
            rows.append(row)
    text = render(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    table3 = table_lines(text, "Table 3: throughput")
    capped = table_lines(text, "Table 3, memory-capped")
    for label, parts in (("kvrescue ", "3.00 / 2.00 / 1.00"), ("kvrescue/random ", "3.00 / 2.00 / -")):
        (line,) = [line for line in table3 if line.startswith(label)]
        assert parts in line
        assert len([line for line in capped if line.startswith(label)]) == 1


def test_degeneration_is_recomputed_from_the_steps_and_the_step_cap(tmp_path):
    """Old lines carry other definitions of `degenerate`: the report ignores the field. A configuration
    whose step cap is below 256 (the toy world's 32) is judged at its cap."""
    old = synthetic("bon", 1, 64, [False, False, True])
    old[0]["degenerate"] = True  # capped by tokens after 10 steps: not degenerate by the paper's definition
    old[0]["stop"] = "max_tokens"
    capped = synthetic("bon", 1, 32, [False, False, True])
    for row in capped:
        row["config"]["max_steps"] = 32
    capped[1]["n_steps"] = 32
    rows = load_results(write_jsonl(tmp_path / "r.jsonl", old + capped))
    s = {x.key.budget: x for x in summaries(rows)}
    assert s[64].degeneration == 0.0 and s[64].length_capped == pytest.approx(100 / 3)
    assert s[32].degeneration == pytest.approx(100 / 3)


def test_markdown_is_well_formed(runs, tmp_path):
    rows = SYNTHETIC + synthetic("bon", 8, 64, [False], policy="odd|name")
    md = render(load_results(write_jsonl(tmp_path / "r.jsonl", rows)), markdown=True)
    blocks = md.strip().split("\n\n")
    tables = [b for b in blocks if b.startswith("|")]
    assert [b.strip("*") for b in blocks if b.startswith("**")] == ["Table 2: ablation", "Table 1: decode cost"]
    assert len(tables) == 2
    for table in tables:
        header, rule, *body = table.splitlines()
        n = len(cells(header))
        assert re.fullmatch(r"\|(:?---:?\|)+", rule) and rule.count("|") == n + 1
        assert body and all(line.startswith("| ") and line.endswith(" |") and len(cells(line)) == n for line in body)
    assert "odd\\|name" in md, "a | inside a cell is escaped"
    assert "| kvrescue | 64 | 8 | streaming | 4 | 50.0 |" in md


# --- plots -----------------------------------------------------------------------------------------

def read_png(path):
    """(width, height, channels, rows) of an 8-bit non-interlaced PNG: a minimal decoder (zlib + unfiltering)."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and interlace == 0, "only 8-bit non-interlaced PNGs"
    ch = {0: 1, 2: 3, 4: 2, 6: 4}[colour]
    raw = zlib.decompress(b"".join(idat))
    stride, rows, prev = width * ch, [], bytearray(width * ch)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        if kind == 1:
            for i in range(ch, stride):
                line[i] = (line[i] + line[i - ch]) & 255
        elif kind == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, prev))
        elif kind == 3:
            for i in range(stride):
                line[i] = (line[i] + (((line[i - ch] if i >= ch else 0) + prev[i]) >> 1)) & 255
        elif kind == 4:
            for i in range(stride):
                a, b, c = (line[i - ch] if i >= ch else 0), prev[i], (prev[i - ch] if i >= ch else 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line)
        prev = line
    return width, height, ch, rows


def ink_fraction(path) -> float:
    """Share of pixels that differ from the top-left (background) pixel; 0 for a blank image."""
    width, height, ch, rows = read_png(path)
    pixels = np.frombuffer(b"".join(rows), np.uint8).reshape(height, width, ch)[..., :3]
    return float((pixels != pixels[0, 0]).any(axis=-1).mean())


def test_plots_are_written(runs, tmp_path):
    pytest.importorskip("matplotlib")
    from kvrescue_local.bench.plots import write_plots

    lines, _ = runs
    written = write_plots(SYNTHETIC + synthetic("bon", 8, 128, [True, False, False, False]) + lines, tmp_path / "plots")
    names = sorted(p.name for p in written)
    assert names == sorted(f"{kind}-{ds}.png" for kind in ("pass1_vs_budget", "step_sources", "detector_stats")
                           for ds in ("math500", "tiny"))
    for path in written:
        assert 0.02 < ink_fraction(path) < 0.9, f"{path.name} is blank or a single colour"
    only_full = write_plots(synthetic("full", 8, 0, [True]), tmp_path / "few")
    assert [p.name for p in only_full] == ["pass1_vs_budget.png"], "figures without data are skipped"


def test_histogram_bins_hold_every_value():
    from kvrescue_local.bench.plots import hist_bins

    for values in ([0.2, 0.9, 0.9], [0.1, 0.7], [5.0], [], [0.35, 0.2, 1.0]):
        bins = hist_bins(values)
        assert len(bins) == 41 and bins == sorted(bins)
        assert all(bins[0] < v < bins[-1] for v in values), "no value falls off either end"


def test_plots_without_matplotlib_name_the_extra(monkeypatch, tmp_path):
    import builtins

    from kvrescue_local.bench import plots

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(KVRescueError, match=r"pip install 'kvrescue-local\[plot\]'"):
        plots.write_plots(SYNTHETIC, tmp_path / "plots")
    assert not (tmp_path / "plots").exists()


# --- estimate --------------------------------------------------------------------------------------

def test_estimate_matches_hand_computed_7b_numbers():
    base, helper = BUILTIN["7b"], BUILTIN["1.5b"]
    assert base.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2 == 57_344
    assert helper.kv_bytes_per_token() == 2 * 28 * 2 * 128 * 2 == 28_672
    assert BUILTIN["72b"].kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2
    # Qwen2.5-Math-7B: 28 layers of (q,k,v with bias, o, SwiGLU 18944, 2 norms), untied 152064 x 3584 embeddings
    layer = (3584 * 3584 + 3584) + 2 * (3584 * 512 + 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    assert base.n_params == 28 * layer + 2 * 152064 * 3584 + 3584 == 7_615_616_512
    assert base.matmul_params == base.n_params - 152064 * 3584
    e = estimate(base, helper, budget=64, buffer=128, contexts=parse_contexts("1k,4k,32k"))
    assert [p.ctx for p in e.points] == [1024, 4096, 32768]
    p = e.points[1]
    assert p.full_kv == 4096 * 57_344 and p.base_kv == 192 * 57_344 and p.helper_kv == 4096 * 28_672
    assert p.full_flops == 2 * base.matmul_params + 4 * 28 * 28 * 128 * 4096
    assert p.rescue_flops == (2 * base.matmul_params + 4 * 28 * 28 * 128 * 192
                              + 2 * helper.matmul_params + 4 * 28 * 12 * 128 * 4096)
    table = e.table()
    row = next(line for line in table.splitlines() if line.lstrip().startswith("4,096"))
    assert row.split()[:6] == ["4,096", "224.0", "10.5", "112.0", "122.5", f"{224 / 122.5:.2f}"]
    assert "57,344 B/token" in table and "budget 64 + buffer 128 = 192" in table
    assert "| 4,096 | 224.0 | 10.5 |" in e.table(markdown=True)
    assert estimate(base, helper, cache=("q8_0", "q8_0")).points[0].full_kv == 1024 * 57_344 * 34 / 64
    quantized = estimate(base, helper, cache=("q4_0", "f16"), helper_cache=("f16", "f16")).points[0]
    assert quantized.base_kv == 192 * 57_344 * (18 / 32 + 2) / 4 and quantized.helper_kv == 1024 * 28_672


def test_estimate_reads_a_gguf_header(base_path):
    spec = spec_from_gguf(base_path)
    shape = TINY_BASE
    assert (spec.n_layer, spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim) == (4, 128, 4, 2, 32)
    assert spec.kv_bytes_per_token() == 2 * 4 * 2 * 32 * 2 == 1024
    weights = random_qwen2_weights(shape, seed=1)
    assert spec.n_params == sum(w.size for w in weights.values())
    assert spec.matmul_params == spec.n_params, "tied embeddings: the table is the output head"
    assert resolve_model(str(base_path)) == spec
    assert resolve_model("Qwen2.5-Math-7B") == BUILTIN["7b"] and resolve_model("72B") == BUILTIN["72b"]
    untied = qwen2_spec("x", 1, 8, 2, 1, 16, 10, tied=False, head_dim=4)
    assert untied.n_params - untied.matmul_params == 80


# --- commands --------------------------------------------------------------------------------------

def cli():
    group = ProjectErrorsAsOneLine("kvrescue-local")
    for command in (report, estimate_command):
        group.add_command(command)
    return group


def invoke(*args):
    return CliRunner().invoke(cli(), [str(a) for a in args])


def test_report_command(runs, tmp_path):
    lines, record = runs
    results = write_jsonl(tmp_path / "results.jsonl", lines)
    out = invoke("report", results)
    assert out.exit_code == 0, out.output
    assert "Table 2: ablation" in out.output and "Table 1: decode cost" in out.output
    md = invoke("report", results, "--markdown")
    assert md.exit_code == 0 and "| mode | budget | N | policy |" in md.output
    traj = tmp_path / "trajectory.json"
    traj.write_text(json.dumps(record))
    (tmp_path / "view").mkdir()  # an output's folder is never created
    page = invoke("report", results, "--html", traj, "--out", tmp_path / "view" / "t.html")
    assert page.exit_code == 0, page.output
    assert (tmp_path / "view" / "t.html").read_text().startswith("<!DOCTYPE html>")
    default = invoke("report", results, "--html", traj)
    assert default.exit_code == 0 and (tmp_path / "trajectory.html").exists()
    alone = invoke("report", "--html", traj, "--out", tmp_path / "alone.html")  # no RESULTS needed for a page
    assert alone.exit_code == 0 and "Table 2" not in alone.output, alone.output
    assert (tmp_path / "alone.html").read_text().startswith("<!DOCTYPE html>")
    if _has_matplotlib():
        plotted = invoke("report", results, "--plots", tmp_path / "plots")
        assert plotted.exit_code == 0 and "3 plots written" in plotted.output, plotted.output


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_estimate_command(base_path, tmp_path):
    out = invoke("estimate")
    assert out.exit_code == 0, out.output
    assert "Qwen2.5-Math-7B" in out.output and "57,344 B/token" in out.output and "32,768" in out.output
    big = invoke("estimate", "--base", "72b", "--budget", "128", "--buffer", "64", "-ctk", "q8_0", "-ctv", "q8_0", "--contexts",
                 "2k")
    assert big.exit_code == 0 and f"{2048 * 2 * 80 * 8 * 128 * 34 / 32 / 2**20:,.1f}" in big.output
    tiny = invoke("estimate", "--base", base_path, "--helper", base_path, "--contexts", "1024")
    assert tiny.exit_code == 0 and "1,024 B/token" in tiny.output
    if _has_matplotlib():
        plotted = invoke("estimate", "--plot", tmp_path / "est.png")
        assert plotted.exit_code == 0 and ink_fraction(tmp_path / "est.png") > 0.02


def assert_one_line_error(result, *fragments):
    assert result.exit_code != 0
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_bad_input_errors(tmp_path):
    good = json.dumps(SYNTHETIC[0])
    assert_one_line_error(invoke("report", tmp_path / "nope.jsonl"), "results file not found", "kvrescue-local bench")
    assert_one_line_error(invoke("report", tmp_path), "is a directory")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert_one_line_error(invoke("report", tmp_path / "empty.jsonl"), "holds no results")
    (tmp_path / "bad.jsonl").write_text(good + "\n" + good + "\n{not json\n")
    assert_one_line_error(invoke("report", tmp_path / "bad.jsonl"), "bad.jsonl:3 is not JSON", "remove that line")
    partial = {k: v for k, v in SYNTHETIC[0].items() if k not in ("timings", "correct")}
    (tmp_path / "partial.jsonl").write_text(good + "\n" + json.dumps(partial) + "\n")
    assert_one_line_error(invoke("report", tmp_path / "partial.jsonl"), "partial.jsonl:2 is not a results line",
                          "misses correct, timings")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    assert_one_line_error(invoke("report", tmp_path / "list.jsonl"), "list.jsonl:1 is not a results line",
                          "the line is [1, 2], not an object")
    broken = json.loads(good)
    broken["timings"]["total"] = "fast"
    (tmp_path / "nan.jsonl").write_text(json.dumps(broken) + "\n")
    assert_one_line_error(invoke("report", tmp_path / "nan.jsonl"), "nan.jsonl:1 is not a results line",
                          'timings.total is "fast", not a finite number >= 0')
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    assert_one_line_error(invoke("report", tmp_path / "bin.jsonl"), "not UTF-8")
    results = write_jsonl(tmp_path / "ok.jsonl", SYNTHETIC)
    assert_one_line_error(invoke("report", results, "--out", tmp_path / "x.html"), "--out", "--html")
    assert_one_line_error(invoke("report"), "pass a RESULTS .jsonl file")
    (tmp_path / "t.json").write_text('{"problem": "x"}')
    assert_one_line_error(invoke("report", results, "--html", tmp_path / "t.json"), "not a trajectory record",
                          "solve --json")
    assert_one_line_error(invoke("estimate", "--base", "13b"), "unknown model '13b'", "7b", ".gguf")
    (tmp_path / "fake.gguf").write_text("hello")
    assert_one_line_error(invoke("estimate", "--helper", tmp_path / "fake.gguf"), "is not a GGUF file")
    assert_one_line_error(invoke("estimate", "--base", tmp_path / "missing.gguf"), "GGUF file not found")
    assert_one_line_error(invoke("estimate", "--contexts", "1k,lots"), "context lengths")
    assert_one_line_error(invoke("estimate", "-ctk", "q3"), "-ctk", "q8_0")


# --- the HTML viewer -------------------------------------------------------------------------------

def hostile(record):
    """The record with a candidate whose text tries to break out of the page."""
    record = json.loads(json.dumps(record))
    step = record["steps"][0]
    step["candidates"][0]["text"] = INJECTION
    record["problem"] = "<i>2+3</i> & \"quotes\" </title><script>x()</script>"
    return record


def test_viewer_escapes_everything(runs):
    _, record = runs
    page = render_html(hostile(record))
    assert page.count("<script") == 1 and page.count("</script>") == 1, "only the viewer's own script"
    assert "<img" not in page and "onerror=\"document" not in page
    assert "&lt;script&gt;document.body.setAttribute(&quot;data-pwned&quot;" in page
    assert "&lt;i&gt;2+3&lt;/i&gt; &amp; &quot;quotes&quot;" in page
    assert '<span class="ctl" title="U+0008">\\x08</span>' in page and "&lt;U+202E&gt;" in page
    assert "default-src &#x27;none&#x27;" in page and "http" not in page.replace("http-equiv", "")
    n_killed = sum(c["finished"] == "killed" for s in record["steps"] for c in s["candidates"])
    assert page.count('<tr class="killed') == n_killed > 0
    assert page.count('<section class="step base"') == sum(s["source"] == "base" for s in record["steps"])
    assert page.count('<section class="step helper"') == sum(s["source"] == "helper" for s in record["steps"])
    with pytest.raises(KVRescueError, match="not a trajectory record"):
        render_html({"steps": "none"})


CHROMIUM = Path("/usr/bin/chromium")


def chromium(*args, user_data: Path):
    return subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", f"--user-data-dir={user_data}", "--enable-logging=stderr", "--v=0", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
def test_viewer_renders_in_headless_chromium(runs, tmp_path):
    _, record = runs
    record = hostile(record)
    page = write_html(record, tmp_path / "trajectory.html")
    url = page.resolve().as_uri() + "#all"  # #all: the viewer opens every round's candidates
    shot = tmp_path / "screenshot.png"
    done = chromium(f"--screenshot={shot}", "--window-size=1200,900", url, user_data=tmp_path / "profile-1")
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    width, height, _, _ = read_png(shot)
    assert (width, height) == (1200, 900)
    assert ink_fraction(shot) > 0.05, "the page rendered blank"
    dom = chromium("--dump-dom", url, user_data=tmp_path / "profile-2")
    assert dom.returncode == 0, dom.stderr[-2000:]
    n_killed = sum(c["finished"] == "killed" for s in record["steps"] for c in s["candidates"])
    assert 'data-viewer="ready"' in dom.stdout, "the viewer's script did not finish"
    assert f'data-rendered="{record["n_steps"]} steps, {n_killed} killed"' in dom.stdout
    body = re.search(r"<body[^>]*>", dom.stdout).group(0)
    assert "data-pwned" not in body and "<img" not in dom.stdout and "<script" not in dom.stdout.split("<body", 1)[1]\
        .replace("<script>", "", 1), "injected markup became elements"
    assert dom.stdout.count("<details class=\"cands\" open") == record["n_steps"], "#all opened every round"
    logs = done.stderr + dom.stderr
    assert not re.search(r"Uncaught|SyntaxError|ReferenceError|TypeError|Refused to execute|violates the following|CONSOLE.*error",
                         logs, re.I), logs[-2000:]
    assert math.isfinite(record["timings"]["total"])


def test_a_rule_setting_recorded_for_a_rule_that_does_not_use_it_does_not_split_a_configuration():
    """Rows of base-first written while every scored rule recorded judge_max_budget, and rows written since, read
    as one rule and one configuration; where the rule uses the setting (regime), other values are other setups."""
    from kvrescue_local.bench.results_file import upgrade

    def row(choice, **settings):
        recorded = {"helper_margin": 1.0, **settings}
        return upgrade({"config": {"mode": "kvrescue", "n": 1, "choice": choice, **recorded},
                        "setup": {"models": {}, "prompt_sha256": "0", "settings": dict(recorded)}})

    assert setup_label(row("base-first", judge_max_budget=0)) == setup_label(row("base-first"))
    assert setup_label(row("regime", judge_max_budget=0)) != setup_label(row("regime", judge_max_budget=32))
    assert setup_label(row("base-first", helper_margin=0.5)) != setup_label(row("base-first"))
