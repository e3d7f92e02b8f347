"""A GGUF file's header read in place: its metadata pairs and the end of its tensor index.

gguf.GGUFReader maps every field and tensor before answering, 150k tokenizer strings of a real model
included: 10 s or more on a busy core, where the weight type or a fingerprint of the header needs a walk
over the bytes that stops where it can.
"""

from __future__ import annotations

import struct
from typing import Iterator

from .errors import KVRescueError

SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                  12: "<d"}  # gguf_type (ggml/include/gguf.h) -> struct format
STRING, ARRAY = 8, 9
HEADER_BYTES = 24  # magic, version, tensor count, metadata count
VERSIONS = (2, 3)  # 64-bit counts and lengths (version 1 had 32-bit ones)


def metadata(data) -> Iterator[tuple[str, int, int, int]]:
    """(key, gguf_type, offset of the value, offset past it) of each metadata pair of a GGUF buffer, in file
    order; struct.error where the buffer ends early, KVRescueError where it is no GGUF of a known version."""
    if data[:4] != b"GGUF":
        raise KVRescueError("not a GGUF file")
    (version,) = struct.unpack_from("<I", data, 4)
    if version not in VERSIONS:
        raise KVRescueError(f"GGUF version {version}: this reader knows {VERSIONS}")
    (n_fields,) = struct.unpack_from("<Q", data, 16)
    at = HEADER_BYTES
    for _ in range(n_fields):
        (length,) = struct.unpack_from("<Q", data, at)
        key = bytes(data[at + 8:at + 8 + length]).decode()
        (kind,) = struct.unpack_from("<I", data, at + 8 + length)
        value_at = at + 12 + length
        at = _past_value(data, value_at, kind)
        yield key, kind, value_at, at


def scalar(data, at: int, kind: int) -> int | float | bool:
    return struct.unpack_from(SCALAR_FORMATS[kind], data, at)[0]


def string(data, at: int) -> str:
    (length,) = struct.unpack_from("<Q", data, at)
    return bytes(data[at + 8:at + 8 + length]).decode("utf-8", "replace")


def index_end(data) -> int:
    """Offset just past the metadata and tensor index (where the tensor data begins, less padding)."""
    at = HEADER_BYTES
    for *_, at in metadata(data):
        pass
    (n_tensors,) = struct.unpack_from("<Q", data, 8)
    for _ in range(n_tensors):
        (length,) = struct.unpack_from("<Q", data, at)
        (n_dims,) = struct.unpack_from("<I", data, at + 8 + length)
        at += 8 + length + 4 + 8 * n_dims + 4 + 8  # name, dims, shape, ggml type, data offset
    return at


def _past_value(data, at: int, kind: int) -> int:
    if kind == STRING:
        (length,) = struct.unpack_from("<Q", data, at)
        return at + 8 + length
    if kind == ARRAY:
        item_kind, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if item_kind in SCALAR_FORMATS:
            return at + count * struct.calcsize(SCALAR_FORMATS[item_kind])
        for _ in range(count):
            at = _past_value(data, at, item_kind)
        return at
    if kind not in SCALAR_FORMATS:
        raise KVRescueError(f"unknown GGUF metadata type {kind}")
    return at + struct.calcsize(SCALAR_FORMATS[kind])
