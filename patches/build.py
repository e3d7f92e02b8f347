#!/usr/bin/env python3
"""Build and install llama-cpp-python with kvrescue's llama.cpp patch series.

Downloads the pinned sdist (sha256 checked), applies patches/*.patch to its
vendor/llama.cpp, builds a wheel and installs it into the running Python.
Wheels are cached under a key made of the sdist hash, the patch-series hash,
the build flags and the Python/platform tag, so a re-install takes seconds
while a fresh machine still builds.

CPU by default. CUDA: `--cuda` (adds -DGGML_CUDA=on). RPC: `--rpc` (adds
-DGGML_RPC=ON: `kvrescue-local rpc-server` and `--rpc host:port` need it). Any
other CMake flag passes through the CMAKE_ARGS environment variable, as with
llama-cpp-python.

Standard library only: this runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from ctypes.util import find_library
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# The llama.cpp commit the sdist vendors and the patch series is written against (patches/README.md
# says how to move the series to another one).
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
# mtmd (multimodal) is not used and doubles the build time.
BASE_CMAKE_ARGS = ["-DLLAVA_BUILD=OFF"]
CUDA_CMAKE_ARGS = ["-DGGML_CUDA=on"]
# llama.cpp's RPC backend: the client (layers offloaded to remote servers) and ggml_backend_rpc_start_server
RPC_CMAKE_ARGS = ["-DGGML_RPC=ON"]
# A CUDA toolkit installed without cuBLAS (nvcc alone, as on build machines with no GPU) gets it from
# NVIDIA's PyPI wheel; the major version must match nvcc's.
CUBLAS_WHEEL = "nvidia-cublas>={major},<{next_major}"

PATCH_DIR = Path(__file__).resolve().parent
# kvrescue_local/paths.py's CACHE, repeated: this script runs before the package is installed
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvrescue-local"


class BuildError(RuntimeError):
    pass


def log(message: str) -> None:
    print(f"[kvrescue build] {message}", flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def patch_series() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def series_hash(patches: list[Path]) -> str:
    digest = hashlib.sha256()
    for p in patches:
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return digest.hexdigest()


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("check", False)
    return subprocess.run(cmd, **kwargs)


def fetch_sdist(cache: Path) -> Path:
    sdist_dir = cache / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    sdist = sdist_dir / f"{SDIST_NAME.replace('-', '_')}-{SDIST_VERSION}.tar.gz"
    if not sdist.exists():
        log(f"downloading {SDIST_NAME}=={SDIST_VERSION} sdist")
        res = run([sys.executable, "-m", "pip", "download", f"{SDIST_NAME}=={SDIST_VERSION}",
                   "--no-binary", SDIST_NAME, "--no-deps", "-d", str(sdist_dir)])
        if res.returncode != 0 or not sdist.exists():
            raise BuildError(f"could not download the {SDIST_NAME}=={SDIST_VERSION} sdist: check that PyPI is reachable")
    actual = sha256_of(sdist)
    if actual != SDIST_SHA256:
        sdist.unlink()
        raise BuildError(f"sdist hash mismatch: got {actual}, expected {SDIST_SHA256}; "
                         "the corrupt download was deleted, run again")
    return sdist


def vendored_commit(src: Path) -> str:
    """The llama.cpp commit of an unpacked sdist (its git submodule's HEAD, kept in the sdist)."""
    head = src / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    try:
        return head.read_text().strip()
    except OSError:
        raise BuildError(f"{head} is missing: cannot tell which llama.cpp the sdist vendors") from None


def check_vendored_commit(src: Path) -> None:
    commit = vendored_commit(src)
    if commit != LLAMA_CPP_COMMIT:
        raise BuildError(f"the sdist vendors llama.cpp {commit}, the patch series is written for {LLAMA_CPP_COMMIT}: "
                         "rebase the series (patches/README.md) and update LLAMA_CPP_COMMIT")


def apply_patches(vendor: Path, patches: list[Path]) -> None:
    if shutil.which("patch") is None:
        raise BuildError("the `patch` program is missing: install it (Debian: apt-get install patch)")
    for p in patches:
        # The vendored llama.cpp is a git submodule gitfile: plain patch, not git apply.
        dry = run(["patch", "-p1", "--dry-run", "--batch", "--forward", "-d", str(vendor), "-i", str(p)],
                  capture_output=True, text=True)
        if dry.returncode != 0:
            raise BuildError(f"patch {p.name} does not apply to llama.cpp of {SDIST_NAME} {SDIST_VERSION}:\n"
                             f"{dry.stdout}{dry.stderr}")
        run(["patch", "-p1", "--batch", "--forward", "--quiet", "-d", str(vendor), "-i", str(p)], check=True)
        log(f"applied {p.name}")


def cuda_root() -> Path:
    """The toolkit CMake will find: CUDA_HOME / CUDA_PATH, else /usr/local/cuda, else where nvcc lives."""
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "bin" / "nvcc").exists():
            return Path(candidate).resolve()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise BuildError("--cuda needs the CUDA toolkit: set CUDA_HOME or put its nvcc on PATH")
    return Path(nvcc).resolve().parent.parent


