"""Files known by what they are, not by how they are named: one lock per file (a hard link, a symlink or `./x`
names the same one), taken by merge before it reads; no command writes over a file it reads; report counts a
row read twice once; a row knows the problem it solved, so an edited --data is not taken as done. The toy
preset, one thread."""

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from test_hardening import FAST, PROBLEM, invoke, one_error_line
from test_reliability import held_by_another_process

from kvrescue_local.bench import run as bench_run
from kvrescue_local.bench.report import load_results, render
from kvrescue_local.bench.results_file import read_rows, writing
from kvrescue_local.errors import KVRescueError
from kvrescue_local.paths import SHIPPED_MODELS

def sweep(results, *extra, limit=2):
    return invoke("bench", "run", "--dataset", "toy", "--limit", limit, "--modes", "full", "--ns", 1, *FAST,
                  "--results", results, *extra)


@pytest.fixture(scope="module")
def toy_results(tmp_path_factory):
    """A finished toy sweep of two problems; tests copy it."""
    results = tmp_path_factory.mktemp("toy") / "toy.jsonl"
    done = sweep(results)
    assert done.exit_code == 0, done.output
    return results


def copy_of(source: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copyfile(source, out)
    return out


# --- 1. merge holds the output's lock before it reads ----------------------------------------------

def test_merge_holds_the_outputs_lock_while_it_reads(toy_results, tmp_path, monkeypatch):
    """A writer that comes while merge reads its inputs is refused, so merge never writes over rows it did not
    read (before, the writer's rows were appended and then replaced by the merge)."""
    a = copy_of(toy_results, tmp_path, "a.jsonl")
    b = copy_of(toy_results, tmp_path, "b.jsonl")
    appended = {"refused": None}
    reading = bench_run.read_rows

    def read_while_another_writer_comes(path):
        if appended["refused"] is None:
            try:
                with writing(a):  # as `bench run --resume --results a.jsonl` would
                    row = {**read_rows(a)[0], "id": "appended-meanwhile"}
                    with a.open("a") as out:
                        out.write(json.dumps(row) + "\n")
                    appended["refused"] = False
            except KVRescueError as exc:
                appended["refused"] = str(exc)
        return reading(path)

    monkeypatch.setattr(bench_run, "read_rows", read_while_another_writer_comes)
    merged = invoke("bench", "merge", a, b, "--out", a, "--force")
    assert merged.exit_code == 0, merged.output
    assert appended["refused"] and "being written by another process" in appended["refused"]
    assert [r["id"] for r in read_rows(a)] == [r["id"] for r in read_rows(toy_results)]


def test_merge_is_refused_while_a_run_appends_to_its_output(toy_results, tmp_path):
    a = copy_of(toy_results, tmp_path, "a.jsonl")
    b = copy_of(toy_results, tmp_path, "b.jsonl")
    with held_by_another_process(a) as holder:
        refused = invoke("bench", "merge", a, b, "--out", a, "--force")
        assert f"being written by another process (PID {holder.pid})" in one_error_line(refused)
    assert a.read_bytes() == toy_results.read_bytes()


# --- 3. one lock per file, however it is named --------------------------------------------------

def test_a_hard_link_takes_the_same_lock(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text("")
    other = tmp_path / "other-name.jsonl"
    os.link(one, other)
    with writing(one):
        with pytest.raises(KVRescueError, match=f"PID {os.getpid()}"):
            with writing(other):
                pass
    relative = Path(os.path.relpath(one))
    with writing(Path("./") / relative):
        with pytest.raises(KVRescueError, match="being written by another process"):
            with writing(relative):
                pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.jsonl", "other-name.jsonl"], "nothing left behind"


def test_a_run_through_a_hard_link_is_refused_while_another_process_writes(toy_results, tmp_path):
    results = copy_of(toy_results, tmp_path, "r.jsonl")
    link = tmp_path / "r-link.jsonl"
    os.link(results, link)
    with held_by_another_process(results) as holder:
        refused = sweep(link, "--resume", limit=3)
        assert f"being written by another process (PID {holder.pid})" in one_error_line(refused)
    assert results.read_bytes() == toy_results.read_bytes()


def test_a_lock_on_a_file_not_there_yet_is_taken_by_every_name(tmp_path):
    fresh = tmp_path / "fresh.jsonl"
    link = tmp_path / "link.jsonl"
    link.symlink_to(fresh.name)
    with writing(fresh):
        with pytest.raises(KVRescueError, match="being written by another process"):
            with writing(link):
                pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl"], "no empty results file left behind"


def test_an_empty_file_the_lock_made_that_cannot_be_removed_is_a_warning(tmp_path, monkeypatch, capsys):
    fresh = tmp_path / "fresh.jsonl"

    def read_only_folder(self, missing_ok=False):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    with writing(fresh):
        monkeypatch.setattr(Path, "unlink", read_only_folder)
    assert "could not remove the empty" in capsys.readouterr().err and fresh.read_bytes() == b""


# --- 13. a folder made read-only while a sweep runs ------------------------------------------------

def test_a_folder_made_read_only_mid_run_keeps_rc_0(tmp_path, monkeypatch):
    """The rows are written (a file's own permissions allow appending); nothing the run then fails to remove
    in its folder turns a finished sweep into a failure."""
    folder = tmp_path / "sweep"
    folder.mkdir()
    results = folder / "r.jsonl"
    read_only = {"now": False}
    unlink, remove = Path.unlink, os.unlink

    def refused_in_folder(path) -> bool:
        return read_only["now"] and Path(os.path.abspath(path)).parent == folder

    def path_unlink(self, missing_ok=False):
        if refused_in_folder(self):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return unlink(self, missing_ok=missing_ok)

    def os_unlink(path, *args, **kwargs):
        if refused_in_folder(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", path_unlink)
    monkeypatch.setattr(os, "unlink", os_unlink)
    monkeypatch.setattr(os, "remove", os_unlink)
    line = bench_run.result_line

    def first_row_then_read_only(*args, **kwargs):
        read_only["now"] = True
        if os.geteuid() != 0:
            folder.chmod(0o555)
        return line(*args, **kwargs)

    monkeypatch.setattr(bench_run, "result_line", first_row_then_read_only)
    try:
        done = sweep(results)
    finally:
        folder.chmod(0o755)
    assert done.exit_code == 0, done.output
    assert "2 new results" in done.output and len(read_rows(results)) == 2


# --- 2. no command writes over a file it reads ---------------------------------------------------

@pytest.fixture(scope="module")
def trajectory(tmp_path_factory):
    path = tmp_path_factory.mktemp("trajectory") / "t.json"
    done = invoke("solve", *FAST, "--json", path, PROBLEM)
    assert done.exit_code == 0, done.output
    return path


def test_report_never_writes_its_page_over_what_it_reads(toy_results, trajectory, tmp_path):
    t = copy_of(trajectory, tmp_path, "t.json")
    r = copy_of(toy_results, tmp_path, "r.jsonl")
    os.link(r, tmp_path / "r-link.jsonl")
    (tmp_path / "t-link.json").symlink_to(t.name)
    for args, says in ((["--html", t, "--out", t], "--out"),
                       (["--html", t, "--out", tmp_path / "t-link.json"], "--out"),
                       ([r, "--html", t, "--out", tmp_path / "r-link.jsonl"], "--out"),
                       ([t.with_suffix(".html"), "--html", t], "--html")):
        if not Path(args[0]).exists():
            shutil.copyfile(r, args[0])
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        message = one_error_line(invoke("report", *args))
        assert says in message and "read" in message, message
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_report_never_writes_a_figure_over_a_results_file_it_reads(toy_results, tmp_path):
    named_as_a_figure = copy_of(toy_results, tmp_path, "pass1_vs_budget.png")
    message = one_error_line(invoke("report", named_as_a_figure, "--plots", tmp_path))
    assert "--plots" in message and "is the file read as RESULTS" in message
    assert named_as_a_figure.read_bytes() == toy_results.read_bytes()


def test_solve_never_writes_its_record_over_its_problem_file(tmp_path):
    problem = tmp_path / "problem.txt"
    problem.write_text(PROBLEM)
    message = one_error_line(invoke("solve", *FAST, "--file", problem, "--json", problem))
    assert "--json" in message and "--file" in message
    assert problem.read_text() == PROBLEM


def test_bench_run_never_appends_to_its_data_or_a_model(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "1", "problem": PROBLEM, "answer": "19"}) + "\n")
    os.link(data, tmp_path / "d-link.jsonl")
    before = data.read_bytes()
    message = one_error_line(invoke("bench", "run", "--data", data, "--modes", "full", "--ns", 1, *FAST,
                                    "--results", tmp_path / "d-link.jsonl"))
    assert "--results" in message and "--data" in message
    model = copy_of(SHIPPED_MODELS / "toy" / "base.gguf", tmp_path, "base.gguf")
    weights = model.read_bytes()
    message = one_error_line(invoke("bench", "run", "--data", data, "--modes", "full", "--ns", 1, *FAST,
                                    "--base", model, "--results", model))
    assert "--results" in message and "--base" in message
    assert data.read_bytes() == before and model.read_bytes() == weights


def test_quantize_never_writes_over_its_source(tmp_path):
    source = copy_of(SHIPPED_MODELS / "toy" / "base.gguf", tmp_path, "base.gguf")
    os.link(source, tmp_path / "again.gguf")
    weights = source.read_bytes()
    message = one_error_line(invoke("models", "quantize", source, "--type", "Q8_0", "--out", tmp_path / "again.gguf"))
    assert "--out" in message and "SRC" in message
    assert source.read_bytes() == weights


def test_convert_prm_never_writes_over_its_checkpoint(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    config = checkpoint / "config.json"
    config.write_text("{}")
    message = one_error_line(invoke("models", "convert-prm", checkpoint, checkpoint / "config.json"))
    assert "OUT" in message and "is the file read as SRC" in message
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(b"weights")
    os.link(weights, checkpoint / "model.head.npz")
    message = one_error_line(invoke("models", "convert-prm", checkpoint, checkpoint / "model.gguf"))
    assert "OUT's reward head" in message and "is the file read as SRC" in message
    assert config.read_text() == "{}" and weights.read_bytes() == b"weights"


# --- 4. report counts a row once -------------------------------------------------------------------

def test_report_counts_a_file_given_twice_once_and_says_so(toy_results):
    once = invoke("report", toy_results)
    twice = invoke("report", toy_results, toy_results)
    assert once.exit_code == 0 and twice.exit_code == 0, twice.output
    assert "2 duplicate rows left out" in twice.output
    assert twice.output.replace(next(line + "\n" for line in twice.output.splitlines() if "duplicate" in line),
                                "") == once.output


# --- 5. a row knows the problem it solved ----------------------------------------------------------

def data_file(path: Path, problems: dict[str, tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "problem": p, "answer": a}) + "\n" for i, (p, a) in problems.items()))
    return path


