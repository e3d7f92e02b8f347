"""Weight quantization of a GGUF model by llama.cpp's own quantizer (`llama_model_quantize` of the pinned build).

The quantizer runs in a child process that reports each tensor it starts on stdout, so a crash of it, Ctrl-C or
any failure leaves no output behind: it writes a temporary file beside the output, renamed over it only when the
child succeeded (files.write_replacing). Outputs of `quantized()` land in the model cache, named by the source's
stem, its fingerprint and the type, so one source is quantized once per type however many sweeps ask for it.

Every output records its source beside it, in `<output>.source.json` ({"source", "source_sha256", "sha256",
"type"}: the source's name and fingerprint, files.file_hash, and the output's own): a quantized copy of a
preset's model, wherever it is moved with its record, takes that preset's prompt and recipe (presets.preset_of).
The record holds the output's fingerprint, so a file replaced since is not taken for the copy.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import signal
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

import gguf

from . import gguf_header
from .errors import KVRescueError
from .files import check_input_file, check_writable, file_hash, write_output, write_replacing
from .paths import CACHE

# the types `models quantize --type` and `bench run --weight-types` take, as llama.cpp's llama-quantize names
# them -> llama_ftype (include/llama.h)
WEIGHT_TYPES = {"F16": 1, "Q8_0": 7, "Q6_K": 18, "Q5_K_M": 17, "Q4_K_M": 15, "Q4_0": 2, "Q3_K_M": 12, "Q2_K": 10}
UNQUANTIZED = {0: "F32", 1: "F16", 32: "BF16"}  # general.file_type values whose weights are not quantized
QUANTIZED_DIR = CACHE / "models" / "quantized"  # in presets.MODELS_CACHE
PROGRESS = re.compile(rb"^\[\s*(\d+)/\s*(\d+)\]")  # llama.cpp logs "[  12/ 291] name - [shape], type = ..." per tensor
REQUANTIZE_COST = ("requantizing compounds two roundings of every weight, so the result is worse than the same type "
                   "made from the F16/F32 original; pass --allow-requantize to do it anyway")


def file_type(path: Path) -> str:
    """The GGUF's weight type as llama.cpp names it (general.file_type, e.g. "Q4_K_M", "F16"); a file without the
    key is named by its most common type among matrices."""
    value = metadata_scalar(path, "general.file_type")
    if value is not None:
        if value in UNQUANTIZED:
            return UNQUANTIZED[value]
        try:
            return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
        except ValueError:
            return f"file type {value}"
    matrices = Counter(t.tensor_type.name for t in read_gguf(path).tensors if len(t.shape) > 1)
    return matrices.most_common(1)[0][0] if matrices else "F32"


def metadata_scalar(path: Path, key: str) -> int | float | bool | None:
    """One numeric metadata value of a GGUF, None where the file lacks the key (gguf_header: it stops there)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for name, kind, at, _ in gguf_header.metadata(data):
                if name == key and kind in gguf_header.SCALAR_FORMATS:
                    return gguf_header.scalar(data, at, kind)
    except (KVRescueError, ValueError, struct.error, OSError) as exc:
        raise unreadable_gguf(path, exc) from None
    return None


def tensor_types(path: Path) -> Counter:
    """How many tensors of each ggml type a GGUF holds (what a quantization really made, fallbacks included)."""
    return Counter(t.tensor_type.name for t in read_gguf(path).tensors)


def read_gguf(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError) as exc:
        raise unreadable_gguf(path, exc) from None


def unreadable_gguf(path: Path, exc: Exception) -> KVRescueError:
    return KVRescueError(f"{path} is not a readable GGUF model ({exc.__class__.__name__}): pass a .gguf file "
                         "(a download that finished, a conversion that succeeded)")


def is_quantized(name: str) -> bool:
    return name not in UNQUANTIZED.values()


def check_weight_type(name: str, option: str = "--type") -> str:
    if name.upper() not in WEIGHT_TYPES:
        raise KVRescueError(f"{option} {name!r} is not a weight type: use one of {', '.join(WEIGHT_TYPES)}")
    return name.upper()


def check_source(src: Path, weight_type: str, allow_requantize: bool) -> str:
    """The source's type; refused: a missing file, one cut short (the full read checks every tensor's bounds,
    seconds beside the quantizer's minutes), an already quantized source without allow_requantize."""
    check_input_file(src, "the source model")
    read_gguf(src)
    source_type = file_type(src)
    if is_quantized(source_type) and not allow_requantize:
        raise KVRescueError(f"{src.name} is already {source_type}: {REQUANTIZE_COST}")
    return source_type


