"""llama.cpp's RPC backend: a greedy f32-KV solve with its layers on a loopback `rpc-server` equals the local
one, evictions included (skipped on a build without GGML_RPC: `python3 patches/build.py --rpc`)."""

import dataclasses
import importlib.util
import json
import os
import socket
import threading
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvrescue_local.compose import preset_config
from kvrescue_local.errors import KVRescueError
from kvrescue_local.presets import load_preset
from kvrescue_local.prm import PRM, PRMParams
from kvrescue_local.rescue import Rescue, longest_prompt
from kvrescue_local.rescue.config import cache_fields
from kvrescue_local.runtime import Model
from kvrescue_local.runtime.lib import library_path
from kvrescue_local.runtime.rpc import parse_endpoints, rpc_library
from kvrescue_local.toy.dataset import toy_dataset


def rpc_build() -> bool:
    try:
        rpc_library()
    except KVRescueError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


needs_rpc = pytest.mark.skipif(not rpc_build(), reason="this llama.cpp has no RPC backend (python3 patches/build.py --rpc)")


def start_server() -> tuple[subprocess.Popen, str]:
    """A loopback `kvrescue-local rpc-server` that accepts connections, and its endpoint."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "kvrescue_local", "rpc-server", "--port", str(port), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"127.0.0.1:{port}"
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the rpc-server did not start: {server.stderr.read().decode()}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def rpc_endpoint():
    if not rpc_build():
        pytest.skip("this llama.cpp has no RPC backend (python3 patches/build.py --rpc)")
    server, endpoint = start_server()
    yield endpoint
    server.terminate()
    server.wait(timeout=30)


def toy_solve(problem: str, rpc: tuple[str, ...]):
    preset = load_preset("toy")
    config = dataclasses.replace(preset_config(preset, temperature=0.0, n=2, n_threads=1), **cache_fields("f32", "f32"))
    layers = -1 if rpc else 0
    base, helper = Model(preset.base, n_gpu_layers=layers, rpc=rpc), Model(preset.helper, n_gpu_layers=layers, rpc=rpc)
    prm = PRM(preset.prm, PRMParams(n_ctx=config.prm_context(len(problem.encode())), max_candidates=4, n_threads=1),
              head=preset.prm_head)
    engine = Rescue(config, base, helper, prm, prompt_tokens_max=longest_prompt(config, [base, helper], [problem]))
    return engine.solve(problem)


def test_a_greedy_f32_solve_over_rpc_equals_the_local_one(rpc_endpoint):
    problem = toy_dataset().problems[3].problem
    local, remote = toy_solve(problem, ()), toy_solve(problem, (rpc_endpoint,))
    assert local.evictions["evictions"] > 0  # the budget is reached: eviction runs on the remote layers too
    assert remote.evictions == local.evictions
    assert [(s.source, s.text) for s in remote.steps] == [(s.source, s.text) for s in local.steps]
    assert [[c.text for c in s.candidates] for s in remote.steps] == [[c.text for c in s.candidates] for s in local.steps]


def test_rpc_endpoints_are_checked():
    assert parse_endpoints("10.0.0.2:50052, 10.0.0.3:50052") == ("10.0.0.2:50052", "10.0.0.3:50052")
    for bad in ("10.0.0.2", "host:port", ":50052", "h:70000", ","):
        with pytest.raises(KVRescueError, match="host:port"):
            parse_endpoints(bad)


def test_rpc_server_on_a_build_without_rpc_is_one_error_line(tmp_path):
    """The installed build's libraries without libggml-rpc (whether it had one or not): a build without the RPC
    backend is refused naming `patches/build.py --rpc`; a build whose libllama needs the missing library cannot
    load at all, and says so naming `patches/build.py` (a traceback before)."""
    installed = Path(library_path()).parent
    for library in installed.iterdir():
        if not library.name.startswith("libggml-rpc"):
            (tmp_path / library.name).symlink_to(library)
    result = subprocess.run([sys.executable, "-m", "kvrescue_local", "rpc-server", "--port", str(free_port())],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "LLAMA_CPP_LIB_PATH": str(tmp_path)})
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 1 and line.startswith("Error:") and "patches/build.py" in line
    needs_rpc = b"libggml-rpc.so.0" in (installed / "libggml.so.0").read_bytes()  # in its NEEDED entries
    assert ("cannot be loaded" in line) if needs_rpc else ("patches/build.py --rpc" in line), line


def test_llama_cpp_s_errors_reach_stderr_but_a_cuda_build_without_a_device_adds_no_line(capsys):
    from kvrescue_local.runtime.lib import log_errors

    log_errors(4, b"ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected\n")
    log_errors(2, b"llama_model_loader: loaded meta data with 26 key-value pairs\n")
    log_errors(4, b"llama_model_load: error loading model\n")
    assert capsys.readouterr().err == "llama_model_load: error loading model\n"


def test_an_unreachable_rpc_server_is_one_error_line():
    if not rpc_build():
        pytest.skip("this llama.cpp has no RPC backend (python3 patches/build.py --rpc)")
    result = subprocess.run([sys.executable, "-m", "kvrescue_local", "solve", "1+1", "-t", "1", "--rpc",
                             f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("Error: no RPC server answers at 127.0.0.1:")


def test_the_rpc_build_has_its_own_flag_and_wheel_cache_key(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("kvrescue_build", Path(__file__).parents[1] / "patches" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    rpc, plain = build.cmake_flags(False, True, tmp_path), build.cmake_flags(False, False, tmp_path)
    assert "-DGGML_RPC=ON" in rpc.split() and "-DGGML_RPC=ON" not in plain.split()
    series = build.patch_series()
    assert build.cache_key(series, rpc) != build.cache_key(series, plain)


# --- a lost server: one Error line, status 1, finished rows kept ---------------------------------------------------

TOY_SOLVE = ["--budget", "48", "-n", "2", "--temp", "0", "-t", "1"]


def one_error_line(stderr: str) -> str:
    """The run's one `Error:` line; ggml's own abort output (its message, a backtrace) must not be there."""
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "backtrace" not in stderr.lower() and "GGML_ABORT" not in stderr, stderr[-3000:]
    return errors[0]


def test_a_ggml_abort_with_rpc_layers_is_one_error_line_and_status_1():
    """ggml's abort callback, as a lost server triggers it inside a decode (ggml_abort called here directly)."""
    code = ("from kvrescue_local.runtime.lib import ggml_base; from kvrescue_local.runtime.rpc import end_on_abort; "
            "end_on_abort(('127.0.0.1:50052',)); "
            "ggml_base().ggml_abort(b'ggml-rpc.cpp', 1, b'Remote RPC server crashed or returned malformed response')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert one_error_line(run.stderr).startswith(
        "Error: lost the RPC server at 127.0.0.1:50052 (Remote RPC server crashed or returned malformed response)")


