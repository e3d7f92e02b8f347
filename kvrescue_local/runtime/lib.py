"""llama-cpp-python's low-level bindings plus the symbols of our patch series.

The patch's functions are bound with ctypes on the library llama-cpp-python
already loaded; a library without them is a stock build and is refused.
"""

from __future__ import annotations

import ctypes
import functools
import sys

from ..errors import KVRescueError

REQUIRED_PATCH_LEVEL = 2
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


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet_log(level: int, text: bytes, user_data) -> None:
    # llama.cpp logs every load at INFO; keep errors (level 4) visible on stderr.
    if level == 4 and text:
        sys.stderr.write(text.decode("utf-8", "replace"))


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
    lib.llama_kvr_attn_enable.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.llama_kvr_attn_enable.restype = ctypes.c_int32
    lib.llama_kvr_attn_reset.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.llama_kvr_attn_reset.restype = None
    lib.llama_kvr_attn_copy.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]
    lib.llama_kvr_attn_copy.restype = None
    lib.llama_kvr_attn_get.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, f32p, ctypes.c_int32]
    lib.llama_kvr_attn_get.restype = ctypes.c_int32
    lib.llama_kvr_k_rows.argtypes = [ctypes.c_void_p, ctypes.c_int32, i32p, ctypes.c_int32, f32p]
    lib.llama_kvr_k_rows.restype = ctypes.c_int32
    return lib


@functools.cache
def patched() -> ctypes.CDLL:
    """The loaded libllama with the patch's symbols declared."""
    return bind_patch(llama()._lib)


def library_path() -> str:
    return str(llama()._lib._name)
