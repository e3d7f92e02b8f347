"""Option sets drawn by hypothesis for `solve`, `bench run`, `bench merge`, `report`, `estimate` and `serve` on the
toy preset (one thread): every run ends with rc 0, or with rc != 0 and one `Error:` line; no traceback, no abort,
no hang; and no file is created or changed but the outputs the command names. A server that starts is sent SIGTERM
once it says "serving ... on http://...", and must then end by it. Files by identity, in a section of their own:
two writers of one results file at once under different names, an output that names an input, special files.

Each command runs in a child forked from one server process that imported the command line once (this file
run as a script): a child that aborts in llama.cpp is an exit status to report, not the end of the test run,
and no child pays for Python's start-up. Bounded (90 drawn examples, each class of bad value once, and 32
of files) so that CI runs it, and derandomized (the examples follow from the test's source) so that a failure
in CI reproduces."""

import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CHILD_TIMEOUT = 20  # seconds; a toy run takes about one: longer is a hang
EXAMPLES = 15  # per command: 90 in all
# null, NaN and infinity, huge sizes, surrogates: each refused where it enters
SURROGATE = "a=1 \udc80"  # what a non-UTF-8 byte of an argument becomes (surrogateescape)
HUGE = ["100000000", "2147483648", "99999999999999999999"]
HUGE_SIZES = ["infG", "1e400k", "nan", "1e30G", "-inf"]
NULL_DATA = {"null.jsonl": '{"id": 1, "problem": null, "answer": "1"}', "nullanswer.jsonl": '{"problem": "a=1", "answer": null}',
             "emptyanswer.jsonl": '{"problem": "a=1", "answer": []}', "nananswer.jsonl": '{"problem": "a=1", "answer": NaN}',
             "surrogate.jsonl": '{"id": "\\udc80", "problem": "a=1", "answer": "1"}',
             "blankanswer.jsonl": '{"problem": "a=1", "answer": " "}',
             "hugeproblem.jsonl": json.dumps({"problem": "a=1 " * 100_000, "answer": "1"})}
# a row of shard0.jsonl with one field (dotted path) of another type or out of range: each is refused where it is read
MALFORMED_ROWS = {"listid.jsonl": ("id", [1]), "stringsetup.jsonl": ("setup", "a setup"), "nullsetup.jsonl": ("setup", None),
                  "zeroconcurrency.jsonl": ("engine.concurrency", 0)}
ANY_VALUE = [None, True, 0, -1, 2.5, 1e300, "", "x", [], [1], {}, {"a": 1}]
REFUSED = {SURROGATE, *HUGE_SIZES, *NULL_DATA, *MALFORMED_ROWS}  # a run given one of these ends in its Error: line
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
        status = wait_for(pid, log, request.get("stop_when"))
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


def wait_for(pid: int, log: Path, stop_when: str | None = None) -> str:
    """"rc N", "signal N" or "timeout" (the child killed); with stop_when (how a line of a server's output starts
    once it serves: "serving "), the child is sent SIGTERM once its output shows it, and "served" is a child that
    then ended by that signal."""
    deadline = CHILD_TIMEOUT * 10
    stopped = False
    for _ in range(deadline):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if stopped and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM:
                return "served"
            return f"rc {os.waitstatus_to_exitcode(status)}" if os.WIFEXITED(status) else \
                f"signal {os.WTERMSIG(status)}"
        if stop_when and not stopped and log.exists() and any(
                line.startswith(stop_when) for line in log.read_text(errors="replace").splitlines()):
            os.kill(pid, signal.SIGTERM)
            stopped = True
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
        request = {"args": args, "cwd": str(cwd), **({"stop_when": "serving "} if args[:1] == ["serve"] else {})}
        self.process.stdin.write(json.dumps(request) + "\n")
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
    for name, (field, value) in MALFORMED_ROWS.items():
        (folder / name).write_text(edited_rows(folder / "shard0.jsonl", field.split("."), value))
    from kvrescue_local.prm.head import RewardHead

    toy = Path(__file__).resolve().parent.parent / "models" / "toy"
    for name, bad in (("nanhead", float("nan")), ("infhead", float("inf"))):  # a PRM whose head is not finite
        head = RewardHead.load(toy / "prm.head.npz")
        head.weights[0][0, 0] = bad
        (folder / name).mkdir()
        (folder / name / "prm.gguf").symlink_to(toy / "prm.gguf")
        head.save(folder / name / "prm.head.npz")
    return folder


