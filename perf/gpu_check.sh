#!/usr/bin/env bash
# One prepared check of the CUDA build on a machine with an NVIDIA GPU and no network (docs/gpu-build.md), in
# one run of at most 10 minutes, build included: builds the patched wheel for that GPU, writes models of the coder
# pair's shapes, runs the GPU tests with the models offloaded, and prints one table of what only a GPU decides.
#
#   perf/gpu_check.sh --prepare   here, with PyPI reachable: fill .gpu-kit/ (the stripped sdist, the build
#                                 backend's wheels, the Python 3.12 wheels the GPU machine lacks); prints what
#                                 travels, the checkout and the kit, and refuses more than 64 MiB
#   perf/gpu_check.sh             there, from the repository root, with .gpu-kit/ carried
#   perf/gpu_check.sh --dry-run   anywhere, offline: the same stages on the CPU with tiny settings (this Python's
#                                 llama.cpp, no CUDA build, tiny models, the GPU tests collected, not run)
#   --steps build,models,tests,figures   run only these steps (default: all); after a call that ran out of time,
#                                 the build resumes where it stopped and a built wheel is reused
#
# Every stage logs to its own file under $OUT (default .gpu-build/out): gpu_check.log (all it prints), build.log,
# models.log, tests.log, figures.log, and the table as table.txt and table.json. A stage that fails or outruns
# its own time limit does not stop the later ones, and the table is printed whatever came of them; the exit
# status says whether every stage passed.
set -uo pipefail  # no -e: a failing stage must not stop the later ones
cd "$(dirname "$0")/.."

KIT=.gpu-kit
WORK=$(realpath -m "${GPU_CHECK_WORK:-.gpu-build}")  # the build folder, wheel cache, installed target, models (not carried)
PYTHON=${PYTHON:-python3}
GPU_PYTHON=3.12  # the lent GPU machine's Python: the kit's wheels are for it
WHEEL_TAGS=(--python-version "$GPU_PYTHON" --implementation cp --abi cp312
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform linux_x86_64
            --only-binary=:all:)
TRAVEL_LIMIT_MIB=64  # what travels to the GPU machine: the checkout and the carried kit
KIT_MIB=18  # the most the kit may hold: --prepare refuses a larger one, tests/test_gpu_check.py adds it to the checkout
RUN_SECONDS=570  # the whole run: a device call's 600 s, less a margin for bringing $OUT back (GPU_CHECK_SECONDS)
# each stage's own time limit (s); a stage gets less where the run's time is short, and the table always comes.
# A dry run's limits are DRY_RUN_SCALE times these: a shared CPU is slow, and it measures nothing.
DRY_RUN_SCALE=4
BUILD_LIMIT=330 MODELS_LIMIT=240 PROBE_LIMIT=60 TESTS_LIMIT=120 TABLE_RESERVE=15
FIGURES=("decode 45" "eviction-off 110" "eviction-on 110" "toy 75")  # part and its limit, in the order they run
GPU_TESTS=(tests/test_symbols.py tests/test_gpu.py tests/test_per_head.py tests/test_attention.py tests/test_eviction.py
           tests/test_runtime.py)  # with KVRESCUE_TEST_NGL=99; test files marked `gpu` join them
ALL_STEPS=build,models,tests,figures
BUILD_LOG_MIB=15  # the device brings back files of at most 16 MiB: a longer build log keeps its head and tail

