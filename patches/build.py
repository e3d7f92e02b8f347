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

For a machine without network (perf/gpu_check.sh): `--prepare-kit DIR` writes the
sdist stripped to what the build reads (its tree hash pinned below) and the build
backend's wheels into DIR; `--kit DIR` then builds from it and never downloads.
`--build-dir DIR` keeps the unpacked source and CMake's build folder, so an
interrupted build resumes where it stopped.

Standard library only: this runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
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

# What a build with LLAVA_BUILD=OFF never reads (paths under the sdist's root): the vendored models, docs,
# tests, examples and tools, the other backends' sources and git's objects. The rest (sources, CMake files,
# the Python package, git's HEAD files) is the stripped sdist a kit carries.
STRIPPED_PATHS = (
    ".git/objects", ".git/modules/vendor/llama.cpp/objects", ".github", "docker", "docs", "examples", "tests",
    "vendor/llama.cpp/.devops", "vendor/llama.cpp/.github", "vendor/llama.cpp/app", "vendor/llama.cpp/benches",
    "vendor/llama.cpp/ci", "vendor/llama.cpp/conversion", "vendor/llama.cpp/docs", "vendor/llama.cpp/examples",
    "vendor/llama.cpp/gguf-py", "vendor/llama.cpp/grammars", "vendor/llama.cpp/media", "vendor/llama.cpp/models",
    "vendor/llama.cpp/pocs", "vendor/llama.cpp/requirements", "vendor/llama.cpp/scripts", "vendor/llama.cpp/skills",
    "vendor/llama.cpp/tests", "vendor/llama.cpp/tools",
    *(f"vendor/llama.cpp/ggml/src/ggml-{backend}" for backend in (
        "cann", "et", "hexagon", "hip", "metal", "musa", "opencl", "openvino", "sycl", "virtgpu", "vulkan",
        "webgpu", "zdnn", "zendnn")),
)
# sha256 over the stripped sdist's file names and contents (tree_sha256): a kit's source is checked against it
# as the sdist is against SDIST_SHA256. Changes with STRIPPED_PATHS (tests/test_build.py recomputes it).
STRIPPED_TREE_SHA256 = "6a8ffe894f670d5196c9ca344dbbc0d6abd9982b4467f20e26352c0281987b86"
KIT_SOURCE = f"{SDIST_NAME.replace('-', '_')}-{SDIST_VERSION}-stripped.tar.gz"
KIT_MANIFEST = "source.json"
KIT_BUILD_WHEELS = "build-wheels"
# the sdist's build backend (its pyproject's build-system.requires), installed from the kit with no index
BUILD_BACKEND = "scikit-build-core[pyproject]>=0.9.2"

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


def stripped(name: str) -> bool:
    """Whether an sdist member (its name under the sdist's root) is left out of the stripped source."""
    return any(name == path or name.startswith(path + "/") for path in STRIPPED_PATHS)


def tree_sha256(files: list[tuple[str, bytes]]) -> str:
    """A tree's hash from its (name, content) pairs, whatever the archive's order, timestamps or compression."""
    digest = hashlib.sha256()
    for name, content in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()


def archive_files(tar: tarfile.TarFile) -> list[tuple[str, bytes]]:
    return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]


