"""llama-cpp-python's low-level bindings plus the symbols of our patch series.

The patch's functions are bound with ctypes on the library llama-cpp-python
already loaded; a library without them is a stock build and is refused.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

from .. import interrupts
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
    except RuntimeError as exc:  # llama_cpp raises it when libllama or a library it needs cannot be loaded
        raise KVRescueError(f"the llama.cpp library cannot be loaded ({exc}); {REBUILD_HINT}") from None
    interrupts.install()  # before llama.cpp calls back into Python
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


@interrupts.callback
def _log(level: int, text: bytes | None, user_data) -> None:
    log_errors(level, text)


@interrupts.callback
def _progress(progress: float, user_data) -> bool:
    return not interrupts.pending()


_quiet_log = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_log)
# llama_progress_callback: returning false stops a model load, which Ctrl-C (noted by `interrupts`) does
load_progress = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_float, ctypes.c_void_p)(_progress)


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


def loaded_library(name: str) -> Path:
    """libNAME beside the loaded libllama, under the file name its dependents load it by (the soname, NAME.so.0),
    so that ctypes reaches the copy already loaded: a wheel holds NAME.so, NAME.so.0 and NAME.so.0.x.y as separate
    files, and opening another of them would load a second copy with its own state (backend registry, abort
    callback)."""
    folder = Path(library_path()).parent
    soname = folder / f"{name}.so.0"
    return soname if soname.exists() else folder / f"{name}.so"


# ggml_abort_callback_t: called with the message just before ggml's abort()
GGML_ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)


@functools.cache
def ggml_base() -> ctypes.CDLL:
    """libggml-base beside the loaded libllama: ggml_backend_tensor_get (a tensor's bytes from whichever backend's
    buffer holds it: a GPU's memory cannot be read from the host through tensor->data) and ggml_set_abort_callback."""
    llama()
    lib = ctypes.CDLL(str(loaded_library("libggml-base")))
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_set_abort_callback.argtypes = [GGML_ABORT_CALLBACK]
    lib.ggml_set_abort_callback.restype = ctypes.c_void_p
    return lib


# libggml's backend registry and device calls used here: name -> (argtypes, restype)
_P, _SIZE = ctypes.c_void_p, ctypes.c_size_t
GGML_CALLS = {
    "ggml_backend_reg_count": ([], _SIZE),
    "ggml_backend_reg_get": ([_SIZE], _P),
    "ggml_backend_reg_name": ([_P], ctypes.c_char_p),
    "ggml_backend_reg_dev_count": ([_P], _SIZE),
    "ggml_backend_reg_dev_get": ([_P, _SIZE], _P),
    "ggml_backend_dev_count": ([], _SIZE),
    "ggml_backend_dev_get": ([_SIZE], _P),
    "ggml_backend_dev_by_name": ([ctypes.c_char_p], _P),
    "ggml_backend_dev_by_type": ([ctypes.c_int], _P),
    "ggml_backend_dev_name": ([_P], ctypes.c_char_p),
    "ggml_backend_dev_type": ([_P], ctypes.c_int),
}


@functools.cache
def ggml() -> ctypes.CDLL:
    """libggml beside the loaded libllama, with GGML_CALLS declared."""
    llama()  # loads libggml with libllama and registers the backends
    lib = ctypes.CDLL(str(loaded_library("libggml")))
    for name, (argtypes, restype) in GGML_CALLS.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = restype
    return lib


def backends() -> list[tuple[str, int]]:
    """(name, devices found) of every ggml backend compiled into the loaded llama.cpp: a CUDA build on a
    machine without a GPU lists CUDA with 0 devices (and runs on the CPU)."""
    lib = ggml()
    regs = [lib.ggml_backend_reg_get(i) for i in range(lib.ggml_backend_reg_count())]
    return [(lib.ggml_backend_reg_name(r).decode(), int(lib.ggml_backend_reg_dev_count(r))) for r in regs]


# ggml_backend_dev_type: the CPU, and the devices a model's layers are offloaded to (an accelerator, BLAS or AMX,
# serves the CPU's)
GGML_BACKEND_DEVICE_TYPE_CPU = 0
OFFLOAD_DEVICE_TYPES = (1, 2)  # GPU, integrated GPU


def devices() -> list[tuple[str, int]]:
    """(name, ggml_backend_dev_type) of every device the loaded llama.cpp found: CPU, CUDA0, ..."""
    lib = ggml()
    found = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    return [(lib.ggml_backend_dev_name(d).decode(), int(lib.ggml_backend_dev_type(d))) for d in found]


def device_list(names: tuple[str, ...]) -> ctypes.Array:
    """The NULL-terminated llama_model_params.devices of these local devices (names as `devices()` gives them)."""
    lib = ggml()
    handles = [lib.ggml_backend_dev_by_name(name.encode()) for name in names]
    missing = [name for name, handle in zip(names, handles) if not handle]
    if missing:
        raise KVRescueError(f"this llama.cpp has no device {', '.join(missing)}: use one of "
                            f"{', '.join(name for name, _ in devices())} (`kvrescue-local doctor` lists them)")
    return (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