def edited_rows(results: Path, path: list, value) -> str:
    """The rows of results with the field at path (keys and list indices) of its first row set to value."""
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    record = rows[0]
    for key in path[:-1]:
        record = record[key]
    record[path[-1]] = value
    return "".join(json.dumps(row) + "\n" for row in rows)


def field_paths(value, prefix: tuple = ()) -> list[tuple]:
    """Every field of a JSON value, as paths of keys and list indices (a list's first item stands for all)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            out += field_paths(item, (*prefix, key))
    elif isinstance(value, list) and value:
        out += field_paths(value[0], (*prefix, 0))
    return out


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under folder with what it is: a symlink's target, a file's hash, a special file's kind."""
    out = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            out[name] = "link " + os.readlink(path)
        elif path.is_fifo():
            out[name] = "fifo"
        elif path.is_socket():
            out[name] = "socket"
        elif path.is_dir():
            out[name] = "dir"
        else:
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def check(server, inputs: Path, tmp_path_factory, args: list[str], outputs: list[str], prepare=None) -> dict:
    """Run args in a fresh copy of the inputs (prepare(folder) adds to it); the checks of the module's docstring.
    Returns the server's answer."""
    work = tmp_path_factory.mktemp("fuzz")
    shutil.rmtree(work)
    shutil.copytree(inputs, work, symlinks=True)
    os.mkfifo(work / "fifo")  # a FIFO nobody reads or writes: it must be refused, never waited on or replaced
    if prepare is not None:
        prepare(work)
    models = snapshot(Path(__file__).resolve().parent.parent / "models" / "toy")
    before = snapshot(work)
    done = server.run(args, work)
    output, status = done["output"], done["status"]
    shown = f"kvrescue-local {' '.join(map(repr, args))}\n{status}\n{output[-3000:]}"
    assert not status.startswith(("signal", "timeout")), shown
    assert "Traceback" not in output and "GGML_ASSERT" not in output, shown
    if status not in ("rc 0", "served"):
        assert len([line for line in output.splitlines() if line.startswith("Error:")]) == 1, shown
    if REFUSED.intersection(args):  # never solved or read as something it is not ("None", NaN)
        assert status not in ("rc 0", "served"), shown
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
    return done


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
             "--policy": st.sampled_from(POLICIES),
             "--rule": st.sampled_from(["judge", "random", "x", "by-budget:16,judge,lead:base"]),
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
             "--rule": st.sampled_from(["judge", "random", "", "x", "arith:lead:helper,margin=0.2"]),
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


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


# serve's start-up sizes: each checked before the models load (a refusal is one Error: line), or the server
# starts, and stops on SIGTERM
SERVE_SIZES = ["-1", "0", "1", "2", "8", "32", "992", "993", "1024", "2000", "5000", *HUGE]


@st.composite
def serve_args(draw):
    table = {name: st.sampled_from(SERVE_SIZES) for name in ("--prompt-tokens", "--max-tokens", "--max-step-tokens",
                                                              "--concurrency", "--max-queue", "--max-budget",
                                                              "--budget", "-n", "--prm-ctx")}
    table.update({"--memory": st.sampled_from(["1G", "0", "x", "1", "300K", *HUGE_SIZES]),
                  "--max-request-bytes": st.sampled_from(["1M", "0", "x", "1", *HUGE_SIZES]),
                  "--api-key": st.sampled_from(["", " ", "key"])})
    return ["serve", "--preset", "toy", "-t", "1", "--port", free_port(), *options(draw, table)]


def named_outputs(args: list[str]) -> list[str]:
    """The outputs args name: the values of --json, --results, --out, and --html's default page."""
    out = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--json", "--results", "--out")]
    if "--html" in args and "--out" not in args:
        out.append(str(Path(args[args.index("--html") + 1]).with_suffix(".html")))
    return out