def nvcc_major(root: Path) -> int:
    out = run([str(root / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    for word in out.replace(",", " ").split():
        if word.startswith("V") and word[1:2].isdigit():
            return int(word[1:].split(".")[0])
    raise BuildError(f"could not read the CUDA version from `nvcc --version`:\n{out}")


def toolkit_has(root: Path, library: str) -> bool:
    return any(root.glob(f"lib64/{library}.so*")) or any(root.glob(f"targets/*/lib/{library}.so*"))


def fetch_cublas(cache: Path, major: int) -> Path:
    """cuBLAS headers and libraries from NVIDIA's PyPI wheel, unpacked once into the cache."""
    home = cache / "cuda-deps" / f"cublas-cu{major}"
    lib, include = home / "nvidia" / f"cu{major}" / "lib", home / "nvidia" / f"cu{major}" / "include"
    if not (lib / "libcublas.so").exists():
        spec = CUBLAS_WHEEL.format(major=major, next_major=major + 1)
        log(f"the CUDA toolkit has no cuBLAS: fetching {spec} from PyPI (about 450 MB)")
        with tempfile.TemporaryDirectory(prefix="kvrescue-cublas-") as tmp:
            res = run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", tmp, spec])
            wheels = list(Path(tmp).glob("*.whl"))
            if res.returncode != 0 or len(wheels) != 1:
                raise BuildError(f"could not download {spec}: install cuBLAS with the CUDA toolkit, or make PyPI reachable")
            shutil.rmtree(home, ignore_errors=True)
            shutil.unpack_archive(str(wheels[0]), str(home), "zip")
        for name in ("libcublas", "libcublasLt"):
            (lib / f"{name}.so").symlink_to(f"{name}.so.{major}")
    return home / "nvidia" / f"cu{major}"


def cuda_cmake_args(cache: Path) -> list[str]:
    """-DGGML_CUDA=on plus what a toolkit without cuBLAS or without a driver needs to build."""
    root = cuda_root()
    args = list(CUDA_CMAKE_ARGS)
    if not toolkit_has(root, "libcublas"):
        cublas = fetch_cublas(cache, nvcc_major(root))
        include = f"-I{cublas / 'include'}"
        args += [f"-DCUDA_cublas_LIBRARY={cublas / 'lib' / 'libcublas.so'}",
                 f"-DCUDA_cublasLt_LIBRARY={cublas / 'lib' / 'libcublasLt.so'}",
                 f"-DCMAKE_CUDA_FLAGS={include}", f"-DCMAKE_CXX_FLAGS={include}"]
    if not toolkit_has(root, "libcuda") and find_library("cuda") is None:
        # no driver library to link against: ggml's virtual-memory pool needs it, the legacy pool does not
        args.append("-DGGML_CUDA_NO_VMM=ON")
    return args


def build_wheel(sdist: Path, patches: list[Path], cmake_args: str, out_dir: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="kvrescue-build-") as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = Path(tmp) / f"{SDIST_NAME.replace('-', '_')}-{SDIST_VERSION}"
        check_vendored_commit(src)
        apply_patches(src / "vendor" / "llama.cpp", patches)
        env = dict(os.environ, CMAKE_ARGS=cmake_args)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        log(f"building the wheel (CMAKE_ARGS={cmake_args!r}); on 2 cores about 5 minutes for the CPU, "
            "most of an hour with CUDA")
        started = time.monotonic()
        wheel_tmp = Path(tmp) / "wheel"
        res = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheel_tmp), str(src)], env=env)
        wheels = list(wheel_tmp.glob("*.whl"))
        if res.returncode != 0 or len(wheels) != 1:
            raise BuildError("the llama.cpp build failed (see the compiler output above)")
        out_dir.mkdir(parents=True, exist_ok=True)
        wheel = out_dir / wheels[0].name
        shutil.move(str(wheels[0]), wheel)
        log(f"built {wheel.name} in {time.monotonic() - started:.0f} s")
        return wheel


