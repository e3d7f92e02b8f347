#!/usr/bin/env bash
# One-command set-up into the active Python (a venv's once activated): the patched llama.cpp
# (llama-cpp-python, built from the pinned, hash-checked sdist, cached by sdist + patch series +
# build flags + Python/platform), then this package in editable mode with the dev extras.
# Arguments go to patches/build.py (--cuda for the CUDA backend; CMAKE_ARGS passes through). The RPC backend is
# always built (one more source file): `--rpc` and `rpc-server` work, and CI runs the RPC tests.
set -euo pipefail
cd "$(dirname "$0")"
python3 patches/build.py --rpc "$@"
python3 -m pip install --quiet -e '.[dev]'
echo "set-up done: try \`kvrescue-local doctor\`"
