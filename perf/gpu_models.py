#!/usr/bin/env python3
"""Models of the coder pair's real shapes, random F16 weights and the byte vocabulary, for a machine the real
GGUFs cannot travel to (perf/gpu_check.sh): a decode's speed depends on the shape, not on the weights' values.

The shapes are those of the coder preset's GGUFs (Qwen2.5-Coder 1.5B and 0.5B Instruct), read from their
headers; tests/test_realmodel.py checks them against the files. The byte vocabulary leaves out the real output
layer (151,936 tokens), about a sixth of the 1.5B's weights. Each tensor is made when it is written, a window
of one pool of random values, so the memory needed is one tensor's and a model takes seconds, not minutes.

Usage: python3 perf/gpu_models.py DIR [--tiny]   (writes DIR/base.gguf and DIR/helper.gguf)
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import numpy as np

from kvrescue_local.gguf_export import TINY_BASE, TINY_HELPER, Qwen2Shape, qwen2_tensor_shapes, write_qwen2_gguf

# qwen2.* of the coder preset's GGUFs: block_count, embedding_length, attention.head_count(_kv),
# feed_forward_length, context_length, rope.freq_base, attention.layer_norm_rms_epsilon
CODER_SHAPES = {
    "base": Qwen2Shape(n_embd=1536, n_layer=28, n_head=12, n_head_kv=2, n_ff=8960, n_ctx_train=32768,
                       rope_theta=1e6, rms_eps=1e-6),
    "helper": Qwen2Shape(n_embd=896, n_layer=24, n_head=14, n_head_kv=2, n_ff=4864, n_ctx_train=32768,
                         rope_theta=1e6, rms_eps=1e-6),
}
TINY_SHAPES = {"base": TINY_BASE, "helper": TINY_HELPER}
SCALE = 0.02  # the weights' standard deviation, as Qwen2's initialisation: activations stay finite in F16
POOL = 1 << 24  # normal values drawn once; each tensor is a window of them at an offset of its own (drawing every
# weight anew takes minutes for the 1.5B shape, and the speed of a decode does not depend on the values)


@functools.cache
def pool() -> np.ndarray:
    values = np.random.default_rng(0).standard_normal(POOL, dtype=np.float32)
    values *= SCALE
    return values


class RandomTensor:
    """A tensor made when it is written (write_qwen2_gguf's lazy form): `.shape` and `.load()`."""

    def __init__(self, shape: tuple[int, ...], seed: int, constant: float | None = None) -> None:
        self.shape, self.seed, self.constant = shape, seed, constant

    def load(self) -> np.ndarray:
        if self.constant is not None:
            return np.full(self.shape, self.constant, np.float32)
        start = int(np.random.default_rng(self.seed).integers(POOL))
        return np.resize(np.concatenate((pool()[start:], pool()[:start])), self.shape)


def random_weights(shape: Qwen2Shape, seed: int) -> dict[str, RandomTensor]:
    """llama.cpp's qwen2 tensors, each with a seed of its own; norms at 1, the output layer tied to the embedding."""
    return {name: RandomTensor(dims, seed * 100003 + i, 1.0 if name.endswith("norm.weight") else None)
            for i, (name, dims) in enumerate(qwen2_tensor_shapes(shape).items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the folder to write base.gguf and helper.gguf into")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny shapes instead (a dry run on a CPU)")
    args = parser.parse_args()
    for seed, (role, shape) in enumerate((TINY_SHAPES if args.tiny else CODER_SHAPES).items()):
        started = time.perf_counter()
        path = write_qwen2_gguf(args.out / f"{role}.gguf", shape, random_weights(shape, seed), name=f"coder-shape-{role}",
                                dtype="f16")
        print(f"{role}: {path} ({path.stat().st_size / 2**20:.0f} MiB; {shape.n_layer} layers, {shape.n_embd} wide, "
              f"{shape.n_head}/{shape.n_head_kv} query/KV heads, FFN {shape.n_ff}) in {time.perf_counter() - started:.1f} s",
              flush=True)


if __name__ == "__main__":
    main()
