"""patches/build.py refuses what it must refuse, without building anything."""

import hashlib
import importlib.util
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


def test_a_patch_that_does_not_apply_is_named(build, tmp_path):
    vendor = tmp_path / "vendor"
    (vendor / "include").mkdir(parents=True)
    (vendor / "include" / "llama.h").write_text("something else entirely\n")
    with pytest.raises(build.BuildError, match="0001-cell-map.patch does not apply"):
        build.apply_patches(vendor, build.patch_series())


def test_the_series_applies_to_the_pinned_sdist(build, tmp_path):
    """Checked against the sdist in the build cache (present after the README's set-up)."""
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
        tar.extractall(tmp_path, members=members, filter="data")
    build.apply_patches(tmp_path / root / "vendor" / "llama.cpp", build.patch_series())


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
        (root / "lib64" / f"{name}.so").touch()
    return root


def test_a_toolkit_with_cublas_and_a_driver_builds_with_plain_flags(build, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "cuda", "libcublas")))
    monkeypatch.setattr(build, "find_library", lambda name: "libcuda.so.1")
    assert build.cuda_cmake_args(tmp_path / "cache") == ["-DGGML_CUDA=on"]


def test_a_toolkit_without_cublas_or_driver_gets_pypi_cublas_and_no_vmm(build, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "cuda")))
    monkeypatch.setattr(build, "find_library", lambda name: None)  # no driver installed
    lib = tmp_path / "cache" / "cuda-deps" / "cublas-cu13" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublas.so").touch()  # unpacked before: no download
    args = build.cuda_cmake_args(tmp_path / "cache")
    assert f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so'}" in args
    assert f"-DCMAKE_CUDA_FLAGS=-I{lib.parent / 'include'}" in args
    assert args[-1] == "-DGGML_CUDA_NO_VMM=ON"
