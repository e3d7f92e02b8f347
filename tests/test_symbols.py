"""What this build's libraries export, and where the libstdc++ calls made while a model loads bind.

The first CUDA build run on a GPU exported libstdc++ code from libggml-cuda.so (std::ostream::_M_insert<long>,
named in the crash's backtrace), and libstdc++'s own call to it (std::ostream::operator<<(int) jumps there
through libstdc++'s PLT) went to that copy: every model load crashed in llama_model::print_info. Patch 0006
links libggml-cuda with a version script. These tests check the installed build (on a GPU machine, the CUDA one:
perf/gpu_check.sh runs them) and, with stand-in libraries compiled here, that each check finds what it looks for.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvrescue_local.runtime.lib import library_path, llama

ROOT = Path(__file__).resolve().parents[1]
M_INSERT_LONG = "_ZNSo9_M_insertIlEERSoT_"  # std::ostream::_M_insert<long>, what libggml-cuda served
M_INSERT_UNSIGNED_LONG = "_ZNSo9_M_insertImEERSoT_"  # std::ostream::_M_insert<unsigned long>, which libllama calls
# a copy of it, as a library linked beside libllama may carry one: harmless, or crashing like the one on the GPU
HARMLESS_COPY = f"void *{M_INSERT_LONG}(void *stream, long value) {{ (void)value; return stream; }}\n"
CRASHING_COPY = ("#include <signal.h>\n"
                 f"void *{M_INSERT_LONG}(void *stream, long value) {{ (void)value; raise(SIGSEGV); return stream; }}\n")
# `binding file A [0] to B [0]: normal symbol `S' [GLIBCXX_3.4.9]` (LD_DEBUG=bindings): a libstdc++ symbol's binding
BINDING = re.compile(r"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: normal symbol `([^']+)' \[(?:GLIBCXX|CXXABI)_")
# what every command does: the package imported first (numpy before llama.cpp), then a model loaded
LOAD_A_MODEL = "import sys; from kvrescue_local.runtime import Model; Model(sys.argv[1])"

needs_a_compiler = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to compile the stand-in libraries")


def libstdcxx() -> Path:
    """The libstdc++ this process loaded with libllama."""
    llama()
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "/libstdc++.so" in line}
    assert len(mapped) == 1, mapped
    return Path(mapped.pop())


def exported(library: Path) -> set[str]:
    """The symbols library defines in its dynamic symbol table (what other libraries can bind to)."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    return {fields[2].split("@")[0] for fields in map(str.split, out.stdout.splitlines()) if len(fields) == 3}


def compile_library(tmp_path: Path, name: str, source: str) -> Path:
    (tmp_path / f"{name}.c").write_text(source)
    library = tmp_path / f"lib{name}.so"
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-o", str(library), str(tmp_path / f"{name}.c")], check=True)
    return library