def test_resume_runs_again_a_problem_whose_text_changed(tmp_path):
    problems = {"1": ("a=8 b=6 c=5", "19"), "2": ("a=3 b=1", "4")}
    data = data_file(tmp_path / "mine.jsonl", problems)
    results = tmp_path / "r.jsonl"
    first = invoke("bench", "run", "--data", data, "--modes", "full", "--ns", 1, *FAST, "--results", results)
    assert first.exit_code == 0, first.output
    rows = read_rows(results)
    assert all(len(r["problem_sha256"]) == 16 for r in rows)
    data_file(data, {**problems, "2": ("a=5 b=1", "6")})
    again = invoke("bench", "run", "--data", data, "--modes", "full", "--ns", 1, *FAST, "--results", results,
                   "--resume")
    assert again.exit_code == 0, again.output
    assert "1 new results" in again.output and "1 problem run again" in again.output
    rows = read_rows(results)
    assert [r["id"] for r in rows] == ["1", "2", "2"] and rows[1]["problem_sha256"] != rows[2]["problem_sha256"]
    same = invoke("bench", "run", "--data", data, "--modes", "full", "--ns", 1, *FAST, "--results", results, "--resume")
    assert "0 new results" in same.output and "run again" not in same.output, same.output


def test_rows_without_a_fingerprint_still_resume_and_report(toy_results, tmp_path):
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "problem_sha256"}) + "\n"
                           for r in read_rows(toy_results)))
    resumed = sweep(old, "--resume")
    assert resumed.exit_code == 0 and "0 new results" in resumed.output, resumed.output
    assert invoke("report", old).output == invoke("report", toy_results).output