@pytest.mark.parametrize("strategy", [solve_args(), bench_run_args(), merge_args(), report_args(), estimate_args(),
                                      serve_args()],
                         ids=["solve", "bench-run", "bench-merge", "report", "estimate", "serve"])
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
           "inf-contexts": ["estimate", "--contexts", "infk"],
           **{f"{command}-{name}": args for name in MALFORMED_ROWS for command, args in (
               ("report", ["report", name]), ("merge", ["bench", "merge", name, "--out", "m.jsonl"]),
               ("resume", ["bench", "run", "--dataset", "toy", "--limit", "2", "--modes", "full,bon", "--ns", "1,2", *FAST,
                           "--resume", "--results", name]))}}


@pytest.mark.parametrize("args", CLASSES.values(), ids=CLASSES.keys())
def test_each_class_of_bad_value_ends_in_one_error_line(server, inputs, tmp_path_factory, args):
    assert check(server, inputs, tmp_path_factory, args, named_outputs(args))["status"] != "rc 0", args


def test_malformed_result_rows_end_in_a_result_or_one_error_line(server, inputs, tmp_path_factory):
    """Any field of a row (types, ranges) of any JSON type, read by `report`, `bench merge` and `--resume`."""
    paths = field_paths(json.loads((inputs / "shard0.jsonl").read_text().splitlines()[0]))
    commands = [["report", "edited.jsonl"], ["bench", "merge", "edited.jsonl", "shard1.jsonl", "--out", "m.jsonl"],
                ["bench", "run", "--dataset", "toy", "--limit", "2", "--modes", "full,bon", "--ns", "1,2", *FAST,
                 "--resume", "--results", "edited.jsonl"]]

    @settings(RUN, max_examples=3 * EXAMPLES)
    @given(st.sampled_from(paths), st.sampled_from(ANY_VALUE), st.sampled_from(commands))
    def one(path, value, args):
        def edit(work: Path) -> None:
            (work / "edited.jsonl").write_text(edited_rows(work / "shard0.jsonl", list(path), value))

        check(server, inputs, tmp_path_factory, args, named_outputs(args), prepare=edit)

    one()


def extreme_sizes() -> dict[str, list[str]]:
    """Every numeric option of every registered policy and every size of the budget, huge and negative: a size
    that drives a loop or an allocation (rkv:kernel=1000000000 once pooled for hours) is refused as it is read."""
    import dataclasses

    from kvrescue_local.eviction import POLICIES

    solve = ["solve", *FAST, "-n", "2", "--budget", "48"]
    out = {}
    for name, policy in sorted(POLICIES.items()):
        for option in dataclasses.fields(policy):
            if type(option.default) in (int, float):
                for value in (HUGE[0], "-" + HUGE[0]):
                    out[f"{name}:{option.name}={value}"] = [*solve, "--policy", f"{name}:{option.name}={value}",
                                                            PROBLEMS[0]]
    for option in ("--budget", "--buffer", "--window", "--n-sink"):
        for value in (HUGE[2], "-1"):
            out[f"{option}={value}"] = [*solve, option, value, PROBLEMS[0]]
    return out


EXTREME_SIZES = extreme_sizes()


@pytest.mark.parametrize("args", EXTREME_SIZES.values(), ids=EXTREME_SIZES.keys())
def test_a_policy_or_budget_size_at_an_extreme_ends_in_one_error_line(server, inputs, tmp_path_factory, args):
    assert check(server, inputs, tmp_path_factory, args, named_outputs(args))["status"] != "rc 0", args