def cached_path(src: Path, weight_type: str) -> Path:
    """Where quantized() keeps src at weight_type: the stem, the source's fingerprint and the type."""
    return QUANTIZED_DIR / f"{src.stem}-{file_hash(src)[:8]}-{weight_type}.gguf"


def source_record(path: Path) -> Path:
    """Where a quantized model's source is recorded: beside it."""
    return path.with_name(path.name + ".source.json")


def record_source(src: Path, out: Path, weight_type: str) -> None:

    record = check_writable(source_record(out), "--out", special=False)
    write_output(record, json.dumps({"source": src.name, "source_sha256": file_hash(src), "sha256": file_hash(out),
                                     "type": weight_type}) + "\n", "--out")


def quantized_from(path: Path) -> str | None:
    """The fingerprint of the model `path` was quantized from, as `models quantize` recorded it beside it (None: no
    record, an unreadable one, or a file changed since it was written)."""

    record = source_record(Path(path))
    try:
        if not record.is_file():  # a FIFO or a device is never opened
            return None
        data = json.loads(record.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("sha256") != file_hash(Path(path)):
        return None
    source = data.get("source_sha256")
    return source if isinstance(source, str) else None


def is_copy_of(path: Path, src: Path) -> bool:
    """Whether path is what quantized() made of src (a preset's prompt and recipe apply to it as to src)."""
    path = Path(path)
    if path.parent.resolve() != QUANTIZED_DIR.resolve() or not path.is_file():
        return False
    weight_type = path.stem.rpartition("-")[2]
    return weight_type in WEIGHT_TYPES and path.name == cached_path(src, weight_type).name


def quantized(src: Path, weight_type: str, allow_requantize: bool = False,
              progress: Callable[[int, int], None] | None = None) -> tuple[Path, bool]:
    """src at weight_type in the model cache, made now unless it is there (src itself when it is of that type
    already): (path, made now)."""
    src = check_input_file(Path(src), "the source model")
    weight_type = check_weight_type(weight_type)
    out = cached_path(src, weight_type)
    if out.exists():  # first: reading a GGUF's type parses its whole tensor index (6 s for the 0.5B)
        return out, False
    if file_type(src) == weight_type:
        return src, False
    check_source(src, weight_type, allow_requantize)
    out.parent.mkdir(parents=True, exist_ok=True)
    quantize(src, out, weight_type, allow_requantize, progress)
    return out, True


def quantize(src: Path, out: Path, weight_type: str, allow_requantize: bool = False,
             progress: Callable[[int, int], None] | None = None, option: str = "--out") -> Path:
    """src quantized to weight_type into out, atomically; progress(done, total) after each tensor starts."""
    weight_type = check_weight_type(weight_type)
    check_source(src, weight_type, allow_requantize)
    with write_replacing(out, option) as tmp:
        package_root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
        # a process group of its own: Ctrl-C reaches this process, which kills the child before removing its output
        child = subprocess.Popen([sys.executable, "-m", "kvrescue_local.quantize", str(src), str(tmp),
                                  str(WEIGHT_TYPES[weight_type]), "1" if allow_requantize else "0"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
        try:
            for line in child.stdout:
                match = PROGRESS.match(line)
                if match and progress:
                    progress(int(match.group(1)), int(match.group(2)))
            errors = child.stderr.read().decode("utf-8", "replace").strip()
            status = child.wait()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        if status != 0:
            reason = errors.splitlines()[-1] if errors else (f"killed by signal {-status}" if status < 0 else
                                                              f"status {status}")
            raise KVRescueError(f"llama.cpp could not quantize {src.name} to {weight_type} ({reason}): nothing "
                                f"written")
    record_source(src, out, weight_type)
    return out


def _run_quantizer(src: str, out: str, ftype: int, allow_requantize: bool) -> int:
    """The child's side: llama.cpp's quantizer with its per-tensor log lines on stdout and its errors on stderr."""
    from llama_cpp import llama_cpp as low

    from .runtime.context import default_threads

    @ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
    def log(level: int, text: bytes, user_data) -> None:
        if not text:
            return
        stream = sys.stderr.buffer if level == 4 else sys.stdout.buffer
        stream.write(text)
        if text.endswith(b"\n") or level == 4:
            stream.flush()

    low.llama_log_set(log, None)
    low.llama_backend_init()
    params = low.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = allow_requantize
    params.nthread = default_threads()
    status = low.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params))
    sys.stdout.flush()
    return 0 if status == 0 else 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(_run_quantizer(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"))
