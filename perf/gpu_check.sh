#!/usr/bin/env bash
# One prepared check of the CUDA build on a machine with an NVIDIA GPU and no network (docs/gpu-build.md):
# builds the patched wheel for that GPU, runs the patch tests with the models offloaded, and measures the
# figures only a GPU decides, in about 12 minutes on 16 cores.
#
#   perf/gpu_check.sh --prepare   here, with PyPI reachable: fill .gpu-kit/ (the stripped sdist, the build
#                                 backend's wheels, the Python 3.12 wheels the GPU machine lacks); prints its size
#   perf/gpu_check.sh             there, from the repository root, with .gpu-kit/ carried: build, tests, figures
#   perf/gpu_check.sh --dry-run   on a machine with nvcc and no GPU: compile the CUDA wheel, install it, collect
#                                 the GPU tests and smoke-run the figures on its CPU fallback
#   --steps build,tests,figures   run only these steps (default: all three); run again after a call that ran
#                                 out of time: the build resumes where it stopped, a built wheel is reused
#
# Everything it prints also goes under $OUT/ (default .gpu-build/out): gpu_check.log (all of it), build.log,
# tests.log, figures.log, table.txt. .gpu-build/ (not carried) keeps the build folder, the wheel cache and the
# installed target between calls.
set -euo pipefail
cd "$(dirname "$0")/.."

KIT=.gpu-kit
WORK=.gpu-build
PYTHON=${PYTHON:-python3}
GPU_PYTHON=3.12  # the lent GPU machine's Python: the kit's wheels are for it
WHEEL_TAGS=(--python-version "$GPU_PYTHON" --implementation cp --abi cp312
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform linux_x86_64
            --only-binary=:all:)
TRAVEL_LIMIT_MIB=64  # what travels to the GPU machine: the working tree and the carried kit
GPU_TESTS=(tests/test_symbols.py tests/test_gpu.py tests/test_attention.py tests/test_per_head.py
           tests/test_eviction.py tests/test_runtime.py)
ALL_STEPS=build,tests,figures
DRY_RUN_ARCH=90  # compiled for in a dry run, where no GPU names its own: the H200's (compute capability 9.0)

die() { echo "Error: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
elapsed() { echo $(( $(date +%s) - $1 )); }
mib() { echo $(( ($1 + 1048575) / 1048576 )); }

parse_args() {
    mode=gpu steps=$ALL_STEPS
    while [ $# -gt 0 ]; do
        case $1 in
            --prepare) mode=prepare ;;
            --dry-run) mode=dry-run ;;
            --steps) [ $# -ge 2 ] || die "--steps needs a list, e.g. --steps $ALL_STEPS"; steps=$2; shift ;;
            --steps=*) steps=${1#--steps=} ;;
            -h|--help) usage; exit 0 ;;
            *) die "unknown option $1: use --prepare, --dry-run or --steps $ALL_STEPS (--help)" ;;
        esac
        shift
    done
    for step in ${steps//,/ }; do
        case ,$ALL_STEPS, in *,$step,*) ;; *) die "unknown step '$step' in --steps: choose from $ALL_STEPS" ;; esac
    done
}
wants() { case ,$steps, in *,$1,*) return 0 ;; *) return 1 ;; esac; }

find_nvcc() {
    command -v nvcc >/dev/null && return 0
    for root in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
        if [ -n "$root" ] && [ -x "$root/bin/nvcc" ]; then export PATH="$root/bin:$PATH"; return 0; fi
    done
    return 1
}

prepare() {
    local started cuda=() kit tree
    started=$(date +%s)
    # with nvcc here, the dry run's CUDA build gets what it needs too (cuBLAS where the toolkit lacks it)
    find_nvcc && cuda=(--cuda)
    "$PYTHON" patches/build.py --prepare-kit "$KIT" "${cuda[@]}"
    rm -rf "$KIT/wheels"
    "$PYTHON" -m pip download --quiet --no-deps "${WHEEL_TAGS[@]}" -d "$KIT/wheels" -r perf/gpu_wheels.txt \
        || die "could not download the wheels of perf/gpu_wheels.txt: check that PyPI is reachable"
    kit=$(du -sb "$KIT" | cut -f1)
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    echo "kit: $KIT holds $(mib "$kit") MiB ($(ls "$KIT/wheels" | wc -l) wheels); with the working tree" \
         "($(mib "$tree") MiB) $(mib $((kit + tree))) MiB travel, of $TRAVEL_LIMIT_MIB"
    [ $((kit + tree)) -le $((TRAVEL_LIMIT_MIB * 1048576)) ] \
        || die "the kit and the working tree exceed $TRAVEL_LIMIT_MIB MiB: trim the tree or perf/gpu_wheels.txt"
    echo "prepared in $(elapsed "$started") s"
}

# The machine that builds, the GPU one or a dry run's: nvcc, a GPU (not in a dry run), the kit, Python.
check_machine() {
    find_nvcc || die "no nvcc found: install the CUDA toolkit or put its bin/ on PATH (CUDA_HOME)"
    if [ "$mode" = dry-run ]; then
        arch=$DRY_RUN_ARCH gpu="none (dry run)"
    else
        gpu=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | head -1) && [ -n "$gpu" ] \
            || die "no NVIDIA GPU found (nvidia-smi): on a machine without one run perf/gpu_check.sh --dry-run"
        arch=${gpu##*, } arch=${arch//./}
    fi
    [ -f "$KIT/source.json" ] || die "no kit in $KIT: run perf/gpu_check.sh --prepare where PyPI is reachable, and carry $KIT"
    if [ "$mode" = gpu ]; then
        local version
        version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        [ "$version" = "$GPU_PYTHON" ] || die "$PYTHON is Python $version, the kit's wheels are for $GPU_PYTHON: set PYTHON"
    fi
}

