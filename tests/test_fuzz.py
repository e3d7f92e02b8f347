"""Option sets drawn by hypothesis for `solve`, `bench run`, `bench merge` and `report` on the toy preset (one
thread): every run ends with rc 0, or with rc != 0 and one `Error:` line; no traceback, no abort, no hang; and
no file is created or changed but the outputs the command names.

Each command runs in a child forked from one server process that imported the command line once (this file
run as a script): a child that aborts in llama.cpp is an exit status to report, not the end of the test run,
and no child pays for Python's start-up. Bounded (75 drawn examples, and each class of bad value once) so that
CI runs it, and derandomized (the examples follow from the test's source) so that a failure in CI reproduces."""

import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CHILD_TIMEOUT = 20  # seconds; a toy run takes about one: longer is a hang
EXAMPLES = 15  # per command: 75 in all
# null, NaN and infinity, huge sizes, surrogates: each refused where it enters
SURROGATE = "a=1 \udc80"  # what a non-UTF-8 byte of an argument becomes (surrogateescape)
HUGE = ["100000000", "2147483648", "99999999999999999999"]
HUGE_SIZES = ["infG", "1e400k", "nan", "1e30G", "-inf"]
NULL_DATA = {"null.jsonl": '{"id": 1, "problem": null, "answer": "1"}', "nullanswer.jsonl": '{"problem": "a=1", "answer": null}',
             "emptyanswer.jsonl": '{"problem": "a=1", "answer": []}', "nananswer.jsonl": '{"problem": "a=1", "answer": NaN}',
             "surrogate.jsonl": '{"id": "\\udc80", "problem": "a=1", "answer": "1"}'}
REFUSED = {SURROGATE, *HUGE_SIZES, *NULL_DATA}  # a run given one of these ends in its Error: line
PROBLEMS = ["a=8 b=6 c=5", "a=3 b=1", "", "  \n", "ü ∑ 😀 {problem} {", "x" * 3000, SURROGATE, "a=1 " * 100_000]
TEMPLATES = ["<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n", "{problem}", "x {problem} {foo}",
             "{problem} {", "no field", "{{literal}} {problem}", "{problem!r}", "{0}"]
POLICIES = ["rkv", "snapkv", "h2o", "streaming", "rkv:lam=0.1,lam=0.2", "rkv:kernel=0", "rkv:lam=nan", "bogus", "",
            "rkv:lam=0.1,kernel=5,h2o", "rkv,rkv", "snapkv:kernel=-3"]
NUMBERS = ["nan", "inf", "-inf", "-1", "0", "0.5", "1", "1e9", "x", ""]
SIZES = ["-1", "0", "1", "2", "8", "16", "24", "600", "x", *HUGE]


# --- the server: fork per command, report the exit status and output --------------------------------

def serve() -> None:
    """Read one JSON request per line ({"args", "cwd"}), run each in a forked child, answer {"status", "output"}."""
    from kvrescue_local.cli import main  # noqa: F401  (imported once, before any fork)

    for line in sys.stdin:
        request = json.loads(line)
        log = Path(request["cwd"]) / ".fuzz-output"
        pid = os.fork()
        if pid == 0:
            run_child(request["args"], request["cwd"], log)
        status = wait_for(pid)
        output = log.read_text(errors="replace")
        log.unlink()
        print(json.dumps({"status": status, "output": output}), flush=True)


