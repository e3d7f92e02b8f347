"""`report` prints, byte for byte, what it printed for every committed results file when the golden files
were written (tests/golden/report/<results file name>.txt): rows written by any earlier version keep reporting
the same tables. A change that means to move a table rewrites its golden file in the same commit, saying why."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvrescue_local.cli import main

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden" / "report"
RESULTS = sorted(ROOT / "results" / path.name.removesuffix(".txt") for path in GOLDEN.glob("*.txt"))


def test_every_committed_results_file_has_a_golden_report():
    results_files = {p.name for p in (ROOT / "results").iterdir() if p.name.endswith((".jsonl", ".jsonl.zst"))}
    calibration_rows = {"coder-math500-collect.jsonl"}  # perf/calibrate_real.py's rows, not `bench run`'s
    assert {p.name for p in RESULTS} == results_files - calibration_rows


@pytest.mark.parametrize("results", RESULTS, ids=lambda p: p.name)
def test_report_is_unchanged(results, monkeypatch):
    monkeypatch.chdir(ROOT)  # the tables name files as given, relative to the checkout
    outcome = CliRunner().invoke(main, ["report", str(results.relative_to(ROOT))])
    assert outcome.exit_code == 0, outcome.output
    assert outcome.stdout == (GOLDEN / f"{results.name}.txt").read_text()