step_build() {
    local started wheel
    started=$(date +%s)
    echo "== build: the patched wheel, -DGGML_CUDA=on for architecture $arch, $cores jobs"
    CMAKE_BUILD_PARALLEL_LEVEL=$cores CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$arch" \
        "${nice[@]}" "${build[@]}" --wheel-only --verbose 2>&1 | tee "$OUT/build.log" \
        | { grep -E '^(\[kvrescue build\]|error:)' || true; } || die "the build failed: see the end of $OUT/build.log"
    wheel=$(tail -1 "$OUT/build.log")
    rm -rf "$site"
    "$PYTHON" -m pip install --quiet --no-index --no-deps "${WHEEL_TAGS[@]}" --target "$site" "$KIT"/wheels/*.whl "$wheel" \
        2>&1 | tee -a "$OUT/build.log" || die "pip could not install the wheels into $site: see $OUT/build.log"
    echo "build: $(elapsed "$started") s for $(basename "$wheel") ($(du -m "$wheel" | cut -f1) MiB), installed with" \
         "$(ls "$KIT"/wheels/*.whl | wc -l) carried wheels into $site"
}

step_tests() {
    local started
    started=$(date +%s)
    echo "== tests: the patch ops with the models offloaded (-ngl 99), CPU against GPU parity"
    "${nice[@]}" "$PYTHON" cli.py doctor --n-gpu-layers 99 2>&1 | tee "$OUT/tests.log" || echo "doctor: FAILED"
    if [ "$mode" = dry-run ]; then
        "${nice[@]}" "$PYTHON" -m pytest -p no:cacheprovider --collect-only -q "${GPU_TESTS[@]}" 2>&1 \
            | tee -a "$OUT/tests.log" | tail -3 || echo "tests: collection FAILED (see $OUT/tests.log)"
        echo "skipped (dry run): running the GPU tests needs a GPU"
    else
        "$PYTHON" -m pytest -p no:cacheprovider -q -rs "${GPU_TESTS[@]}" 2>&1 | tee -a "$OUT/tests.log" \
            || echo "tests: FAILED (see $OUT/tests.log)"
    fi
    echo "tests: $(elapsed "$started") s"
}

step_figures() {
    local started
    started=$(date +%s)
    if [ "$mode" = dry-run ]; then
        echo "== figures: skipped (dry run): they measure a GPU; a smoke run on the CPU fallback checks the script"
        "${nice[@]}" "$PYTHON" perf/gpu_figures.py --n-gpu-layers 0 --steps 4 --tokens 40 --problems 2 2>&1 \
            | tee "$OUT/figures.log" || echo "figures: FAILED (see $OUT/figures.log)"
    else
        echo "== figures: ratios measured side by side on the toy models, -ngl 99"
        "$PYTHON" perf/gpu_figures.py --n-gpu-layers 99 --table "$OUT/table.txt" 2>&1 | tee "$OUT/figures.log" \
            || echo "figures: FAILED (see $OUT/figures.log)"
    fi
    echo "figures: $(elapsed "$started") s"
}

main() {
    parse_args "$@"
    if [ "$mode" = prepare ]; then
        prepare
        return
    fi
    check_machine
    # every core, counted before OMP_NUM_THREADS (which nproc obeys) is set for a dry run
    cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    export OUT=${OUT:-$WORK/out}
    mkdir -p "$OUT" "$WORK"
    exec > >(tee -a "$OUT/gpu_check.log") 2>&1
    local started
    started=$(date +%s)
    echo "gpu_check ($mode, steps $steps) on $(uname -n), $cores cores, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "nvcc: $(nvcc --version | tail -1); GPU: $gpu (CUDA architecture $arch)"
    if [ "$mode" = dry-run ]; then
        cache=()  # the wheel cache of this machine: a dry run reuses a wheel built before
        nice=(nice -n 19)
        export KVRESCUE_THREADS=${KVRESCUE_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    else
        cache=(--cache-dir "$WORK/cache")
        nice=()
    fi
    site=$WORK/site
    build=("$PYTHON" patches/build.py --cuda --kit "$KIT" --build-dir "$WORK/build" "${cache[@]}")
    if wants build; then step_build; fi
    [ -d "$site/llama_cpp/lib" ] || die "nothing installed in $site: run the build step first (--steps build)"
    local cuda_libs
    cuda_libs=$(CMAKE_ARGS= "${build[@]}" --cuda-lib-path)
    export LD_LIBRARY_PATH=$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    if [ "$mode" = dry-run ]; then
        # this machine's Python is not the kit's 3.12: its own packages, the built library by path
        export PYTHONPATH=$PWD LLAMA_CPP_LIB_PATH=$PWD/$site/llama_cpp/lib
    else
        export PYTHONPATH=$PWD:$PWD/$site
    fi
    export KVRESCUE_TEST_NGL=99  # tests/conftest.py: every test model offloaded
    if wants tests; then step_tests; fi
    if wants figures; then step_figures; fi
    echo "gpu_check ($mode): done in $(elapsed "$started") s; logs in $OUT/"
}

# all of it is read before it runs: editing this file during a run does not change that run
main "$@"; exit $?
