"""llama.cpp's RPC backend: serve this machine's CPU backend to others, and offload a model's layers to
such servers. Both need a build with GGML_RPC (`python3 patches/build.py --rpc`)."""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import sys
from pathlib import Path

from ..errors import KVRescueError
from .lib import GGML_ABORT_CALLBACK, GGML_BACKEND_DEVICE_TYPE_CPU, ggml, ggml_base, library_path, llama, loaded_library

RPC_BUILD_HINT = "install a build with the RPC backend: `python3 patches/build.py --rpc` (README: set-up)"
CONNECT_TIMEOUT_S = 10


@functools.cache
def rpc_library() -> ctypes.CDLL:
    """libggml-rpc beside the loaded libllama, with the calls used here declared; refused when absent."""
    llama()
    path = loaded_library("libggml-rpc")
    if not path.exists():
        raise KVRescueError(f"this llama.cpp has no RPC backend ({path.name} is not beside {Path(library_path()).name}): "
                            f"{RPC_BUILD_HINT}")
    lib = ctypes.CDLL(str(path))
    lib.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    lib.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                                  ctypes.POINTER(ctypes.c_void_p)]
    lib.ggml_backend_rpc_start_server.restype = None
    return lib


def parse_endpoints(text: str) -> tuple[str, ...]:
    """'host:port[,host:port...]' -> the endpoints, each checked."""
    endpoints = tuple(e.strip() for e in text.split(",") if e.strip())
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise KVRescueError(f"--rpc takes host:port[,host:port...] (e.g. 192.168.1.2:50052), not {text!r}")
    if not endpoints:
        raise KVRescueError(f"--rpc takes host:port[,host:port...] (e.g. 192.168.1.2:50052), not {text!r}")
    return endpoints


def check_reachable(endpoint: str) -> None:
    """ggml aborts the process when it cannot connect: try the endpoint first."""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise KVRescueError(f"no RPC server answers at {endpoint} ({exc.strerror or exc}): start `kvrescue-local "
                            "rpc-server --host HOST --port PORT` there and let this machine reach it") from None


@functools.cache
def rpc_devices(endpoints: tuple[str, ...]) -> ctypes.Array:
    """The NULL-terminated device list of llama_model_params.devices: each server's devices, connected once per
    process (what is not offloaded stays on this machine's CPU)."""
    lib = rpc_library()
    end_on_abort(endpoints)
    devices = []
    for endpoint in endpoints:
        check_reachable(endpoint)
        reg = lib.ggml_backend_rpc_add_server(endpoint.encode())
        count = ggml().ggml_backend_reg_dev_count(reg) if reg else 0
        if not count:
            raise KVRescueError(f"no RPC server answers at {endpoint}: start `kvrescue-local rpc-server --host HOST "
                                "--port PORT` there (and let this machine reach it)")
        devices += [ggml().ggml_backend_reg_dev_get(reg, i) for i in range(count)]
    return (ctypes.c_void_p * (len(devices) + 1))(*devices, None)


def lost_server_message(endpoints: tuple[str, ...], abort_message: str) -> str:
    """The one line a ggml abort ends in when layers live on RPC servers."""
    reason = abort_message.rsplit(": ", 1)[-1].strip() or abort_message.strip()
    if "RPC" not in abort_message and not any(endpoint in abort_message for endpoint in endpoints):
        return f"llama.cpp stopped ({reason}); the run ended there, nothing after it was written"
    return (f"lost the RPC server at {', '.join(endpoints)} ({reason}): it was stopped, crashed or is not a "
            "`kvrescue-local rpc-server`; start it again and rerun (`bench run --resume` keeps the finished rows; "
            "a solve's --json is written only when it finishes)")


@functools.cache
def end_on_abort(endpoints: tuple[str, ...]) -> None:
    """Make a ggml abort (a lost server: "Remote RPC server crashed or returned malformed response") end the process
    with one `Error:` line and status 1 instead of abort()'s backtrace and status 134. ggml calls the callback and
    then abort(), and it runs inside a llama.cpp call, where no exception can travel: so it writes the line and
    leaves with os._exit. Finished results rows are on disk already (each is flushed as it is written) and a
    --json is written whole or not at all, so nothing finished is lost."""

    def on_abort(message: bytes | None) -> None:
        sys.stdout.flush()
        sys.stderr.write(f"\nError: {lost_server_message(endpoints, (message or b'').decode('utf-8', 'replace'))}\n")
        sys.stderr.flush()
        os._exit(1)

    callback = GGML_ABORT_CALLBACK(on_abort)
    _abort_callbacks.append(callback)  # ggml keeps the pointer: the ctypes object must outlive every llama.cpp call
    ggml_base().ggml_set_abort_callback(callback)


_abort_callbacks: list = []


def serve_backend(host: str, port: int, threads: int) -> None:
    """Serve this machine's CPU backend on host:port (blocks: run it in a thread of its own)."""
    lib = rpc_library()
    cpu = ggml().ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    devices = (ctypes.c_void_p * 1)(cpu)
    lib.ggml_backend_rpc_start_server(f"{host}:{port}".encode(), None, threads, 1, devices)