def run_child(args: list[str], cwd: str, log: Path) -> None:
    code = 1
    try:
        os.chdir(cwd)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)  # llama.cpp's own messages (an assertion) land here too
        from kvrescue_local.cli import main

        main(args=args, prog_name="kvrescue-local")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait_for(pid: int) -> str:
    """"rc N", "signal N" or "timeout" (the child killed)."""
    deadline = CHILD_TIMEOUT * 10
    for _ in range(deadline):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return f"rc {os.waitstatus_to_exitcode(status)}" if os.WIFEXITED(status) else \
                f"signal {os.WTERMSIG(status)}"
        select.select([], [], [], 0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "timeout"


class Server:
    def __init__(self) -> None:
        import kvrescue_local  # the server runs the code under test, wherever it was imported from

        env = {**os.environ, "KVRESCUE_THREADS": "1", "PYTHONPATH": str(Path(kvrescue_local.__file__).parent.parent)}
        self.process = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)

    def run(self, args: list[str], cwd: Path) -> dict:
        self.process.stdin.write(json.dumps({"args": args, "cwd": str(cwd)}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


@pytest.fixture(scope="module")
def server():
    running = Server()
    yield running
    running.close()


# --- files the commands read, made once ------------------------------------------------------------

@pytest.fixture(scope="module")
def inputs(server, tmp_path_factory):
    """A folder of inputs: two toy results files (one per shard), a trajectory, and junk of every kind (each run's
    copy gets a FIFO too)."""
    folder = tmp_path_factory.mktemp("fuzz-inputs")
    fast = ["--preset", "toy", "-t", "1", "--max-tokens", "24", "--max-step-tokens", "12"]
    for shard in ("0/2", "1/2"):
        done = server.run(["bench", "run", "--dataset", "toy", "--limit", "2", "--modes", "full,bon", "--ns", "1,2",
                           *fast, "--shard", shard, "--results", f"shard{shard[0]}.jsonl"], folder)
        assert done["status"] == "rc 0", done["output"]
    done = server.run(["solve", *fast, "--json", "trajectory.json", PROBLEMS[0]], folder)
    assert done["status"] == "rc 0", done["output"]
    (folder / "binary.jsonl").write_bytes(b"\x00\xff\xfe\x80" * 64)
    (folder / "blank.jsonl").write_text("\n\n   \n")
    (folder / "empty.jsonl").write_bytes(b"")
    (folder / "cut.jsonl").write_text((folder / "shard0.jsonl").read_text()[:300])
    (folder / "notjson.jsonl").write_text("{not json\n")
    (folder / "foreign.jsonl").write_text('{"foo": 1}\n')
    (folder / "other.txt").write_text("someone's notes\n")
    lines = [{"id": "1", "problem": "a=8 b=6", "answer": "14"}, {"id": 1, "problem": "a=3", "answer": "3"}]
    (folder / "dup.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (folder / "good.jsonl").write_text(json.dumps(lines[0]) + "\n")
    (folder / "latin1.jsonl").write_bytes(b'{"id": 1, "problem": "caf\xe9", "answer": "1"}\n')
    (folder / "adir").mkdir()
    (folder / "link.json").symlink_to("other.txt")
    for name, line in NULL_DATA.items():
        (folder / name).write_text(line + "\n")
    from kvrescue_local.prm.head import RewardHead

    toy = Path(__file__).resolve().parent.parent / "models" / "toy"
    for name, bad in (("nanhead", float("nan")), ("infhead", float("inf"))):  # a PRM whose head is not finite
        head = RewardHead.load(toy / "prm.head.npz")
        head.weights[0][0, 0] = bad
        (folder / name).mkdir()
        (folder / name / "prm.gguf").symlink_to(toy / "prm.gguf")
        head.save(folder / name / "prm.head.npz")
    return folder


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under folder with what it is: a symlink's target, a file's hash, a special file's kind."""
    out = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            out[name] = "link " + os.readlink(path)
        elif path.is_fifo():
            out[name] = "fifo"
        elif path.is_dir():
            out[name] = "dir"
        else:
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def check(server, inputs: Path, tmp_path_factory, args: list[str], outputs: list[str]) -> str:
    """Run args in a fresh copy of the inputs; the checks of the module's docstring. The exit status."""
    work = tmp_path_factory.mktemp("fuzz")
    shutil.rmtree(work)
    shutil.copytree(inputs, work, symlinks=True)
    os.mkfifo(work / "fifo")  # a FIFO nobody reads or writes: it must be refused, never waited on or replaced
    models = snapshot(Path(__file__).resolve().parent.parent / "models" / "toy")
    before = snapshot(work)
    done = server.run(args, work)
    output, status = done["output"], done["status"]
    shown = f"kvrescue-local {' '.join(map(repr, args))}\n{status}\n{output[-3000:]}"
    assert not status.startswith(("signal", "timeout")), shown
    assert "Traceback" not in output and "GGML_ASSERT" not in output, shown
    if status != "rc 0":
        assert len([line for line in output.splitlines() if line.startswith("Error:")]) == 1, shown
    if REFUSED.intersection(args):  # never solved or read as something it is not ("None", NaN)
        assert status != "rc 0", shown
    after = snapshot(work)
    named = set()
    for name in outputs:
        named.add(name)
        if (work / name).is_symlink():
            named.add(os.readlink(work / name))
    changed = {name for name in set(before) | set(after) if before.get(name) != after.get(name)} - named
    assert not changed, f"{shown}\nchanged outside the named outputs: {sorted(changed)}"
    for name in named & set(before):
        if before[name] in ("fifo", "dir") or before[name].startswith("link"):
            assert after.get(name) == before[name], f"{shown}\n{name} was {before[name]}, is now {after.get(name)}"
    assert snapshot(Path(__file__).resolve().parent.parent / "models" / "toy") == models, shown
    return status


def options(draw, table: dict) -> list[str]:
    """Some of the options in table (name -> strategy of its value; None: a flag), in drawn order."""
    names = draw(st.lists(st.sampled_from(sorted(table)), max_size=5, unique=True))
    out = []
    for name in names:
        out += [name] if table[name] is None else [name, draw(table[name])]
    return out


SEARCH = {"--buffer": st.sampled_from(SIZES), "--n-sink": st.sampled_from(SIZES), "--window": st.sampled_from(SIZES),
          "--temp": st.sampled_from(NUMBERS), "--top-p": st.sampled_from(NUMBERS), "--seed": st.sampled_from(SIZES),
          "--max-tokens": st.sampled_from(["-1", "0", "1", "8", "32", *HUGE]),
          "--max-steps": st.sampled_from(["-1", "0", "1", "3"]), "--max-step-tokens": st.sampled_from(SIZES[:7]),
          "--tau-entropy": st.sampled_from(NUMBERS), "--tau-compression": st.sampled_from(NUMBERS),
          "--prm-ctx": st.sampled_from(["-1", "0", "1", "64", "511", "512", "700", *HUGE]),
          "--prompt-template": st.sampled_from(TEMPLATES), "-ngl": st.sampled_from(["-2", "-1", "0"]),
          "-fa": st.sampled_from(["on", "off", "auto", "x"]), "--protect-prompt": None, "--evict-prompt": None,
          "--threads": st.sampled_from(["-1", "0", "1", "999"])}
FAST = ["--preset", "toy", "-t", "1", "--max-tokens", "24", "--max-step-tokens", "12"]
RUN = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
               database=None)


@st.composite
def solve_args(draw):
    table = {**SEARCH, "-n": st.sampled_from(["-1", "0", "1", "2", "3"]), "--budget": st.sampled_from(SIZES),
             "--mode": st.sampled_from(["full", "bon", "helper", "kvrescue", "x"]),
             "--policy": st.sampled_from(POLICIES), "--choice": st.sampled_from(["prm", "random", "x"]),
             "--json": st.sampled_from(["out.json", "missing/out.json", "adir", "link.json", "fifo", "other.txt"]),
             "--file": st.sampled_from(["other.txt", "latin1.jsonl", "empty.jsonl", "adir", "nope.txt", "fifo"]),
             "--prm": st.sampled_from(["nanhead/prm.gguf", "infhead/prm.gguf"])}
    args = ["solve", *FAST, *options(draw, table)]
    problem = draw(st.sampled_from([None, *PROBLEMS]))
    return args + ([problem] if problem is not None else [])


@st.composite
def bench_run_args(draw):
    table = {**SEARCH, "--limit": st.sampled_from(["-1", "0", "1", "2"]),
             "--modes": st.sampled_from(["full", "full,bon", "kvrescue", "helper,bon", "", "x", "full,full"]),
             "--budgets": st.sampled_from(["", "16", "16,32", "0", "x", ",", "100000000"]),
             "--ns": st.sampled_from(["", "1", "1,2", "0", "x"]), "--policies": st.sampled_from(POLICIES),
             "--choice": st.sampled_from(["prm", "random", "prm,random", "", "x"]),
             "--shard": st.sampled_from(["0/2", "1/2", "3/2", "x", "0/0"]), "--resume": None,
             "--concurrency": st.sampled_from(["-1", "0", "1", "2", "64"]),
             "--memory": st.sampled_from(["1G", "0", "x", "1", "300K", *HUGE_SIZES]),
             "--data": st.sampled_from(["good.jsonl", "dup.jsonl", "latin1.jsonl", "empty.jsonl", "binary.jsonl",
                                        "notjson.jsonl", "adir", "nope.jsonl", "fifo", *NULL_DATA])}
    results = draw(st.sampled_from(["r.jsonl", "shard0.jsonl", "missing/r.jsonl", "adir", "fifo", "other.txt",
                                    "link.json", "binary.jsonl"]))
    return ["bench", "run", "--dataset", "toy", "--limit", "2", *FAST, *options(draw, table), "--results", results]


FILES = ["shard0.jsonl", "shard1.jsonl", "binary.jsonl", "blank.jsonl", "empty.jsonl", "cut.jsonl", "notjson.jsonl",
         "foreign.jsonl", "other.txt", "adir", "nope.jsonl", "fifo", "link.json", "trajectory.json"]


@st.composite
def merge_args(draw):
    inputs = draw(st.lists(st.sampled_from(FILES), min_size=0, max_size=3))
    out = draw(st.sampled_from(["m.jsonl", "shard0.jsonl", "other.txt", "missing/m.jsonl", "adir", "fifo", "link.json"]))
    return ["bench", "merge", *inputs, "--out", out, *draw(st.sampled_from([[], ["--force"]]))]


@st.composite
def report_args(draw):
    table = {"--markdown": None, "--pool-setups": None,
             "--kv-cap": st.sampled_from(["64M", "0", "x", "1", "-5G", *HUGE_SIZES]),
             "--html": st.sampled_from(["trajectory.json", "shard0.jsonl", "binary.jsonl", "nope.json", "adir", "fifo"]),
             "--out": st.sampled_from(["page.html", "missing/page.html", "adir", "fifo", "link.json"])}
    return ["report", *draw(st.lists(st.sampled_from(FILES), max_size=3)), *options(draw, table)]


@st.composite
def estimate_args(draw):
    table = {"--contexts": st.sampled_from(["1k,2k", "4096", "infk", "1e400k", "nan", "1e30k", "0", "x", "", *HUGE]),
             "--budget": st.sampled_from(SIZES), "--buffer": st.sampled_from(SIZES), "--markdown": None,
             "--base": st.sampled_from(["7b", "1.5b", "other.txt", "nope.gguf", "binary.jsonl", "adir"])}
    return ["estimate", *options(draw, table)]


def named_outputs(args: list[str]) -> list[str]:
    """The outputs args name: the values of --json, --results, --out, and --html's default page."""
    out = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--json", "--results", "--out")]
    if "--html" in args and "--out" not in args:
        out.append(str(Path(args[args.index("--html") + 1]).with_suffix(".html")))
    return out


@pytest.mark.parametrize("strategy", [solve_args(), bench_run_args(), merge_args(), report_args(), estimate_args()],
                         ids=["solve", "bench-run", "bench-merge", "report", "estimate"])
def test_drawn_options_end_in_a_result_or_one_error_line(server, inputs, tmp_path_factory, strategy):
    @RUN
    @given(strategy)
    def one(args):
        check(server, inputs, tmp_path_factory, args, named_outputs(args))

    one()


# --- null, NaN and infinity, huge sizes, surrogates: each class once, whatever the draws ---------------------

RUN_TOY = ["bench", "run", "--dataset", "toy", "--limit", "1", *FAST]
CLASSES = {**{f"data-{name}": [*RUN_TOY, "--data", name, "--results", "r.jsonl"] for name in NULL_DATA},
           "surrogate-problem": ["solve", *FAST, SURROGATE],
           "nan-head": ["solve", *FAST, "-n", "2", "--prm", "nanhead/prm.gguf", PROBLEMS[0]],
           "inf-head": ["solve", *FAST, "-n", "2", "--prm", "infhead/prm.gguf", PROBLEMS[0]],
           "huge-max-tokens": ["solve", *FAST, "--max-tokens", HUGE[0], PROBLEMS[0]],
           "huge-prm-ctx": ["solve", *FAST, "-n", "2", "--prm-ctx", HUGE[0], PROBLEMS[0]],
           "huge-problem": ["solve", *FAST, PROBLEMS[-1]],
           "inf-memory": [*RUN_TOY, "--memory", "1e400k", "--results", "r.jsonl"],
           "inf-kv-cap": ["report", "--kv-cap", "infG", "shard0.jsonl"],
           "inf-contexts": ["estimate", "--contexts", "infk"]}


@pytest.mark.parametrize("args", CLASSES.values(), ids=CLASSES.keys())
def test_each_class_of_bad_value_ends_in_one_error_line(server, inputs, tmp_path_factory, args):
    assert check(server, inputs, tmp_path_factory, args, named_outputs(args)) != "rc 0", args


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
