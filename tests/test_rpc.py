"""llama.cpp's RPC backend: a greedy f32-KV solve with its layers on a loopback `rpc-server` equals the local
one, evictions included (skipped on a build without GGML_RPC: `python3 patches/build.py --rpc`)."""

import dataclasses
import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrescue_local.bench.datasets import toy_dataset
from kvrescue_local.compose import preset_config
from kvrescue_local.errors import KVRescueError
from kvrescue_local.presets import load_preset
from kvrescue_local.prm import PRM, PRMParams
from kvrescue_local.rescue import Rescue, longest_prompt
from kvrescue_local.rescue.config import cache_fields
from kvrescue_local.runtime import Model
from kvrescue_local.runtime.rpc import parse_endpoints, rpc_library


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


@pytest.fixture(scope="module")
def rpc_endpoint():
    if not rpc_build():
        pytest.skip("this llama.cpp has no RPC backend (python3 patches/build.py --rpc)")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "kvrescue_local", "rpc-server", "--port", str(port), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the rpc-server did not start: {server.stderr.read().decode()}")
            time.sleep(0.1)
    yield f"127.0.0.1:{port}"
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


def test_rpc_server_on_a_build_without_rpc_is_one_error_line():
    if rpc_build():
        pytest.skip("this llama.cpp has the RPC backend")
    result = subprocess.run([sys.executable, "-m", "kvrescue_local", "rpc-server", "--port", str(free_port())],
                            capture_output=True, text=True, timeout=60)
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 1 and line.startswith("Error:") and "patches/build.py --rpc" in line


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
