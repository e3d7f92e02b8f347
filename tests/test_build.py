"""patches/build.py refuses what it must refuse, without building anything."""

import hashlib
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("kvrescue_build", ROOT / "patches" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_corrupt_sdist_is_refused_and_deleted(build, tmp_path):
    sdist = tmp_path / "sdist" / f"llama_cpp_python-{build.SDIST_VERSION}.tar.gz"
    sdist.parent.mkdir()
    sdist.write_bytes(b"not the sdist")
    with pytest.raises(build.BuildError, match="hash mismatch"):
        build.fetch_sdist(tmp_path)
    assert not sdist.exists()


@pytest.mark.parametrize("patch_program", [True, False], ids=["patch", "built-in"])
def test_a_patch_that_does_not_apply_is_named(build, tmp_path, monkeypatch, patch_program):
    if not patch_program:
        monkeypatch.setattr(build.shutil, "which", lambda name: None)
    vendor = tmp_path / "vendor"
    (vendor / "include").mkdir(parents=True)
    (vendor / "include" / "llama.h").write_text("something else entirely\n")
    with pytest.raises(build.BuildError, match="0001-cell-map.patch does not apply"):
        build.apply_patches(vendor, build.patch_series())


def test_the_series_applies_to_the_pinned_sdist(build, tmp_path, monkeypatch):
    """Checked against the sdist in the build cache (present after the README's set-up), with the patch program
    and without it."""
    sdist = build.DEFAULT_CACHE / "sdist" / f"llama_cpp_python-{build.SDIST_VERSION}.tar.gz"
    if not sdist.exists():
        pytest.skip("no cached sdist: run patches/build.py first")
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == build.SDIST_SHA256
    with tarfile.open(sdist) as tar:
        lines = [line for p in build.patch_series() for line in p.read_text().splitlines()]
        created = {line.split()[1].split("/", 1)[1] for before, line in zip(lines, lines[1:])
                   if before == "--- /dev/null" and line.startswith("+++ b/")}
        touched = {line.split()[1].split("/", 1)[1] for line in lines if line.startswith("--- a/")} - created
        assert created and all(f.startswith("src/llama-kvr") for f in created), "new code in new files"
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name
                   and m.name.split("/vendor/llama.cpp/", 1)[1] in touched]
        assert len(members) == len(touched), "every upstream file the series touches is in the sdist"
        root = Path(tar.getnames()[0]).parts[0]
        tar.extractall(tmp_path / "patch", members=members, filter="data")
        tar.extractall(tmp_path / "built-in", members=members, filter="data")
    with_patch, built_in = (tmp_path / side / root / "vendor" / "llama.cpp" for side in ("patch", "built-in"))
    build.apply_patches(with_patch, build.patch_series())
    # a machine without the patch program: the built-in applier makes the same files
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    build.apply_patches(built_in, build.patch_series())
    for path in sorted(touched | created):
        assert (built_in / path).read_bytes() == (with_patch / path).read_bytes(), path


def test_the_vendored_llama_cpp_commit_is_checked(build, tmp_path):
    head = tmp_path / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    with pytest.raises(build.BuildError, match="cannot tell which llama.cpp"):
        build.check_vendored_commit(tmp_path)
    head.parent.mkdir(parents=True)
    head.write_text(build.LLAMA_CPP_COMMIT + "\n")
    build.check_vendored_commit(tmp_path)
    head.write_text("0" * 40 + "\n")
    with pytest.raises(build.BuildError, match="rebase the series"):
        build.check_vendored_commit(tmp_path)
    sdist = build.DEFAULT_CACHE / "sdist" / f"llama_cpp_python-{build.SDIST_VERSION}.tar.gz"
    if sdist.exists():  # the pinned sdist vendors the commit the series names
        root = f"llama_cpp_python-{build.SDIST_VERSION}"
        with tarfile.open(sdist) as tar:
            member = tar.getmember(f"{root}/.git/modules/vendor/llama.cpp/HEAD")
            tar.extractall(tmp_path / "sdist", members=[member], filter="data")
        assert build.vendored_commit(tmp_path / "sdist" / root) == build.LLAMA_CPP_COMMIT


def test_every_patch_has_a_header_naming_its_base(build):
    for p in build.patch_series():
        head = p.read_text().split("\ndiff --git", 1)[0]
        assert head.startswith("Subject: [kvrescue ") and "Why:" in head, p.name
        assert f"Applies-to: llama.cpp {build.LLAMA_CPP_COMMIT}" in head, p.name