@needs_rpc
def test_a_server_killed_mid_solve_ends_it_in_one_error_line(tmp_path):
    server, endpoint = start_server()
    record = tmp_path / "solve.json"
    problem = toy_dataset().problems[3].problem
    solve = subprocess.Popen([sys.executable, "-m", "kvrescue_local", "solve", problem, *TOY_SOLVE, "--rpc", endpoint,
                              "--json", str(record)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first_step = solve.stdout.readline()  # a step committed: the layers are on the server and decoding
    server.kill()
    server.wait(timeout=30)
    out, err = solve.communicate(timeout=300)
    assert first_step.startswith("[  1]"), first_step + out + err
    assert solve.returncode == 1
    assert one_error_line(err).startswith(f"Error: lost the RPC server at {endpoint}")
    assert not record.exists()


@needs_rpc
def test_a_port_that_accepts_and_closes_is_one_error_line():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept_and_close():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed at the end of the test
                return
            connection.close()

    threading.Thread(target=accept_and_close, daemon=True).start()
    try:
        run = subprocess.run([sys.executable, "-m", "kvrescue_local", "solve", "1+1", *TOY_SOLVE, "--rpc",
                              f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=300)
    finally:
        listener.close()
    assert run.returncode == 1
    assert one_error_line(run.stderr).startswith(f"Error: lost the RPC server at 127.0.0.1:{port}")


@needs_rpc
def test_a_server_killed_mid_sweep_keeps_the_finished_rows_which_record_it(tmp_path):
    server, endpoint = start_server()
    results = tmp_path / "rows.jsonl"
    sweep = subprocess.Popen([sys.executable, "-m", "kvrescue_local", "bench", "run", "--dataset", "toy", "--limit", "6",
                              "--modes", "kvrescue", "--budgets", "48", "--ns", "2", "--temp", "0", "-t", "1",
                              "--rpc", endpoint, "--results", str(results)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (results.exists() and results.read_bytes().endswith(b"\n")) and sweep.poll() is None:
        assert time.monotonic() < deadline, "no row written in 300 s"
        time.sleep(0.2)
    server.kill()
    server.wait(timeout=30)
    _, err = sweep.communicate(timeout=300)
    assert sweep.returncode == 1
    assert one_error_line(err).startswith(f"Error: lost the RPC server at {endpoint}")
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert 1 <= len(rows) < 6
    assert all(row["setup"]["rpc"] == {"servers": [endpoint], "n_gpu_layers": -1} for row in rows)


def test_ngl_says_how_many_layers_go_to_the_rpc_servers(monkeypatch):
    """-ngl 0 --rpc keeps every layer here; without -ngl all of them go to the servers."""
    from kvrescue_local import compose
    from kvrescue_local.rescue import RescueConfig

    opened = []
    monkeypatch.setattr(compose, "Model", lambda path, n_gpu_layers, rpc: opened.append((n_gpu_layers, rpc)))
    for given in (None, 0, 3):
        options = {"preset": "toy", "base": None, "helper": None, "prm": None, "rpc": "127.0.0.1:50052",
                   "n_gpu_layers": given}
        compose.open_model(compose.select_models(options, True, False, needs_prm=False), RescueConfig(), Path("b.gguf"))
    assert opened == [(compose.ALL_LAYERS, ("127.0.0.1:50052",)), (0, ("127.0.0.1:50052",)), (3, ("127.0.0.1:50052",))]


@needs_rpc
def test_the_graph_capture_reads_tensors_held_by_a_server(rpc_endpoint, base_path):
    """cb_eval's tensors of a model whose layers live on the server are not in this process's memory: read
    through ggml's backend API they are the local model's."""
    from kvrescue_local.runtime import ContextParams
    from kvrescue_local.runtime.attention import GraphCapture

    captured = []
    for model in (Model(base_path), Model(base_path, n_gpu_layers=-1, rpc=(rpc_endpoint,))):
        capture = GraphCapture(("kq-", "Kcur-"))
        ctx = capture.context(model, ContextParams(n_ctx=256, type_k="f32", type_v="f32", flash_attn="off"))
        ctx.prefill(0, model.tokenize("Q: 17+93-5? A: 105. " * 3))
        captured.append(capture.tensors)
    local, remote = captured
    assert local and sorted(remote) == sorted(local)
    for name in local:
        np.testing.assert_allclose(remote[name], local[name], rtol=1e-5, atol=1e-6, err_msg=name)
