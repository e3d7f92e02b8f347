"""The batched engine: K problems at once on the toy and tiny models through llama.cpp."""

import json
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from kvrescue_local.bench.results_file import read_rows
from kvrescue_local.cli import main
from kvrescue_local.compose import preset_config
from kvrescue_local.rescue.config import cache_fields
from kvrescue_local.errors import KVRescueError
from kvrescue_local.presets import load_preset
from kvrescue_local.prm import PRM, PRMParams
from kvrescue_local.rescue import MODES, Rescue, longest_prompt
from kvrescue_local.runtime import Model
from kvrescue_local.toy.task import held_out
from test_bench import bench_args


@pytest.fixture(scope="module")
def toy():
    preset = load_preset("toy")
    return preset, Model(preset.base), Model(preset.helper)


def solve_all(toy, config, problems, concurrency, per_context=None):
    preset, base, helper = toy
    prm = PRM(preset.prm, PRMParams(n_ctx=config.prm_context(400), max_candidates=config.candidates_per_round,
                                    kv_type=config.cache_type_k)) if config.candidates_per_round > 1 else None
    engine = Rescue(config, base, helper, prm, prompt_tokens_max=longest_prompt(config, [base, helper], problems),
                    concurrency=concurrency, per_context=per_context)
    finished = [(problem, trajectory) for problem, trajectory, error in engine.run(problems) if not error]
    return dict(finished), [problem for problem, _ in finished]


def outcome(trajectory):
    """What a trajectory is, scores aside (a PRM score moves by ~1e-4 between batch shapes)."""
    steps = [(s.text, s.source, s.finished, [(c.side, c.text, c.finished) for c in s.candidates]) for s in trajectory.steps]
    return steps, trajectory.answer, trajectory.stop, trajectory.evictions, trajectory.base_cells, trajectory.tokens


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_context", [8, 3])
def test_a_problems_trajectory_does_not_depend_on_what_shares_its_batch(toy, mode, per_context):
    """F32 KV and greedy sampling: K = 1 and K = 8 (10 problems, so finished slots take new ones) give the
    same trajectories, evictions included, the 8 in one context per model or in lanes of 3, 3 and 2."""
    config = preset_config(toy[0], mode=mode, n=2, kv={"budget": 48}, **cache_fields("f32", "f32"),
                           temperature=0.0)
    problems = [p.text for p in held_out(10)]
    alone, order_alone = solve_all(toy, config, problems, 1)
    together, order_together = solve_all(toy, config, problems, 8, per_context)
    assert order_alone == problems and sorted(order_together) == sorted(problems)
    assert order_together != problems, "problems finish in their own time, not in queue order"
    for problem in problems:
        assert outcome(together[problem]) == outcome(alone[problem])
        for a, b in zip(alone[problem].steps, together[problem].steps):
            assert (a.score, b.score) == (None, None) or b.score == pytest.approx(a.score, abs=1e-3), (a.score, b.score)
    if mode in ("bon", "kvrescue"):
        assert all(t.evictions["evictions"] > 0 and t.evictions["fallback_evictions"] == 0 for t in alone.values())


def test_on_a_cpu_with_flash_attention_off_each_problem_runs_in_contexts_of_its_own(toy):
    """Every query attends over every cell of its context: with the plain softmax a problem beside others costs
    more than alone, so K problems run in K lanes; a context shared by all of them when asked for."""
    preset, base, helper = toy
    config = preset_config(preset, mode="kvrescue", n=2)
    prm = PRM(preset.prm, PRMParams(n_ctx=config.prm_context(400), max_candidates=4))
    lanes = Rescue(config, base, helper, prm, concurrency=4).lanes
    assert [lane.concurrency for lane in lanes] == [1, 1, 1, 1]
    assert len({id(lane.prm.ctx) for lane in lanes}) == 4 and all(lane.prm.model is prm.model for lane in lanes)
    assert Rescue(config, base, helper, prm, concurrency=4, per_context=4).lanes == []


