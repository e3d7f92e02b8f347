"""llama-cpp-python's low-level bindings plus the symbols of our patch series.

The patch's functions are bound with ctypes on the library llama-cpp-python
already loaded; a library without them is a stock build and is refused.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

from ..errors import KVRescueError

REQUIRED_PATCH_LEVEL = 5
REBUILD_HINT = "run `python3 patches/build.py` (README: set-up) to install the patched build"


@functools.cache
def llama():
    """The `llama_cpp.llama_cpp` module, with logging silenced and the backend initialised."""
    try:
        from llama_cpp import llama_cpp as low
    except ImportError as exc:
        raise KVRescueError(f"llama-cpp-python is not installed ({exc}); {REBUILD_HINT}") from None
    low.llama_log_set(_quiet_log, None)
    low.llama_backend_init()
    return low


# A CUDA build on a machine without a CUDA device logs this as an error when its backend registers, before any
# command runs; the CPU backend serves instead, `doctor` says whether offload works, and a command's own error stays
# its one `Error:` line.
NO_CUDA_DEVICE = b"ggml_cuda_init: failed to initialize CUDA"


def log_errors(level: int, text: bytes | None) -> None:
    """llama.cpp logs every load at INFO; keep errors (level 4) visible on stderr."""
    if level == 4 and text and not text.startswith(NO_CUDA_DEVICE):
        sys.stderr.write(text.decode("utf-8", "replace"))


_quiet_log = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(
    lambda level, text, user_data: log_errors(level, text))


def bind_patch(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the patch's symbols on lib; refuse a library that lacks them."""
    if not hasattr(lib, "llama_kvr_patch_level"):
        raise KVRescueError(f"unpatched llama.cpp library ({getattr(lib, '_name', lib)}): {REBUILD_HINT}")
    lib.llama_kvr_patch_level.argtypes = []
    lib.llama_kvr_patch_level.restype = ctypes.c_int32
    level = lib.llama_kvr_patch_level()
    if level < REQUIRED_PATCH_LEVEL:
        raise KVRescueError(f"llama.cpp patch level {level} is older than the {REQUIRED_PATCH_LEVEL} this version needs: {REBUILD_HINT}")
    lib.llama_kvr_seq_cells.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                        ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]
    lib.llama_kvr_seq_cells.restype = ctypes.c_int32
    f32p = ctypes.POINTER(ctypes.c_float)
    i32p = ctypes.POINTER(ctypes.c_int32)
    lib.llama_kvr_attn_enable.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool]
    lib.llama_kvr_attn_enable.restype = ctypes.c_int32
    lib.llama_kvr_attn_reset.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.llama_kvr_attn_reset.restype = None
    lib.llama_kvr_attn_observe.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool]
    lib.llama_kvr_attn_observe.restype = None
    lib.llama_kvr_attn_copy.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]
    lib.llama_kvr_attn_copy.restype = None
    lib.llama_kvr_attn_get.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, f32p, ctypes.c_int32]
    lib.llama_kvr_attn_get.restype = ctypes.c_int32
    lib.llama_kvr_attn_get_heads.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, f32p, ctypes.c_int32]
    lib.llama_kvr_attn_get_heads.restype = ctypes.c_int32
    lib.llama_kvr_attn_get_span.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, f32p]
    lib.llama_kvr_attn_get_span.restype = ctypes.c_int32
    lib.llama_kvr_compact.argtypes = [ctypes.c_void_p, ctypes.c_int32, i32p, i32p, i32p, i32p, ctypes.c_int32]
    lib.llama_kvr_compact.restype = ctypes.c_int32
    lib.llama_kvr_k_rows.argtypes = [ctypes.c_void_p, ctypes.c_int32, i32p, ctypes.c_int32, f32p]
    lib.llama_kvr_k_rows.restype = ctypes.c_int32
    return lib


@functools.cache
def patched() -> ctypes.CDLL:
    """The loaded libllama with the patch's symbols declared."""
    return bind_patch(llama()._lib)


def library_path() -> str:
    return str(llama()._lib._name)


def backends() -> list[tuple[str, int]]:
    """(name, devices found) of every ggml backend compiled into the loaded llama.cpp: a CUDA build on a
    machine without a GPU lists CUDA with 0 devices (and runs on the CPU)."""
    llama()  # loads libggml with libllama and registers the backends
    ggml = ctypes.CDLL(str(Path(library_path()).with_name("libggml.so")))
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_reg_get.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_name.restype = ctypes.c_char_p
    ggml.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    regs = [ggml.ggml_backend_reg_get(i) for i in range(ggml.ggml_backend_reg_count())]
    return [(ggml.ggml_backend_reg_name(r).decode(), int(ggml.ggml_backend_reg_dev_count(r))) for r in regs]
