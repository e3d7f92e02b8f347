"""Every file the project reads or writes goes through here, checked before any model work: a bad path ends
in one `Error:` line, not a traceback after minutes of solving, and a write never loses what was there.

Committed results files are stored zstd-compressed (`results/*.jsonl.zst`): `decompressed` reads them as the
plain text they hold, `compressed_output` writes them, and `check_appendable` keeps appending writers off them.

The one writer (`write_output`): a symlink is written at its target; a regular file is replaced atomically
(a temporary file beside it, fsynced, renamed over it), so a crash or Ctrl-C leaves the old file or the new
one, never half of one; a character device (/dev/null) or a FIFO is written through and never replaced; any
other kind of file is refused. A missing folder is an error: a mistyped path never creates directories.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import json
import math
import mmap
import os
import stat
import struct
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from . import gguf_header
from .errors import KVRescueError

# the magic number every zstd frame starts with (RFC 8878)
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
COMPRESSED_SUFFIX = ".zst"
ZSTD_LEVEL = 19  # written once, read often: the smallest files zstd makes in seconds

KINDS = {stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
         stat.S_IFIFO: "a FIFO"}


def kind_of(mode: int) -> str:
    return KINDS.get(stat.S_IFMT(mode), "not a regular file")


Reads = Iterable[tuple[str, "str | Path | None"]]  # what a command reads: (the option or argument naming it, path)


def same_file(a: str | Path | int, b: str | Path | int) -> bool:
    """Whether two paths (or open file descriptors) name one file, by its identity (device and inode): through
    symlinks, and a hard link, a bind mount or `./x` name the same file as any other of its names."""
    try:
        one, other = os.stat(a), os.stat(b)
    except (OSError, ValueError):  # not there (or not a path: a hub name), so not a file read
        return False
    return (one.st_dev, one.st_ino) == (other.st_dev, other.st_ino)


def check_not_read(path: str | Path, option: str, reads: Reads) -> None:
    """Refuse an output that is one of the files the command reads, by any of its names."""
    for what, source in reads:
        if source is not None and same_file(path, source):
            raise KVRescueError(f"{option} {path} is the file read as {what} ({source}): writing it would replace "
                                "what the command reads: name another output file")


def output_target(path: str | Path, option: str, special: bool = True,
                  reads: Reads = ()) -> tuple[Path, os.stat_result | None]:
    """Where writing path lands (a symlink's target, followed) and its stat (None: not there yet). Refused: a
    directory, a missing folder, a block device or socket, (special=False) a character device or FIFO, and any
    file the command reads (`reads`), however it is named: no command writes over its own input."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    try:
        info = target.stat()
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise KVRescueError(f"cannot write {option} {path} ({exc.strerror}): choose another path") from None
    check_not_read(path, option, reads)
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise KVRescueError(f"{option} {path} is a directory: name a file inside it")
    if info is None and not target.parent.is_dir():
        raise KVRescueError(f"{option} {path}: the folder {target.parent} does not exist: create it first or "
                            "choose a path in an existing folder")
    if info is not None and not stat.S_ISREG(info.st_mode):
        through = stat.S_ISCHR(info.st_mode) or stat.S_ISFIFO(info.st_mode)
        if not (special and through):
            raise KVRescueError(f"{option} {path} is {kind_of(info.st_mode)}, not a regular file: name a regular "
                                "file (or one not there yet)")
    return target, info


def check_writable(path: str | Path, option: str, special: bool = True, reads: Reads = ()) -> Path:
    """Refuse an output path that cannot be written (missing permission or folder, a directory, /proc, a
    read-only disk, a block device; a character device or FIFO only where special) or that is a file the
    command reads, before any work. A bare name that begins with "-" is an option's name taken for the missing
    value (`--results --html`), refused; a path with a folder names a file of that name."""
    if str(path).startswith("-"):
        raise KVRescueError(f"{option} got {str(path)!r}, an option's name, for its file: give {option} a path "
                            f"(with its folder, e.g. {Path.cwd() / path}, for a file of that name)")
    path = Path(path)
    target, info = output_target(path, option, special, reads)
    if info is not None and not stat.S_ISREG(info.st_mode):
        if not os.access(target, os.W_OK):
            raise KVRescueError(f"cannot write {option} {path} (permission denied): choose another path")
        return path
    probe = target.parent / f".{target.name}.{os.getpid()}.probe"
    try:
        probe.write_bytes(b"")
        probe.unlink()
        if info is not None:
            target.open("ab").close()
    except OSError as exc:
        probe.unlink(missing_ok=True)
        raise KVRescueError(f"cannot write {option} {path} ({exc.strerror}): choose a path in a writable "
                            "folder") from None
    return path


def write_through(target: Path, data: bytes, fifo: bool, option: str) -> None:
    """Write into a character device or FIFO as it is: it is never replaced by a regular file."""
    try:
        fd = os.open(target, os.O_WRONLY | (os.O_NONBLOCK if fifo else 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise KVRescueError(f"{option} {target} is a FIFO that no process reads: start its reader first") from None
        raise
    try:
        if fifo:
            os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def write_output(path: str | Path, data: bytes | str, option: str, reads: Reads = ()) -> Path:
    """The one writer: data into path, atomically for a regular file (see the module's docstring); never over a
    file the command reads."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    target, info = output_target(path, option, reads=reads)
    if info is not None and not stat.S_ISREG(info.st_mode):
        write_through(target, data, stat.S_ISFIFO(info.st_mode), option)
        return Path(path)
    with replacing(target, info) as tmp:
        tmp.write_bytes(data)
    return Path(path)


@contextmanager
def replacing(target: Path, info: os.stat_result | None) -> Iterator[Path]:
    """A temporary path beside target for any writer to fill (llama.cpp's quantizer too); when the block ends it is
    fsynced and renamed over target (which keeps its permissions), and when the block raises it is removed."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        with tmp.open("rb+") as out:
            os.fsync(out.fileno())
        if info is not None:
            os.chmod(tmp, stat.S_IMODE(info.st_mode))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_replacing(path: str | Path, option: str) -> AbstractContextManager[Path]:
    """replacing() for a regular file at path (a symlink's target), checked as write_output checks it."""
    target, info = output_target(path, option, special=False)
    return replacing(target, info)


def write_figure(figure, path: str | Path, option: str, reads: Reads = ()) -> Path:
    """A matplotlib figure through the one writer (its format from the file's suffix, else PNG)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=Path(path).suffix.lstrip(".").lower() or "png")
    return write_output(path, buffer.getvalue(), option, reads)


def results_target(path: str | Path, option: str = "--results") -> Path:
    """A results file (appended to, locked, read back) resolved through symlinks: a regular file, or none yet."""
    return output_target(path, option, special=False)[0]


def check_input_file(path: str | Path, what: str, fix: str = "pass a regular file", missing_ok: bool = False) -> Path:
    """An input that exists and is a regular file, checked before anything opens it (Python, numpy or llama.cpp):
    a FIFO blocks its reader until some process writes to it, which may be never; a character device (/dev/zero)
    never ends; a directory or a socket cannot be read. `what` names it (the option, where one gave it) and `fix`
    ends the error line; missing_ok leaves a missing file to its reader, whose message names the fix."""
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        if missing_ok:
            return path
        raise KVRescueError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise KVRescueError(f"cannot read {what} {path} ({exc.strerror}): check the path and its permissions") from None
    if stat.S_ISDIR(info.st_mode):
        raise KVRescueError(f"{what} {path} is a directory: pass a file inside it")
    if not stat.S_ISREG(info.st_mode):
        raise KVRescueError(f"{what} {path} is {kind_of(info.st_mode)}, not a regular file: {fix}")
    return path


@functools.cache
def _fingerprint(path: Path, size: int, mtime_ns: int) -> str:
    if size == 0:
        return hashlib.sha256(b"").hexdigest()[:16]
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            end = gguf_header.index_end(data)
        except (struct.error, ValueError, KVRescueError):
            end = min(size, 1 << 20)  # not a readable GGUF (a reward head, a broken file): its first MiB
        return hashlib.sha256(data[:end]).hexdigest()[:16]


def file_hash(path: Path) -> str:
    """A model file's fingerprint: the SHA-256 of a GGUF's header and tensor index (of another file, its first
    MiB), cached while the file keeps its size and modification time."""
    info = path.stat()
    return _fingerprint(path.resolve(), info.st_size, info.st_mtime_ns)


def decode_utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KVRescueError(f"{where} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
                            "save it as UTF-8") from None


def check_encodable(text: str, where: str, fix: str) -> str:
    """Text that UTF-8, and so a JSON file, can hold. A lone surrogate is what Python makes of bytes that are not
    UTF-8 (an argument decoded with surrogateescape) or of a JSON escape such as "\\udc80": it would be read,
    solved, then fail when the record is written; it is refused where it enters, with `where` and `fix`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise KVRescueError(f"{where} holds \\u{ord(text[exc.start]):04x} at character {exc.start}, which UTF-8 "
                            f"cannot encode (a lone surrogate, or a byte that was not UTF-8): {fix}") from None
    return text


def not_json(value, path: str = "") -> str | None:
    """Where value holds what a JSON file cannot: the path and value of its first number that is not finite, or
    its first text that UTF-8 cannot encode; None where it holds neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path} is {value}, a number that is not finite"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{path} holds text that UTF-8 cannot encode"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = not_json(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def json_text(data, what: str, indent: int | None = None) -> str:
    """data as JSON text that a UTF-8 file can hold: a number that is not finite (NaN would be written as `NaN`,
    which is not JSON) or text that UTF-8 cannot encode is refused, naming `what` and the field."""
    found = not_json(data)
    if found:
        raise KVRescueError(f"{what} {found}, which a JSON file cannot hold: nothing written")
    return json.dumps(data, indent=indent, ensure_ascii=False)


def decompressed(data: bytes, where: str | Path) -> bytes:
    """A file's bytes as the text it holds: zstd frames (a `.zst` file, whatever its name) decompressed, any
    other bytes as they are."""
    if not data.startswith(ZSTD_MAGIC):
        return data
    import zstandard  # here: every command imports this module, and only a compressed file needs zstd

    parts, rest = [], data
    try:
        while rest:  # frame after frame: concatenated .zst files read as one
            frame = zstandard.ZstdDecompressor().decompressobj()
            parts.append(frame.decompress(rest))
            if not frame.eof:
                raise zstandard.ZstdError("it ends inside a frame")
            rest = frame.unused_data
    except zstandard.ZstdError as exc:
        raise KVRescueError(f"{where} is a damaged zstd file ({exc}): restore it (git checkout) or write it again "
                            "with `kvrescue-local bench merge --out`") from None
    return b"".join(parts)


def compressed_output(path: str | Path, data: bytes) -> bytes:
    """data as written to path: zstd-compressed where path ends in .zst."""
    if not str(path).endswith(COMPRESSED_SUFFIX):
        return data
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def check_appendable(path: str | Path, option: str) -> Path:
    """A file lines are appended to: refused where it is zstd-compressed (by its name or its first bytes), since
    appended text would corrupt it."""
    path = Path(path)
    head = b""  # not there yet, not a regular file (a FIFO would block the read), unreadable: its writer says so
    try:
        if path.is_file():
            with path.open("rb") as f:
                head = f.read(len(ZSTD_MAGIC))
    except OSError:
        pass
    if path.name.endswith(COMPRESSED_SUFFIX) or head == ZSTD_MAGIC:
        raise KVRescueError(f"{option} {path} is zstd-compressed, and rows are appended to plain text: make a plain "
                            f"copy (`kvrescue-local bench merge {path} --out NAME.jsonl`) and pass {option} NAME.jsonl")
    return path


def read_utf8(path: Path, what: str) -> str:
    """A text file's contents; bytes that are not UTF-8 are refused with their offset."""
    return decode_utf8(check_input_file(path, what).read_bytes(), f"{what} {path}")


def os_error_message(exc: OSError) -> str:
    """One line for an OSError that reached the command line (a full disk, a vanished folder)."""
    where = f" {exc.filename}" if exc.filename else ""
    if exc.errno == 28:  # ENOSPC
        return f"the disk is full (writing{where}): free space or write to another disk, then run it again"
    return f"{exc.strerror or exc}{':' + where if where else ''}: check the path, its permissions and free space"