def test_sampled_trajectories_come_from_the_problem_not_the_batch(toy):
    """Seeds are derived from the problem's text: sampling at temperature 1, a problem solved alone with `solve`
    and inside a batch of 4 ends the same, and a different seed changes it."""
    # the shared set leaves the toy base unsure enough for the seed to show (per head it solves this one alike)
    config = preset_config(toy[0], mode="kvrescue", n=2, kv={"budget": 48, "policy": "rkv:heads=shared"},
                           **cache_fields("f32", "f32"))
    problems = [p.text for p in held_out(5)]
    batched, _ = solve_all(toy, config, problems, 4)
    preset, base, helper = toy
    prm = PRM(preset.prm, PRMParams(n_ctx=config.prm_context(400), max_candidates=4, kv_type="f32"))
    engine = Rescue(config, base, helper, prm, prompt_tokens_max=longest_prompt(config, [base, helper], problems))
    alone = engine.solve(problems[3])
    assert outcome(alone) == outcome(batched[problems[3]])
    other = Rescue(config.with_overrides({"seed": 9}), base, helper, prm,
                   prompt_tokens_max=longest_prompt(config, [base, helper], problems)).solve(problems[3])
    assert other.text != alone.text


def test_concurrency_beyond_sequences_or_memory_is_refused_naming_the_largest(base_path, helper_path, tiny_prm_path,
                                                                              tmp_path):
    from kvrescue_local.rescue import RescueConfig

    with pytest.raises(KVRescueError, match="concurrency 29 does not fit.*use --concurrency 1 to 28"):
        RescueConfig(n=8, mode="bon").check_concurrency(29)
    args = ["bench", "run", "--dataset", "gsm8k", "--limit", "2", "--modes", "kvrescue", "--ns", "2", "--budgets", "32",
            "--buffer", "16", "--max-tokens", "40", "--base", str(base_path), "--helper", str(helper_path),
            "--prm", str(tmp_path / "x.gguf"), "--results", str(tmp_path / "r.jsonl")]
    args[args.index("--prm") + 1] = str(tiny_prm_path)
    small = CliRunner().invoke(main, args + ["--memory", "3M", "--concurrency", "8"])
    assert small.exit_code != 0
    assert small.output.startswith("Error: --concurrency 8 does not fit: its KV caches take")
    largest = int(small.output.rsplit("the largest concurrency that fits is ", 1)[1].split()[0])
    assert 1 <= largest < 8
    fits = CliRunner().invoke(main, args + ["--memory", "3M", "--concurrency", str(largest)])
    assert fits.exit_code == 0, fits.output
    assert f"concurrency {largest} (at most {largest} fit" in fits.output
    none = CliRunner().invoke(main, args + ["--memory", "100K"])
    assert none.exit_code != 0 and "the KV caches of one problem take" in none.output  # before any model loads
    assert "of the memory allowed (--memory 100K)" in none.output and "raise the memory" in none.output