TOY_MODELS = Path(__file__).resolve().parent.parent / "models" / "toy"
# every input path a command reads, {} where the special file goes (a head's name ends in .npz)
INPUT_PATHS = {
    "solve --base": ["solve", *FAST, "--base", "{}", PROBLEMS[0]],
    "solve --helper": ["solve", *FAST, "--helper", "{}", PROBLEMS[0]],
    "solve --prm": ["solve", *FAST, "-n", "2", "--prm", "{}", PROBLEMS[0]],
    "solve --prm head": ["solve", *FAST, "-n", "2", "--prm", f"{TOY_MODELS / 'prm.gguf'}:{{}}.npz", PROBLEMS[0]],
    "bench run --bases": [*RUN_TOY, "--bases", "{}", "--results", "r.jsonl"],
    "bench run --data": ["bench", "run", "--data", "{}", *FAST, "--results", "r.jsonl"],
    "bench run --resume": [*RUN_TOY, "--resume", "--results", "{}"],
    "serve --base": ["serve", "--preset", "toy", "-t", "1", "--base", "{}"],
    "report": ["report", "{}"],
    "report --html": ["report", "--html", "{}", "--out", "page.html"],
    "bench merge": ["bench", "merge", "shard0.jsonl", "{}", "--out", "m.jsonl"],
    "prm train --rollouts": ["prm", "train", "--preset", "toy", "--rollouts", "{}", "--out", "h.head.npz"],
    "prm train --helper": ["prm", "train", "--preset", "toy", "--helper", "{}", "--out", "h.head.npz"],
    "estimate --base": ["estimate", "--base", "{}"],
}
MODEL_INPUTS = ["solve --base", "solve --helper", "solve --prm", "solve --prm head", "bench run --bases", "serve --base"]
SPECIAL_INPUTS = {f"{case} {kind}": [kind if a == "{}" else a.replace("{}", kind) for a in INPUT_PATHS[case]]
                  for case in INPUT_PATHS for kind in ("fifo", *(["zero", "adir"] if case in MODEL_INPUTS else []))}


def special_inputs(work: Path) -> None:
    """The FIFO, a character device and a folder under the names a head takes too (NAME.npz)."""
    os.mkfifo(work / "fifo.npz")
    (work / "zero").symlink_to("/dev/zero")
    (work / "zero.npz").symlink_to("/dev/zero")
    (work / "adir.npz").mkdir()


@pytest.mark.parametrize("args", SPECIAL_INPUTS.values(), ids=SPECIAL_INPUTS.keys())
def test_a_special_file_as_any_input_is_one_error_line(server, inputs, tmp_path_factory, args):
    """A FIFO given as a model, head, data, results or trajectory file once blocked its reader forever; a
    device or folder is refused as well, before anything reads it."""
    done = check(server, inputs, tmp_path_factory, args, named_outputs(args), prepare=special_inputs)
    refused = "not a regular file" in done["output"] or "is a directory" in done["output"]
    assert done["status"] != "rc 0" and refused, f"{args}\n{done['output'][-2000:]}"


# serve's start-up sizes past what the toy's models hold (trained on 1,024 positions), and a blank key
SERVE_REFUSED = [("--prompt-tokens", HUGE[0]), ("--prompt-tokens", "5000"), ("--max-tokens", HUGE[0]),
                 ("--max-tokens", "2000"), ("--max-step-tokens", HUGE[0]), ("--api-key", "")]


@pytest.mark.parametrize(("option", "value"), SERVE_REFUSED, ids=[f"{o}={v}" for o, v in SERVE_REFUSED])
def test_serve_refuses_each_start_up_size_naming_its_option(server, inputs, tmp_path_factory, option, value):
    args = ["serve", "--preset", "toy", "-t", "1", "--port", free_port(), option, value]
    done = check(server, inputs, tmp_path_factory, args, [])
    assert done["status"] not in ("rc 0", "served"), done["output"]
    assert option in next(line for line in done["output"].splitlines() if line.startswith("Error:")), done["output"]
    assert "alloc" not in done["output"], done["output"]  # refused before llama.cpp allocates (it would say so)


# === files by identity: concurrent writers, an output naming an input, special files ===================
# Fixed examples (derandomized): a failure here reproduces as it is.

FILES_RUN = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))
WRITERS_RUN = settings(FILES_RUN, max_examples=8)  # two sweeps at once each: about 3 s an example
# names of one results file r.jsonl, as seen from a subfolder: each writer runs in one of its own
ALIASES = ["../r.jsonl", "../hard-r.jsonl", "./../r.jsonl", "../adir/../r.jsonl", "../link-r.jsonl",
           "../link-dir/r.jsonl"]


@pytest.fixture(scope="module")
def second_server():
    running = Server()
    yield running
    running.close()


