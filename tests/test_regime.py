"""The regime map: KV-Rescue with helpers of graded strength (bench/regime.py, perf/regime_map.py, the toy
trainer's helper knobs)."""

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvrescue_local.bench.regime import regime_map
from kvrescue_local.cli import main
from kvrescue_local.toy.task import N_VOCAB, Knobs
from kvrescue_local.toy.train import step_counts, value_set

ROOT = Path(__file__).resolve().parents[1]


def row(mode: str, problem: int, correct: bool, helper: str | None = None, budget: int | None = None,
        steps_from: dict | None = None) -> dict:
    models = {"base": {"file": "base.gguf", "size": 1, "sha256": "b"}}
    if helper:
        models["helper"] = {"file": helper, "size": 1, "sha256": helper}
    return {"dataset": "toy", "id": str(problem), "correct": correct, "n_steps": 1, "tokens": {}, "timings": {"total": 1},
            "config": {"mode": mode, "n": 1, "budget": budget or 0, "policy": "rkv" if budget else "none"},
            "setup": {"models": models, "settings": {}}, "steps_from": steps_from or {}}


def sweep(helpers: dict[str, tuple[int, int]]) -> list[dict]:
    """Ten problems: full KV solves all, best-of-N at 48 the first, each helper alone its first `alone` and
    KV-Rescue with it the first `rescued` (one base and one helper step each)."""
    rows = [row("full", i, True) for i in range(10)] + [row("bon", i, i == 0, budget=48) for i in range(10)]
    for name, (alone, rescued) in helpers.items():
        rows += [row("helper", i, i < alone, name) for i in range(10)]
        rows += [row("kvrescue", i, i < rescued, name, 48, {"base": 1, "helper": 1}) for i in range(10)]
    return rows


def test_the_map_puts_each_helper_by_its_strength_beside_its_recovery():
    points = regime_map(sweep({"strong.gguf": (9, 9), "weak.gguf": (5, 7)}))
    assert [(p.helper, p.ratio, p.key.budget, p.problems) for p in points] == [
        ("weak.gguf", 0.5, 48, 10), ("strong.gguf", 0.9, 48, 10)]
    weak = points[0]
    assert (weak.full_pass1, weak.bon_pass1, weak.kvrescue_pass1) == (100.0, 10.0, 70.0)
    assert weak.recovered == pytest.approx(100 * 60 / 90)
    assert weak.low < weak.recovered < weak.high
    # best-of-N solves problem 0, which the weak helper also solves: the oracle is the helper's 50%
    assert weak.oracle_pass1 == 50.0 and weak.oracle_recovered == pytest.approx(100 * 40 / 90)
    assert weak.helper_steps == 50.0


def test_one_helper_makes_no_map():
    assert regime_map(sweep({"weak.gguf": (5, 7)})) == []
    # the strong helper alone but not in KV-Rescue: still one helper to map
    assert regime_map(sweep({"weak.gguf": (5, 7), "strong.gguf": (9, 9)})[:-10]) == []


def test_the_helper_knobs_of_the_toy_trainer():
    assert value_set("8,9") == {8, 9} and value_set("none") == frozenset() and value_set("") == frozenset()
    assert step_counts("1500,3000") == {1500, 3000}
    for bad in ("8,x", "10"):
        with pytest.raises(argparse.ArgumentTypeError, match="digits"):
            value_set(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="step counts"):
        step_counts("0")


def test_training_snapshots_come_at_the_steps_asked():
    torch = pytest.importorskip("torch")
    from kvrescue_local.toy.model import Qwen2
    from kvrescue_local.toy.train import HELPER, fit, lm_batch, lm_loss

    torch.manual_seed(0)
    model = Qwen2(replace(HELPER, n_embd=16, n_layer=1, n_ff=32), N_VOCAB)
    rng = np.random.default_rng(0)
    taken = []
    fit(model, lambda: lm_batch(rng, 2, Knobs(n_vars=3, min_terms=2, max_terms=3)), 4, 1e-3, lm_loss, "tiny",
        snapshot=lambda m, steps, seconds: taken.append((m is model, steps, seconds > 0)), snapshot_at=frozenset({1, 3}))
    assert taken == [(True, 1, True), (True, 3, True)]


def test_the_map_command_through_llama_cpp_and_its_report(tmp_path):
    """Two helpers (the shipped one under two names), two problems, one budget: the map's rows, its table in
    `report` and its figure."""
    helpers = [tmp_path / "weak.gguf", tmp_path / "strong.gguf"]
    for helper in helpers:
        shutil.copy(ROOT / "models/toy/helper.gguf", helper)
    out = tmp_path / "map.jsonl.zst"
    command = [sys.executable, str(ROOT / "perf/regime_map.py"), "run", "--helpers", *map(str, helpers), "--limit", "2",
               "--budgets", "48", "--jobs", "1", "--parts", str(tmp_path / "parts"), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    made = subprocess.run(command, env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "12 rows" in made.stdout  # full, bon; then per helper: the helper alone and KV-Rescue; 2 problems each
    report = CliRunner().invoke(main, ["report", str(out)])
    assert report.exit_code == 0, report.output
    table = report.output.split("Regime map: KV-Rescue by the helper's strength\n")[1].split("\n\n")[0].splitlines()
    assert [line.split()[:3] for line in table[2:4]] == [["strong.gguf", "1.00", "48"], ["weak.gguf", "1.00", "48"]]
    again = subprocess.run(command, env=env, capture_output=True, text=True)  # resumable: nothing runs twice
    assert again.returncode == 0 and "12 rows" in again.stdout
    assert "nothing new to run" in (tmp_path / "parts" / "weak.log").read_text()
    pytest.importorskip("matplotlib")
    plots = CliRunner().invoke(main, ["report", str(out), "--plots", str(tmp_path / "plots")])
    assert plots.exit_code == 0 and (tmp_path / "plots" / "regime_map.png").is_file(), plots.output
    drawn = subprocess.run([sys.executable, str(ROOT / "perf/regime_map.py"), "figure", str(out), "--out",
                            str(tmp_path / "map.png")], env=env, capture_output=True, text=True)
    assert drawn.returncode == 0 and (tmp_path / "map.png").stat().st_size > 10_000, drawn.stderr