def strip_sdist(sdist: Path, out: Path) -> str:
    """Write the stripped sdist to `out` (a .tar.gz, reproducible: sorted, mtime 0); return its tree hash."""
    root = f"{SDIST_NAME.replace('-', '_')}-{SDIST_VERSION}/"
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    kept = []
    with tarfile.open(sdist) as src, gzip.GzipFile(partial, "wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member in sorted((m for m in src.getmembers() if m.isfile()), key=lambda m: m.name):
            if stripped(member.name.removeprefix(root)):
                continue
            content = src.extractfile(member).read()
            info = tarfile.TarInfo(member.name)
            info.size, info.mode = len(content), member.mode
            tar.addfile(info, io.BytesIO(content))
            kept.append((member.name, content))
    partial.replace(out)
    return tree_sha256(kept)


def prepare_kit(kit: Path, cache: Path) -> None:
    """The stripped sdist, its manifest and the build backend's wheels, for a build with no network."""
    sdist = fetch_sdist(cache)
    tree = strip_sdist(sdist, kit / KIT_SOURCE)
    if tree != STRIPPED_TREE_SHA256:
        raise BuildError(f"the stripped sdist's tree hash is {tree}, build.py pins {STRIPPED_TREE_SHA256}: "
                         "after changing STRIPPED_PATHS, set STRIPPED_TREE_SHA256 to the new hash")
    wheels = kit / KIT_BUILD_WHEELS
    shutil.rmtree(wheels, ignore_errors=True)
    # pure-Python wheels: the same files serve this machine's Python and the kit's target's
    res = run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary", ":all:", "-d", str(wheels), BUILD_BACKEND])
    if res.returncode != 0:
        raise BuildError(f"could not download {BUILD_BACKEND} and its dependencies: check that PyPI is reachable")
    manifest = {"sdist": sdist.name, "sdist_sha256": SDIST_SHA256, "llama_cpp_commit": LLAMA_CPP_COMMIT,
                "source": KIT_SOURCE, "tree_sha256": tree, "build_wheels": sorted(w.name for w in wheels.glob("*.whl"))}
    (kit / KIT_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"kit source: {KIT_SOURCE} ({(kit / KIT_SOURCE).stat().st_size / 2**20:.1f} MiB, tree {tree[:16]}), "
        f"{len(manifest['build_wheels'])} build wheels")


def kit_source(kit: Path) -> Path:
    """The kit's stripped sdist, once its manifest names this build.py's pins."""
    try:
        manifest = json.loads((kit / KIT_MANIFEST).read_text())
    except (OSError, ValueError):
        raise BuildError(f"{kit / KIT_MANIFEST} is missing or unreadable: prepare the kit first "
                         "(perf/gpu_check.sh --prepare)") from None
    if (manifest.get("sdist_sha256"), manifest.get("tree_sha256")) != (SDIST_SHA256, STRIPPED_TREE_SHA256):
        raise BuildError(f"the kit in {kit} was prepared from another sdist or strip rule than build.py pins: "
                         "prepare it again (perf/gpu_check.sh --prepare)")
    return kit / manifest["source"]


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


HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@")
HUNK_SEARCH = 200  # lines either side of a hunk's stated place where its context may be found (patch's offset)


def apply_diff(vendor: Path, patch: Path) -> list[tuple[Path, str]]:
    """What `patch -p1` makes of a `git diff` (files added or changed, exact context), for a machine without
    the patch program: (file, new text) pairs, written by the caller once the whole series applies."""
    changed: dict[Path, list[str]] = {}
    for chunk in re.split(r"(?m)^diff --git ", patch.read_text())[1:]:
        lines = chunk.splitlines(keepends=True)
        old_name = next(l for l in lines if l.startswith("--- "))[4:].strip()
        target = vendor / next(l for l in lines if l.startswith("+++ "))[4:].strip().split("/", 1)[1]
        source = changed.get(target) or ([] if old_name == "/dev/null" else target.read_text().splitlines(keepends=True))
        out, done = [], 0
        starts = [i for i, line in enumerate(lines) if HUNK.match(line)]
        for i, start in enumerate(starts):
            body = lines[start + 1:starts[i + 1] if i + 1 < len(starts) else len(lines)]
            before = [l[1:] for l in body if l[:1] in (" ", "-")]
            after = [l[1:] for l in body if l[:1] in (" ", "+")]
            stated = max(int(HUNK.match(lines[start]).group(1)) - 1, 0) if before else 0
            for offset in sorted(range(-HUNK_SEARCH, HUNK_SEARCH + 1), key=abs):
                at = stated + offset
                if at >= done and source[at:at + len(before)] == before:
                    break
            else:
                raise BuildError(f"patch {patch.name} does not apply to {target.relative_to(vendor)}: "
                                 f"hunk {lines[start].strip()} not found")
            out += source[done:at] + after
            done = at + len(before)
        changed[target] = out + source[done:]
    return [(path, "".join(text)) for path, text in changed.items()]


def apply_patches(vendor: Path, patches: list[Path]) -> None:
    if shutil.which("patch") is None:
        # no patch program (a bare CUDA image): the series' own diffs are simple enough to apply here
        for p in patches:
            for path, text in apply_diff(vendor, p):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            log(f"applied {p.name} (without the patch program)")
        return
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


def installed_cublas(major: int) -> tuple[Path, Path] | None:
    """(library, include) folders of an installed nvidia-cublas wheel (as PyTorch's CUDA builds bring), if any."""
    import site

    for folder in [*sys.path, *site.getsitepackages()]:
        for home in (Path(folder) / "nvidia" / f"cu{major}", Path(folder) / "nvidia" / "cublas"):
            if (home / "lib" / f"libcublas.so.{major}").exists() and (home / "include" / "cublas_v2.h").exists():
                return home / "lib", home / "include"
    return None


def fetch_cublas(cache: Path, major: int, offline: bool) -> tuple[Path, Path]:
    """cuBLAS's (library, include) folders: an installed nvidia-cublas wheel's, else NVIDIA's PyPI wheel unpacked
    once into the cache."""
    found = installed_cublas(major)
    if found:
        return found
    home = cache / "cuda-deps" / f"cublas-cu{major}"
    lib, include = home / "nvidia" / f"cu{major}" / "lib", home / "nvidia" / f"cu{major}" / "include"
    if not (lib / "libcublas.so").exists():
        spec = CUBLAS_WHEEL.format(major=major, next_major=major + 1)
        if offline:
            raise BuildError(f"no cuBLAS in the CUDA toolkit, in an installed {spec} or in {home}: install it, or "
                             "prepare this machine with network first (perf/gpu_check.sh --prepare)")
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
    return lib, include


def cublas_library(lib: Path, name: str) -> Path:
    """The file to link: the unversioned name where it exists, else the major-versioned one."""
    plain = lib / f"{name}.so"
    return plain if plain.exists() else next(iter(sorted(lib.glob(f"{name}.so.*"))), plain)


def cuda_cmake_args(cache: Path, offline: bool = False) -> list[str]:
    """-DGGML_CUDA=on plus what a toolkit without cuBLAS or without a driver needs to build."""
    root = cuda_root()
    args = list(CUDA_CMAKE_ARGS)
    if not toolkit_has(root, "libcublas"):
        lib, include = fetch_cublas(cache, nvcc_major(root), offline)
        flag = f"-I{include}"
        args += [f"-DCUDA_cublas_LIBRARY={cublas_library(lib, 'libcublas')}",
                 f"-DCUDA_cublasLt_LIBRARY={cublas_library(lib, 'libcublasLt')}",
                 f"-DCMAKE_CUDA_FLAGS={flag}", f"-DCMAKE_CXX_FLAGS={flag}"]
    if not toolkit_has(root, "libcuda") and not toolkit_has(root, "stubs/libcuda"):
        # no driver library for CMake to link against (it looks in the toolkit and its stubs; a driver's
        # libcuda.so.1 alone is not linkable): ggml's virtual-memory pool needs one, the legacy pool does not
        args.append("-DGGML_CUDA_NO_VMM=ON")
    return args


def cuda_library_dirs(cache: Path) -> list[Path]:
    """Where the libraries a --cuda build links live (the toolkit's runtime, cuBLAS): LD_LIBRARY_PATH for it."""
    root = cuda_root()
    dirs = [d for d in (root / "lib64", *sorted(root.glob("targets/*/lib"))) if d.is_dir()]
    if not toolkit_has(root, "libcublas"):
        dirs.append(fetch_cublas(cache, nvcc_major(root), offline=True)[0])
    return dirs


def unpack_source(archive: Path, dest: Path, tree: str | None) -> Path:
    """Unpack an sdist, or a kit's stripped one whose tree hash must be `tree`, into dest; return its root."""
    with tarfile.open(archive) as tar:
        if tree is not None and (actual := tree_sha256(archive_files(tar))) != tree:
            raise BuildError(f"{archive.name} has tree hash {actual}, expected {tree}: the kit is damaged; "
                             "prepare it again (perf/gpu_check.sh --prepare)")
        tar.extractall(dest, filter="data")
    return dest / f"{SDIST_NAME.replace('-', '_')}-{SDIST_VERSION}"


def patched_source(archive: Path, tree: str | None, patches: list[Path], work: Path) -> Path:
    """The unpacked, patched source under `work`; kept from an earlier (maybe interrupted) build of the same
    archive and series, so that CMake's build folder beside it only recompiles what is missing."""
    stamp, identity = work / "source.stamp", f"{sha256_of(archive)} {series_hash(patches)}\n"
    src = work / f"{SDIST_NAME.replace('-', '_')}-{SDIST_VERSION}"
    if stamp.exists() and stamp.read_text() == identity and src.is_dir():
        log(f"resuming in {work}")
        return src
    stamp.unlink(missing_ok=True)
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(work / "cmake", ignore_errors=True)
    src = unpack_source(archive, work, tree)
    check_vendored_commit(src)
    apply_patches(src / "vendor" / "llama.cpp", patches)
    stamp.write_text(identity)
    return src


def build_wheel(archive: Path, patches: list[Path], cmake_args: str, out_dir: Path, *, tree: str | None = None,
                build_dir: Path | None = None, find_links: Path | None = None, verbose: bool = False) -> Path:
    """Build the patched wheel from an sdist (tree=None) or a kit's stripped one; find_links: build without an
    index, the build backend from that folder."""
    with tempfile.TemporaryDirectory(prefix="kvrescue-build-") as tmp:
        work = (build_dir or Path(tmp)).resolve()  # the build backend runs in the source folder: no relative paths
        work.mkdir(parents=True, exist_ok=True)
        src = patched_source(archive, tree, patches, work)
        env = dict(os.environ, CMAKE_ARGS=cmake_args)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        log(f"building the wheel (CMAKE_ARGS={cmake_args!r}, {env['CMAKE_BUILD_PARALLEL_LEVEL']} jobs); on 2 cores "
            "about 5 minutes for the CPU, most of an hour with CUDA")
        started = time.monotonic()
        wheel_tmp = Path(tmp) / "wheel"
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheel_tmp), str(src),
               f"--config-settings=build-dir={work / 'cmake'}"]
        if find_links:
            cmd += ["--no-index", "--find-links", str(find_links)]
        if verbose:
            cmd.append("--verbose")
        res = run(cmd, env=env)
        wheels = list(wheel_tmp.glob("*.whl"))
        if res.returncode != 0 or len(wheels) != 1:
            raise BuildError("the llama.cpp build failed (see the compiler output above)")
        out_dir.mkdir(parents=True, exist_ok=True)
        wheel = out_dir / wheels[0].name
        shutil.move(str(wheels[0]), wheel)
        log(f"built {wheel.name} in {time.monotonic() - started:.0f} s")
        return wheel