def submit(server, args: list[str], cwd: Path) -> None:
    server.process.stdin.write(json.dumps({"args": args, "cwd": str(cwd)}) + "\n")
    server.process.stdin.flush()


def answer(server) -> dict:
    return json.loads(server.process.stdout.readline())


def row_keys(path: Path) -> list[tuple]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["dataset"], r["id"], r["config_key"], r.get("problem_sha256")) for r in rows]


@st.composite
def concurrent_writers(draw):
    """Two writers of one results file started at once, each naming it its own way: a resumed sweep of three
    problems (the shards' two and one more), and another such sweep or a merge of the file with shard 1 into it."""
    first, second = draw(st.permutations(ALIASES))[:2]
    resumed = ["bench", "run", "--dataset", "toy", "--limit", "3", "--modes", "full,bon", "--ns", "1,2", *FAST,
               "--resume", "--results"]
    if draw(st.booleans()):
        out = draw(st.sampled_from(ALIASES))
        return [*resumed, first], ["bench", "merge", second, "../shard1.jsonl", "--out", out]
    return [*resumed, first], [*resumed, second]


def test_concurrent_writers_lose_nothing_and_never_write_twice(server, second_server, inputs, tmp_path_factory):
    """One writer at a time, whatever the name: the other is refused with one `Error:` line naming the one that
    writes; every row a finished writer wrote is there, no row is there twice."""
    from kvrescue_local.bench.datasets import load_dataset

    shards = [row_keys(inputs / f"shard{i}.jsonl") for i in (0, 1)]
    configurations = {key[2] for keys in shards for key in keys}
    sweep = {("toy", p.id, c) for p in load_dataset("toy", limit=3).problems for c in configurations}

    @WRITERS_RUN
    @given(concurrent_writers())
    def one(writers):
        work = tmp_path_factory.mktemp("writers")
        shutil.copyfile(inputs / "shard0.jsonl", work / "r.jsonl")
        shutil.copyfile(inputs / "shard1.jsonl", work / "shard1.jsonl")
        (work / "adir").mkdir()
        (work / "link-r.jsonl").symlink_to("r.jsonl")
        (work / "link-dir").symlink_to(".")
        os.link(work / "r.jsonl", work / "hard-r.jsonl")
        folders = [work / "a", work / "b"]
        for folder, args, running in zip(folders, writers, (server, second_server)):
            folder.mkdir()
            submit(running, args, folder)
        done = [answer(server), answer(second_server)]
        shown = "\n".join(f"kvrescue-local {' '.join(args)}\n{d['status']}\n{d['output'][-2000:]}"
                          for args, d in zip(writers, done))
        for d in done:
            assert d["status"].startswith("rc "), shown
            assert "Traceback" not in d["output"], shown
            if d["status"] != "rc 0":
                errors = [line for line in d["output"].splitlines() if line.startswith("Error:")]
                assert len(errors) == 1 and "being written by another process (PID" in errors[0], shown
        for name in ("r.jsonl", "hard-r.jsonl"):  # one file, until a merge replaces r.jsonl with a new one
            keys = row_keys(work / name)
            assert len(keys) == len(set(keys)), f"{shown}\nrows written twice into {name}"
            assert {key[:3] for key in shards[0]} <= {key[:3] for key in keys}, f"{shown}\nrows lost from {name}"
        for folder, args, d in zip(folders, writers, done):
            if d["status"] == "rc 0":  # its rows are in the file it names last (--results or --out)
                wrote = sweep if args[1] == "run" else {key[:3] for key in shards[1]}
                present = {key[:3] for key in row_keys(folder / args[-1])}
                assert wrote <= present, f"{shown}\nrows of a finished writer lost: {sorted(wrote - present)}"

    one()


