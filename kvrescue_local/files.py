"""Input and output files checked before any model work: a bad path ends in one `Error:` line, not a traceback
after minutes of solving."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import KVRescueError


def check_writable(path: Path, option: str) -> Path:
    """Refuse an output path that cannot be written (missing permission, a directory, /proc, a read-only disk)."""
    path = Path(path)
    if path.is_dir():
        raise KVRescueError(f"{option} {path} is a directory: name a file inside it")
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".{path.name}.{os.getpid()}.probe"
        probe.write_bytes(b"")
        probe.unlink()
        if path.exists():
            path.open("ab").close()
    except OSError as exc:
        raise KVRescueError(f"cannot write {option} {path} ({exc.strerror}): choose a path in a writable "
                            "folder") from None
    return path


def read_utf8(path: Path, what: str) -> str:
    """A text file's contents; bytes that are not UTF-8 are refused with their offset."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KVRescueError(f"{what} {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
                            "save it as UTF-8") from None


def os_error_message(exc: OSError) -> str:
    """One line for an OSError that reached the command line (a full disk, a vanished folder)."""
    where = f" {exc.filename}" if exc.filename else ""
    if exc.errno == 28:  # ENOSPC
        return f"the disk is full (writing{where}): free space or write to another disk, then run it again"
    return f"{exc.strerror or exc}{':' + where if where else ''}: check the path, its permissions and free space"