def cmake_flags(cuda: bool, rpc: bool, cache: Path, offline: bool = False) -> str:
    """The CMake flags of a build: the base ones, the backends asked for, then CMAKE_ARGS."""
    flags = (BASE_CMAKE_ARGS + (cuda_cmake_args(cache, offline) if cuda else []) + (RPC_CMAKE_ARGS if rpc else [])
             + os.environ.get("CMAKE_ARGS", "").split())
    return " ".join(flags)


def cache_key(patches: list[Path], cmake_args: str, source: str = SDIST_SHA256) -> str:
    """A wheel's cache key: what went into it (the source's hash, patch series, flags) and what it runs on."""
    key_src = "\n".join([source, series_hash(patches), cmake_args,
                         sysconfig.get_platform(), platform.python_implementation(), sys.version.split()[0]])
    return hashlib.sha256(key_src.encode()).hexdigest()[:20]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", action="store_true", help="build the CUDA backend (-DGGML_CUDA=on)")
    parser.add_argument("--rpc", action="store_true", help="build llama.cpp's RPC backend (-DGGML_RPC=ON)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"sdist and wheel cache (default {DEFAULT_CACHE})")
    parser.add_argument("--rebuild", action="store_true", help="ignore a cached wheel")
    parser.add_argument("--wheel-only", action="store_true", help="build (or find) the wheel without installing it")
    parser.add_argument("--prepare-kit", type=Path, metavar="DIR",
                        help="write the stripped sdist and the build backend's wheels to DIR (with --cuda: also fetch "
                             "what this machine's CUDA build needs), then stop")
    parser.add_argument("--kit", type=Path, metavar="DIR", help="build from a kit made by --prepare-kit; no download")
    parser.add_argument("--build-dir", type=Path, metavar="DIR",
                        help="keep the source and CMake's build folder in DIR: an interrupted build resumes")
    parser.add_argument("--verbose", action="store_true", help="show CMake's and the compilers' output as they run")
    parser.add_argument("--cuda-lib-path", action="store_true",
                        help="print the folders of the CUDA libraries a --cuda build links (for LD_LIBRARY_PATH), then stop")
    args = parser.parse_args(argv)

    patches = patch_series()
    try:
        if args.cuda_lib_path:
            print(":".join(str(d) for d in cuda_library_dirs(args.cache_dir)))
            return 0
        if args.prepare_kit:
            prepare_kit(args.prepare_kit, args.cache_dir)
            if args.cuda:
                cuda_cmake_args(args.cache_dir)
            return 0
        offline = args.kit is not None
        cmake_args = cmake_flags(args.cuda, args.rpc, args.cache_dir, offline)
        if args.kit:
            archive, tree, source = kit_source(args.kit), STRIPPED_TREE_SHA256, STRIPPED_TREE_SHA256
        else:
            archive, tree, source = fetch_sdist(args.cache_dir), None, SDIST_SHA256
        key = cache_key(patches, cmake_args, source)
        wheel_dir = args.cache_dir / "wheels" / key
        cached = sorted(wheel_dir.glob("*.whl"))
        if cached and not args.rebuild:
            wheel = cached[-1]
            log(f"using cached wheel {wheel} (key {key})")
        else:
            shutil.rmtree(wheel_dir, ignore_errors=True)
            wheel = build_wheel(archive, patches, cmake_args, wheel_dir, tree=tree, build_dir=args.build_dir,
                                find_links=args.kit / KIT_BUILD_WHEELS if args.kit else None, verbose=args.verbose)
        if args.wheel_only:
            print(wheel)
            return 0
        res = run([sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps", str(wheel)])
        if res.returncode != 0:
            raise BuildError(f"pip could not install {wheel}")
        # The wheel's own dependencies (numpy, jinja2, ...) without touching versions already there.
        res = run([sys.executable, "-m", "pip", "install", *(["--no-index"] if offline else []), str(wheel)])
        if res.returncode != 0:
            raise BuildError(f"pip could not install the dependencies of {wheel.name}")
    except (BuildError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    log(f"installed patched llama-cpp-python {SDIST_VERSION} (patch series {', '.join(p.name for p in patches)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