OUTPUT_CASES = {  # command -> (the input it reads, its args with {} where the output goes)
    "solve": ("other.txt", ["solve", *FAST, "--file", "other.txt", "--json", "{}"]),
    "report-page": ("trajectory.json", ["report", "--html", "trajectory.json", "--out", "{}"]),
    "report-results": ("shard0.jsonl", ["report", "shard0.jsonl", "--html", "trajectory.json", "--out", "{}"]),
    "report-plots": ("shard0.jsonl", ["report", "{}", "--plots", "."]),
    "bench-run": ("good.jsonl", ["bench", "run", "--data", "good.jsonl", "--modes", "full", "--ns", "1", *FAST,
                                 "--results", "{}"]),
    "quantize": ("base.gguf", ["models", "quantize", "base.gguf", "--type", "Q8_0", "--out", "{}"]),
    "merge": ("shard0.jsonl", ["bench", "merge", "shard0.jsonl", "shard1.jsonl", "--out", "{}"]),
}
OUTPUT_ALIASES = ["{}", "./{}", "adir/../{}", "alias-link", "alias-hard"]


@st.composite
def output_naming_an_input(draw):
    command = draw(st.sampled_from(sorted(OUTPUT_CASES)))
    source, template = OUTPUT_CASES[command]
    alias = draw(st.sampled_from(OUTPUT_ALIASES)).format(source)
    if command == "report-plots":  # the plot it would write is the results file it reads
        source, alias = "shard0.jsonl", "pass1_vs_budget.png"
    return command, source, alias, [alias if a == "{}" else a for a in template]


def test_no_command_writes_over_a_file_it_reads(server, inputs, tmp_path_factory):
    """An output that is one of the command's inputs, by any of its names, is refused with one `Error:` line
    and nothing changes; only `bench merge` may name an input as --out, and then holds every row once."""
    @FILES_RUN
    @given(output_naming_an_input())
    def one(case):
        command, source, alias, args = case

        def aliases(work: Path) -> None:
            if command == "quantize":
                shutil.copyfile(Path(__file__).resolve().parent.parent / "models" / "toy" / "base.gguf",
                                work / "base.gguf")
            (work / "alias-link").symlink_to(source)
            os.link(work / source, work / "alias-hard")
            if command == "report-plots":
                os.link(work / source, work / alias)

        outputs = [os.path.normpath(alias)] if command == "merge" else []
        done = check(server, inputs, tmp_path_factory, args, outputs, prepare=aliases)
        shown = f"kvrescue-local {' '.join(args)}\n{done['status']}\n{done['output'][-2000:]}"
        if command == "merge":
            assert done["status"] == "rc 0", shown
        else:
            assert done["status"] != "rc 0" and "is the file read as" in done["output"], shown

    one()


SPECIAL = ["sock", "loop", "dangling", "fifo", "/dev/null", "/dev/zero", "/dev/full", "/proc/self/status", "adir"]


@st.composite
def special_files(draw):
    """Commands whose inputs and outputs are sockets, symlink loops, dangling symlinks, FIFOs, devices and /proc."""
    special = st.sampled_from(SPECIAL)
    return draw(st.sampled_from([
        ["solve", *FAST, "--file", draw(special), "--json", draw(st.sampled_from(["out.json", *SPECIAL]))],
        ["solve", *FAST, "--json", draw(special), "a=3 b=1"],
        ["bench", "run", "--dataset", "toy", "--limit", "1", "--modes", "full", "--ns", "1", *FAST,
         "--results", draw(special)],
        ["bench", "run", "--data", draw(special), "--modes", "full", "--ns", "1", *FAST, "--results", "r.jsonl"],
        ["bench", "merge", "shard0.jsonl", draw(special), "--out", "m.jsonl"],
        ["bench", "merge", "shard0.jsonl", "--out", draw(special), "--force"],
        ["report", draw(special)],
        ["report", "--html", draw(special), "--out", draw(st.sampled_from(["page.html", *SPECIAL]))],
        ["models", "quantize", draw(special), "--type", "Q8_0", "--out", "q.gguf"],
    ]))


def special(work: Path) -> None:
    """A socket, a symlink loop and a symlink to a file not there yet beside the inputs."""
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(work / "sock"))
    listening.close()  # the socket file stays: what a server that exited leaves
    (work / "loop").symlink_to("loop")
    (work / "dangling").symlink_to("gone.json")


def test_special_files_end_in_a_result_or_one_error_line(server, inputs, tmp_path_factory):
    @FILES_RUN
    @given(special_files())
    def one(args):
        check(server, inputs, tmp_path_factory, args, named_outputs(args), prepare=special)

    one()


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