def start_and_stop(args, results, rows, how):
    proc = subprocess.Popen([sys.executable, "-m", "kvrescue_local", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and (not results.exists() or len(results.read_text().splitlines()) < rows):
        time.sleep(0.05)
    proc.send_signal(how)
    _, err = proc.communicate()
    return proc.returncode, err.decode()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_a_stopped_concurrent_sweep_resumes_without_losing_or_duplicating_a_row(base_path, helper_path, tiny_prm_path,
                                                                                  tmp_path, how):
    results = tmp_path / "results.jsonl"
    args = bench_args(base_path, helper_path, tiny_prm_path, results, "--concurrency", "8")
    code, err = start_and_stop(args, results, 5, how)
    kept = read_rows(results)
    assert 5 <= len(kept) < 40
    if how == signal.SIGINT:  # Ctrl-C: every finished problem is in the file, and it says so
        assert code == 130 and f"interrupted: {len(kept)} results kept" in err
    resumed = CliRunner().invoke(main, args + ["--resume"])
    assert resumed.exit_code == 0, resumed.output
    rows = read_rows(results)
    keys = [(r["dataset"], r["id"], r["config_key"]) for r in rows]
    assert len(keys) == len(set(keys)) == 40 and rows[:len(kept)] == kept
    assert {r["engine"]["concurrency"] for r in rows} == {8} and len({r["engine"]["run"] for r in rows}) == 2
    # the concurrency is no setting: a resume at another K continues the same file
    other = CliRunner().invoke(main, args[:-2] + ["--concurrency", "2", "--resume"])
    assert other.exit_code == 0 and "0 new results" in other.output


def test_table3_reports_problems_per_minute_and_kv_bytes_per_concurrency(base_path, helper_path, tiny_prm_path,
                                                                          tmp_path):
    files = []
    for k, flash_attn in ((1, None), (3, None), (3, "on")):
        results = tmp_path / f"k{k}-{flash_attn}.jsonl"
        args = bench_args(base_path, helper_path, tiny_prm_path, results, "--concurrency", str(k))
        args[args.index("--limit") + 1] = "6"
        args[args.index("--modes") + 1] = "full,bon,kvrescue"
        run = CliRunner().invoke(main, args + (["--flash-attn", flash_attn] if flash_attn else []))
        assert run.exit_code == 0, run.output
        # several problems at once on a CPU: the faster kernel is named, never switched on behind the user's back
        assert ("--flash-attn on lets a model whose weights outweigh" in run.output) == (k > 1 and not flash_attn)
        assert {json.loads(line)["engine"]["flash_attn"] for line in open(results)} == {flash_attn or "off"}
        files.append(str(results))
    rows = [json.loads(line) for f in files for line in open(f)]
    assert all(sum(r["engine"]["kv_peak_bytes"].values()) > 0 for r in rows)
    report = CliRunner().invoke(main, ["report", *files])
    assert report.exit_code == 0, report.output
    assert "Table 3" in report.output and "memory-capped" in report.output
    table2 = report.output.split("Table 1")[0]
    assert " 6 " in table2 and " 12 " not in table2, "Table 2 counts each problem once, whatever K ran it"
    table3 = report.output.split("Table 3")[1]
    for mode in ("full", "bon", "kvrescue"):
        runs = [line.split()[3:5] for line in table3.splitlines() if line.split()[:1] == [mode]]
        assert runs == [["1", "off"], ["3", "off"], ["3", "on"]], f"{mode}: K = 1, and K = 3 with each kernel apart"


def test_base_first_is_evicted_best_of_n_until_a_kill_or_the_margin(toy):
    """One base candidate a round, sampled at the toy's temperature 1: base-first with the margin never exceeded
    (1) commits every surviving base step, so until the first round whose base candidate is killed each problem's
    trajectory is the one evicted best-of-N writes with the same seed, evictions included, and a problem without a
    kill is that trajectory whole; a lower margin lets the judge commit helper steps."""
    problems = [p.text for p in held_out(8)]
    common = dict(n=1, kv={"budget": 96}, **cache_fields("f32", "f32"))
    bon, _ = solve_all(toy, preset_config(toy[0], mode="bon", **common), problems, 4)
    first, _ = solve_all(toy, preset_config(toy[0], mode="kvrescue", rule="lead:base", **common),
                         problems, 4)
    compared = 0
    for problem in problems:
        ours, theirs = first[problem], bon[problem]
        kill = next((s.round for s in ours.steps if s.killed), None)
        same = len(ours.steps) if kill is None else kill
        assert [s.text for s in ours.steps[:same]] == [s.text for s in theirs.steps[:same]]
        assert ours.base_cells[:same] == theirs.base_cells[:same]
        assert {s.source for s in ours.steps[:same]} <= {"base"}
        compared += same
        if kill is None:
            assert (ours.answer, ours.stop, ours.evictions, ours.tokens["base"], len(ours.steps)) == (
                theirs.answer, theirs.stop, theirs.evictions, theirs.tokens["base"], len(theirs.steps))
        else:  # the round whose base candidate died commits the helper's step
            assert ours.steps[kill].source == "helper"
    assert compared >= 2 * len(problems), "enough rounds before a kill for the comparison to say something"
    assert any(t.killed == 0 for t in first.values()), "a problem without a kill, compared whole"
    eager, _ = solve_all(toy, preset_config(toy[0], mode="kvrescue", rule="lead:base,margin=0", **common),
                         problems, 4)
    assert any(s.source == "helper" and not s.killed for t in eager.values() for s in t.steps)