def misbound_libstdcxx_symbols(model: Path, preload: Path | None = None) -> list[str]:
    """'A -> B: symbol' for each libstdc++ symbol that a process loading model bound to a llama.cpp library, or that
    a llama.cpp library bound to anything but libstdc++ (LD_DEBUG=bindings). Not flagged: libstdc++'s own
    references served by the library that loaded it first (numpy's extension exports std::exception's typeinfo,
    and libstdc++ takes it from there), the same code, and no library of this build."""
    env = {**os.environ, "LD_DEBUG": "bindings"}
    if preload is not None:
        env["LD_PRELOAD"] = str(preload)
    run = subprocess.run([sys.executable, "-c", LOAD_A_MODEL, str(model)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = {path.name for path in Path(library_path()).parent.glob("lib*.so*")}
    return sorted({f"{Path(source).name} -> {Path(target).name}: {symbol}"
                   for source, target, symbol in BINDING.findall(run.stderr)
                   if Path(target).name in ours or Path(source).name in ours and "libstdc++" not in target})


@needs_a_compiler
@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake to configure the stand-in library")
def test_patch_0006_makes_the_cuda_library_export_its_ggml_api_only(tmp_path):
    """The patch's CMake lines, on a stand-in libggml-cuda whose code carries a copy of _M_insert<long>: without
    them it exports the copy, with them only its ggml_ function."""
    patch = (ROOT / "patches" / "0006-cuda-exports-ggml-only.patch").read_text().splitlines()
    added = [line[1:] for line in patch if line.startswith("+") and not line.startswith("+++")]
    (tmp_path / "standin.c").write_text(HARMLESS_COPY + "int ggml_standin(void) { return 1; }\n")
    exports = []
    for lines in ([], added):
        project = tmp_path / f"project-{len(lines)}"
        project.mkdir()
        (project / "CMakeLists.txt").write_text("\n".join(["cmake_minimum_required(VERSION 3.18)", "project(standin C)",
                                                           f"add_library(ggml-cuda SHARED {tmp_path / 'standin.c'})",
                                                           *lines]) + "\n")
        for step in (["-S", str(project), "-B", str(project / "build")], ["--build", str(project / "build")]):
            subprocess.run(["cmake", *step], check=True, capture_output=True)
        exports.append(exported(project / "build" / "libggml-cuda.so"))
    unpatched, patched = exports
    assert M_INSERT_LONG in exported(libstdcxx()) and M_INSERT_LONG in unpatched
    assert patched == {"ggml_standin"}


def test_no_ggml_library_of_this_build_exports_a_symbol_libstdcxx_defines():
    """Such a copy can serve libstdc++'s or libllama's calls in place of libstdc++'s own (as libggml-cuda's did)."""
    ours = libstdcxx()
    own = exported(ours)
    libraries = sorted({path.resolve() for path in Path(library_path()).parent.glob("libggml*.so*")})
    assert libraries
    clashes = {library.name: sorted(exported(library) & own)[:5] for library in libraries}
    assert {name: symbols for name, symbols in clashes.items() if symbols} == {}


@needs_a_compiler
def test_the_libstdcxx_calls_of_a_model_load_bind_to_libstdcxx(base_path, tmp_path):
    assert misbound_libstdcxx_symbols(base_path) == []
    # a copy ahead of libstdc++ where libllama's calls look (here: preloaded) is found
    copy = compile_library(tmp_path, "copy", HARMLESS_COPY.replace(M_INSERT_LONG, M_INSERT_UNSIGNED_LONG))
    assert misbound_libstdcxx_symbols(base_path, preload=copy) == [f"libllama.so -> {copy.name}: {M_INSERT_UNSIGNED_LONG}"]


@needs_a_compiler
def test_doctor_names_the_device_whose_model_load_crashes(tmp_path):
    """A build whose libstdc++ calls go to a broken copy, as the first CUDA build's did: one Error line naming the
    device and the signal, before any command, instead of a segfault."""
    copy = compile_library(tmp_path, "copy", CRASHING_COPY)
    run = subprocess.run([sys.executable, "-m", "kvrescue_local", "doctor"], env={**os.environ, "LD_PRELOAD": str(copy)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"Error: loading a model on CPU crashed (signal {int(signal.SIGSEGV)}, SIGSEGV)"), run.stderr


def test_ctypes_reaches_the_loaded_ggml_libraries_not_second_copies():
    """A wheel holds libggml.so, .so.0 and .so.0.x.y as separate files: opening another name than the one libllama
    loaded maps a second copy, with a backend registry and an abort callback of its own."""
    code = ("from kvrescue_local.runtime.lib import ggml, ggml_base; ggml(); ggml_base(); "
            "maps = open('/proc/self/maps').read().splitlines(); "
            "print('\\n'.join(sorted({line.split()[-1] for line in maps if '/libggml' in line})))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    mapped = [Path(line).name.split(".so")[0] for line in run.stdout.split()]
    assert sorted(mapped) == sorted(set(mapped)) and {"libggml", "libggml-base"} <= set(mapped), run.stdout