def test_cache_key_changes_with_the_patch_series(build, tmp_path):
    one = tmp_path / "0001-a.patch"
    one.write_text("a")
    before = build.series_hash([one])
    one.write_text("b")
    assert build.series_hash([one]) != before


def test_help_runs_without_dependencies():
    out = subprocess.run([sys.executable, str(ROOT / "patches" / "build.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--cuda" in out.stdout


def test_the_loaded_build_names_its_backends():
    from kvrescue_local.runtime.lib import backends

    found = dict(backends())
    assert found.get("CPU", 0) >= 1, found
def fake_toolkit(root: Path, *libraries: str) -> Path:
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    nvcc.chmod(0o755)
    (root / "lib64").mkdir()
    for name in libraries:
        (root / "lib64" / f"{name}.so").parent.mkdir(parents=True, exist_ok=True)
        (root / "lib64" / f"{name}.so").touch()
    return root


def test_a_toolkit_with_cublas_and_a_driver_stub_builds_with_plain_flags(build, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "cuda", "libcublas", "stubs/libcuda")))
    assert build.cuda_cmake_args(tmp_path / "cache") == ["-DGGML_CUDA=on"]


def test_a_toolkit_without_cublas_or_driver_gets_pypi_cublas_and_no_vmm(build, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "cuda")))  # no libcuda to link, stub or driver
    lib = tmp_path / "cache" / "cuda-deps" / "cublas-cu13" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublas.so").touch()  # unpacked before: no download
    args = build.cuda_cmake_args(tmp_path / "cache")
    assert f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so'}" in args
    assert f"-DCMAKE_CUDA_FLAGS=-I{lib.parent / 'include'}" in args
    assert args[-1] == "-DGGML_CUDA_NO_VMM=ON"


def test_the_stripped_sdist_has_the_pinned_tree_and_what_the_build_reads(build, tmp_path):
    """Checked against the cached sdist: the kit's source (perf/gpu_check.sh --prepare) is what build.py pins."""
    sdist = build.DEFAULT_CACHE / "sdist" / f"llama_cpp_python-{build.SDIST_VERSION}.tar.gz"
    if not sdist.exists():
        pytest.skip("no cached sdist: run patches/build.py first")
    out = tmp_path / build.KIT_SOURCE
    assert build.strip_sdist(sdist, out) == build.STRIPPED_TREE_SHA256
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
    root = f"llama_cpp_python-{build.SDIST_VERSION}"
    for kept in ("CMakeLists.txt", "pyproject.toml", "llama_cpp/llama_cpp.py", ".git/modules/vendor/llama.cpp/HEAD",
                 "vendor/llama.cpp/src/llama-context.cpp", "vendor/llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu",
                 "vendor/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp", "vendor/llama.cpp/src/models/qwen2.cpp"):
        assert f"{root}/{kept}" in names, kept
    assert not [n for n in names if build.stripped(n.removeprefix(f"{root}/"))]
    assert out.stat().st_size < 8 * 2**20


def test_a_kit_of_another_sdist_or_a_damaged_source_is_refused(build, tmp_path):
    with pytest.raises(build.BuildError, match="prepare the kit first"):
        build.kit_source(tmp_path)
    manifest = {"sdist_sha256": "0" * 64, "tree_sha256": build.STRIPPED_TREE_SHA256, "source": build.KIT_SOURCE}
    (tmp_path / build.KIT_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(build.BuildError, match="another sdist or strip rule"):
        build.kit_source(tmp_path)
    archive = tmp_path / "damaged.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo(f"llama_cpp_python-{build.SDIST_VERSION}/CMakeLists.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(build.BuildError, match="the kit is damaged"):
        build.unpack_source(archive, tmp_path / "src", build.STRIPPED_TREE_SHA256)


def test_an_installed_cublas_wheel_is_linked_and_a_missing_one_is_not_downloaded_offline(build, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "cuda", "libcuda")))
    site = tmp_path / "site"
    monkeypatch.setattr(sys, "path", [str(site)])
    monkeypatch.setattr("site.getsitepackages", lambda: [])
    with pytest.raises(build.BuildError, match="prepare this machine with network first"):
        build.cuda_cmake_args(tmp_path / "cache", offline=True)
    lib, include = site / "nvidia" / "cu13" / "lib", site / "nvidia" / "cu13" / "include"
    for path in (lib / "libcublas.so.13", lib / "libcublasLt.so.13", include / "cublas_v2.h"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    args = build.cuda_cmake_args(tmp_path / "cache", offline=True)
    assert f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so.13'}" in args
    assert f"-DCMAKE_CUDA_FLAGS=-I{include}" in args
    assert lib in build.cuda_library_dirs(tmp_path / "cache")