die() { echo "Error: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
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

# Seconds a stage may run: its own limit, cut to what the run has left before the table.
seconds_for() {
    local limit=$(( $1 * scale )) left=$(( deadline - $(date +%s) - TABLE_RESERVE ))
    [ "$left" -lt "$limit" ] && echo $(( left > 5 ? left : 5 )) || echo "$limit"
}
# Run a stage's command under its time limit; prints how it ended, returns its status (124: out of time).
limited() {
    local seconds=$1 rc
    shift
    timeout -k 10 "$seconds" "$@"
    rc=$?
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "   (stopped at its limit of $seconds s)"
    return $rc
}

find_nvcc() {
    command -v nvcc >/dev/null && return 0
    for root in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
        if [ -n "$root" ] && [ -x "$root/bin/nvcc" ]; then export PATH="$root/bin:$PATH"; return 0; fi
    done
    return 1
}

# What travels to the GPU machine: the checkout (tracked files and untracked ones git does not ignore) and the kit.
checkout_bytes() {
    git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1
}

prepare() {
    local started kit tree
    started=$(date +%s)
    "$PYTHON" patches/build.py --prepare-kit "$KIT" || die "could not prepare the kit's source and build wheels"
    rm -rf "$KIT/wheels"
    "$PYTHON" -m pip download --quiet --no-deps "${WHEEL_TAGS[@]}" -d "$KIT/wheels" -r perf/gpu_wheels.txt \
        || die "could not download the wheels of perf/gpu_wheels.txt: check that PyPI is reachable"
    kit=$(du -sb "$KIT" | cut -f1)
    tree=$(checkout_bytes)
    echo "kit: $KIT holds $(mib "$kit") MiB ($(ls "$KIT/wheels" | wc -l) wheels); with the checkout" \
         "($(mib "$tree") MiB) $(mib $((kit + tree))) MiB travel, of $TRAVEL_LIMIT_MIB"
    [ "$kit" -le $((KIT_MIB * 1048576)) ] \
        || die "the kit holds more than KIT_MIB ($KIT_MIB MiB): trim perf/gpu_wheels.txt, or raise KIT_MIB in $0 if it still fits"
    [ $((kit + tree)) -le $((TRAVEL_LIMIT_MIB * 1048576)) ] \
        || die "the kit and the checkout exceed $TRAVEL_LIMIT_MIB MiB: trim the checkout (results are committed as .jsonl.zst) or perf/gpu_wheels.txt"
    echo "prepared in $(elapsed "$started") s"
}

# The GPU machine: nvcc, a GPU, the kit, Python 3.12. A dry run needs none of them.
check_machine() {
    if [ "$mode" = dry-run ]; then
        arch=none gpu="none (dry run)"
        return
    fi
    find_nvcc || die "no nvcc found: install the CUDA toolkit or put its bin/ on PATH (CUDA_HOME)"
    gpu=$(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null | head -1) \
        && [ -n "$gpu" ] || die "no NVIDIA GPU found (nvidia-smi): on a machine without one run perf/gpu_check.sh --dry-run"
    arch=$(echo "$gpu" | cut -d, -f2 | tr -d ' .')
    [ -f "$KIT/source.json" ] || die "no kit in $KIT: run perf/gpu_check.sh --prepare where PyPI is reachable, and carry $KIT"
    local version
    version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$version" = "$GPU_PYTHON" ] || die "$PYTHON is Python $version, the kit's wheels are for $GPU_PYTHON: set PYTHON"
}

# pip's cmake and ninja are Python shims that a build-isolated pip cannot import: the binaries their packages hold
# (cmake's data/bin, ninja's BIN_DIR) go first on PATH, linked from a folder of their own (a package's folder can
# hold other shims).
real_build_tools() {
    local tool binary
    mkdir -p "$WORK/tools"
    for tool in cmake ninja; do
        binary=$("$PYTHON" - "$tool" 2>/dev/null <<'PY'
import importlib, os, sys
tool = sys.argv[1]
package = importlib.import_module(tool)
for folder in (getattr(package, "CMAKE_BIN_DIR", ""), getattr(package, "BIN_DIR", ""),
               os.path.join(os.path.dirname(package.__file__), "data", "bin")):
    path = os.path.join(folder, tool)
    if folder and os.path.isfile(path) and os.access(path, os.X_OK):
        print(path)
        break
PY
)
        if [ -n "$binary" ]; then
            ln -sf "$binary" "$WORK/tools/$tool"
            echo "$tool: $binary (the binary of pip's $tool package), $("$binary" --version | head -1)"
        else
            rm -f "$WORK/tools/$tool"
            echo "$tool: $(command -v $tool || echo 'not found') (no pip package with a binary)"
        fi
    done
    export PATH="$WORK/tools:$PATH"
    echo "on PATH: $(cmake --version 2>&1 | head -1), ninja $(ninja --version 2>&1 | head -1)"
}

step_build() {
    local started wheel seconds
    started=$(date +%s)
    if [ "$mode" = dry-run ]; then
        echo "== build: skipped (dry run): the CUDA build runs on the GPU machine; this run uses $PYTHON's llama.cpp"
        real_build_tools
        return
    fi
    echo "== build: the patched wheel, -DGGML_CUDA=on for architecture $arch, $cores jobs"
    real_build_tools
    seconds=$(seconds_for $BUILD_LIMIT)
    CMAKE_BUILD_PARALLEL_LEVEL=$cores CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$arch" \
        limited "$seconds" "${build[@]}" --wheel-only --verbose >>"$OUT/build.log" 2>&1
    local rc=$?
    trim_build_log
    wheel=$(tail -1 "$OUT/build.log")
    if [ $rc -ne 0 ] || [ ! -f "$wheel" ]; then
        build_note="failed after $(elapsed "$started") s (rc $rc; see build.log)" failed+=(build)
        echo "build: FAILED after $(elapsed "$started") s (rc $rc); the end of $OUT/build.log:"
        tail -15 "$OUT/build.log"
        return
    fi
    "$PYTHON" -m pip install --quiet --no-index --no-deps "${WHEEL_TAGS[@]}" --target "$site" --upgrade "$wheel" \
        >>"$OUT/build.log" 2>&1 || { echo "build: pip could not install $wheel into $site (see build.log)"; failed+=(build); }
    build_note="$(elapsed "$started") s, $(basename "$wheel") ($(du -m "$wheel" | cut -f1) MiB)"
    echo "build: $build_note"
}

trim_build_log() {
    local log=$OUT/build.log
    [ "$(stat -c %s "$log")" -le $((BUILD_LOG_MIB * 1048576)) ] && return
    { head -c 1048576 "$log"; echo; echo "[... cut: the device brings back $BUILD_LOG_MIB MiB at most ...]"
      tail -c $(((BUILD_LOG_MIB - 2) * 1048576)) "$log"; } >"$log.cut" && mv "$log.cut" "$log"
}

# The carried wheels (what the package imports that the machine lacks), before the build: the models need gguf.
install_carried_wheels() {
    [ "$mode" = dry-run ] && return
    mkdir -p "$site"
    "$PYTHON" -m pip install --quiet --no-index --no-deps "${WHEEL_TAGS[@]}" --target "$site" --upgrade \
        "$KIT"/wheels/*.whl >"$OUT/build.log" 2>&1 \
        && echo "installed $(ls "$KIT"/wheels/*.whl | wc -l) carried wheels into $site" \
        || { echo "pip could not install the carried wheels into $site (see build.log)"; failed+=(wheels); }
}

# Models of the coder pair's shapes, written beside the build (they need no llama.cpp).
start_models() {
    local tiny=()
    [ "$mode" = dry-run ] && tiny=(--tiny)
    echo "== models: the coder pair's shapes, random F16 weights$([ "$mode" = dry-run ] && echo ' (tiny, dry run)'), into $WORK/models"
    rm -rf "$WORK/models"
    mkdir -p "$WORK/models"
    limited "$(seconds_for $MODELS_LIMIT)" "$PYTHON" perf/gpu_models.py "$WORK/models" "${tiny[@]}" >"$OUT/models.log" 2>&1 &
    models_pid=$!
}
wait_models() {
    wait "$models_pid"
    local rc=$?
    cat "$OUT/models.log"
    [ $rc -eq 0 ] || { echo "models: FAILED (rc $rc, see models.log)"; failed+=(models); }
}

# Whether a model loads on the build; where it crashes without it, the system libstdc++ preloaded (and said so).
probe_loading() {
    echo "== doctor: -ngl 99"
    limited "$(seconds_for $PROBE_LIMIT)" "$PYTHON" cli.py doctor --n-gpu-layers 99 2>&1
    local rc=$? libstdcxx
    load_note="doctor rc $rc"
    [ $rc -eq 0 ] && load_note="a model loads (doctor passed)"
    if [ $rc -gt 128 ] && [ $rc -ne 137 ]; then
        libstdcxx=$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
        echo "doctor died of signal $((rc - 128)); again with LD_PRELOAD=${libstdcxx:-?} (the load crash's workaround)"
        if [ -n "$libstdcxx" ] && LD_PRELOAD=$libstdcxx limited "$(seconds_for $PROBE_LIMIT)" \
                "$PYTHON" cli.py doctor --n-gpu-layers 99 >/dev/null 2>&1; then
            export LD_PRELOAD=$libstdcxx
            load_note="CRASHES without LD_PRELOAD=$libstdcxx (signal $((rc - 128))): tests and figures ran with it"
        else
            load_note="crashes (signal $((rc - 128))), with LD_PRELOAD too"
        fi
    fi
    [ $rc -eq 0 ] || failed+=(doctor)
    echo "loading: $load_note"
}

step_tests() {
    local started files=() extra parallel=()
    started=$(date +%s)
    for f in "${GPU_TESTS[@]}"; do [ -f "$f" ] && files+=("$f"); done
    for extra in $(grep -l -E 'pytest\.mark\.gpu\b' tests/test_*.py 2>/dev/null); do
        case " ${files[*]} " in *" $extra "*) ;; *) files+=("$extra") ;; esac
    done
    if [ "$mode" = dry-run ]; then
        echo "== tests: collected, not run (dry run): ${files[*]}"
        limited "$(seconds_for $TESTS_LIMIT)" "$PYTHON" -m pytest -p no:cacheprovider --collect-only -q "${files[@]}" \
            >"$OUT/tests.log" 2>&1
    else
        # one worker's crash (a segfault in llama.cpp) then fails its test, not the whole run
        "$PYTHON" -c "import xdist" 2>/dev/null && parallel=(-n 8)
        echo "== tests: ${files[*]} with every test model offloaded (KVRESCUE_TEST_NGL=99) ${parallel[*]}"
        KVRESCUE_TEST_NGL=99 limited "$(seconds_for $TESTS_LIMIT)" "$PYTHON" -m pytest -p no:cacheprovider -q -rfEs \
            "${parallel[@]}" "${files[@]}" >"$OUT/tests.log" 2>&1
    fi
    local rc=$?
    [ $rc -eq 0 ] || failed+=(tests)
    tests_note=$(grep -E '[0-9]+ (passed|failed|error|tests? collected|skipped)' "$OUT/tests.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
    tests_note="${tests_note:-no summary} (rc $rc, $(elapsed "$started") s)"
    grep -E '^(FAILED|ERROR)' "$OUT/tests.log" | head -20
    echo "tests: $tests_note"
}

step_figures() {
    local rows=$WORK/rows.jsonl part seconds rc settings=()
    rm -f "$rows"
    if [ "$mode" = dry-run ]; then
        settings=(--n-gpu-layers 0 --steps 4 --tokens 200 --problems 2)
    else
        settings=(--n-gpu-layers 99)
    fi
    : >"$OUT/figures.log"
    for entry in "${FIGURES[@]}"; do
        set -- $entry
        part=$1 seconds=$(seconds_for "$2")
        local options=(--part "${part%%-*}" --rows "$rows" --base "$WORK/models/base.gguf"
                       --helper "$WORK/models/helper.gguf" "${settings[@]}")
        case $part in eviction-*) options+=(--flash-attn "${part#eviction-}") ;; esac
        echo "== figures: $part (at most $seconds s)"
        limited "$seconds" "$PYTHON" perf/gpu_figures.py "${options[@]}" 2>&1 | tee -a "$OUT/figures.log" \
            | grep -E '^  |stopped at|Error'
        rc=${PIPESTATUS[0]}
        if [ "$rc" -ne 0 ]; then
            local why="rc $rc"
            [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="stopped at its limit of $seconds s"
            [ "$rc" -gt 128 ] && [ "$rc" -ne 137 ] && why="died of signal $((rc - 128))"
            "$PYTHON" perf/gpu_figures.py --failed "${part%%-*}" --reason "$part: $why (figures.log)" --rows "$rows"
            failed+=("$part")
        fi
    done
}

render_table() {
    local commit
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo "no git")
    echo "== table"
    "$PYTHON" perf/gpu_figures.py --render --rows "$WORK/rows.jsonl" --table "$OUT/table.txt" --json "$OUT/table.json" \
        --meta "run=$mode on $(uname -n), $cores cores, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $commit" \
        --meta "gpu=$gpu" --meta "build=$build_note" --meta "loading=$load_note" --meta "tests=$tests_note" \
        --meta "models=$(grep -h -o '^[a-z]*: [^ ]*gguf ([^;]*; [^)]*)' "$OUT/models.log" 2>/dev/null | tr '\n' ' ' | sed 's/ *$//')"
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
    local started log_pid=$! rc=0
    started=$(date +%s)
    scale=1
    [ "$mode" = dry-run ] && scale=$DRY_RUN_SCALE
    deadline=$((started + ${GPU_CHECK_SECONDS:-$((RUN_SECONDS * scale))}))
    build_note="not run" load_note="not probed" tests_note="not run" models_pid="" failed=()
    echo "gpu_check ($mode, steps $steps, $((deadline - started)) s in all) on $(uname -n), $cores cores, $(date -u '+%Y-%m-%d %H:%M UTC')"
    site=$WORK/site
    if [ "$mode" = dry-run ]; then
        export KVRESCUE_THREADS=${KVRESCUE_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
        export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "nvcc: $(nvcc --version | tail -1); GPU: $gpu (CUDA architecture $arch)"
        build=("$PYTHON" patches/build.py --cuda --kit "$KIT" --build-dir "$WORK/build" --cache-dir "$WORK/cache")
        export PYTHONPATH=$PWD:$site
        if wants build; then install_carried_wheels; fi
    fi
    if wants models; then start_models; fi
    if wants build; then step_build; fi
    if [ -n "$models_pid" ]; then wait_models; fi
    if [ "$mode" = gpu ]; then
        [ -d "$site/llama_cpp/lib" ] || echo "nothing is installed in $site: the tests and figures will fail (build first)"
        local cuda_libs
        cuda_libs=$(CMAKE_ARGS= "${build[@]}" --cuda-lib-path) && export LD_LIBRARY_PATH=$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    if wants tests || wants figures; then probe_loading; fi
    if wants tests; then step_tests; fi
    if wants figures; then step_figures; fi
    render_table
    [ -s "$OUT/table.txt" ] || failed+=(table)
    echo "gpu_check ($mode): done in $(elapsed "$started") s; logs in $OUT/"
    [ ${#failed[@]} -eq 0 ] || { echo "gpu_check ($mode): FAILED: ${failed[*]}"; rc=1; }
    exec >&- 2>&-
    wait "$log_pid"  # gpu_check.log complete before the device collects $OUT
    return $rc
}

# all of it is read before it runs: editing this file during a run does not change that run
main "$@"; exit $?