def cmake_flags(cuda: bool, rpc: bool, cache: Path) -> str:
    """The CMake flags of a build: the base ones, the backends asked for, then CMAKE_ARGS."""
    flags = (BASE_CMAKE_ARGS + (cuda_cmake_args(cache) if cuda else []) + (RPC_CMAKE_ARGS if rpc else [])
             + os.environ.get("CMAKE_ARGS", "").split())
    return " ".join(flags)


def cache_key(patches: list[Path], cmake_args: str) -> str:
    """A wheel's cache key: what went into it (sdist, patch series, flags) and what it runs on."""
    key_src = "\n".join([SDIST_SHA256, series_hash(patches), cmake_args,
                         sysconfig.get_platform(), platform.python_implementation(), sys.version.split()[0]])
    return hashlib.sha256(key_src.encode()).hexdigest()[:20]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", action="store_true", help="build the CUDA backend (-DGGML_CUDA=on)")
    parser.add_argument("--rpc", action="store_true", help="build llama.cpp's RPC backend (-DGGML_RPC=ON)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"sdist and wheel cache (default {DEFAULT_CACHE})")
    parser.add_argument("--rebuild", action="store_true", help="ignore a cached wheel")
    parser.add_argument("--wheel-only", action="store_true", help="build (or find) the wheel without installing it")
    args = parser.parse_args(argv)

    patches = patch_series()
    try:
        cmake_args = cmake_flags(args.cuda, args.rpc, args.cache_dir)
        sdist = fetch_sdist(args.cache_dir)
        key = cache_key(patches, cmake_args)
        wheel_dir = args.cache_dir / "wheels" / key
        cached = sorted(wheel_dir.glob("*.whl"))
        if cached and not args.rebuild:
            wheel = cached[-1]
            log(f"using cached wheel {wheel} (key {key})")
        else:
            shutil.rmtree(wheel_dir, ignore_errors=True)
            wheel = build_wheel(sdist, patches, cmake_args, wheel_dir)
        if args.wheel_only:
            print(wheel)
            return 0
        res = run([sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps", str(wheel)])
        if res.returncode != 0:
            raise BuildError(f"pip could not install {wheel}")
        # The wheel's own dependencies (numpy, jinja2, ...) without touching versions already there.
        res = run([sys.executable, "-m", "pip", "install", str(wheel)])
        if res.returncode != 0:
            raise BuildError(f"pip could not install the dependencies of {wheel.name}")
    except (BuildError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    log(f"installed patched llama-cpp-python {SDIST_VERSION} (patch series {', '.join(p.name for p in patches)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