def test_report_pairs_rows_of_one_id_only_when_their_problems_match(toy_results, tmp_path):
    """A configuration's row of problem `1` solved from other text is not paired with the first setup's `1`."""
    rows = read_rows(toy_results)
    other = [{**r, "setup": {**r["setup"], "settings": {**r["setup"]["settings"], "temperature": 1.5}}} for r in rows]
    compared = render(load_results(write(tmp_path / "a.jsonl", rows + other)))
    assert "on the 2 problems both ran" in compared
    other[0]["problem_sha256"] = "0" * 16
    compared = render(load_results(write(tmp_path / "b.jsonl", rows + other)))
    assert "on the 1 problems both ran" in compared


def test_a_row_from_before_fingerprints_pairs_by_id_with_a_fingerprinted_one(toy_results, tmp_path):
    """Rows of a sweep that began before fingerprints were recorded compare with the rows a resumed or newer run
    writes, as they did before: by id, where the newer rows of that id hold one fingerprint."""
    rows = read_rows(toy_results)
    other = [{**r, "setup": {**r["setup"], "settings": {**r["setup"]["settings"], "temperature": 1.5}}} for r in rows]
    old = [{k: v for k, v in r.items() if k != "problem_sha256"} for r in rows]
    compared = render(load_results(write(tmp_path / "a.jsonl", old + other)))
    assert "on the 2 problems both ran" in compared


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
