"""Tiny qwen2 GGUF models, written once per test session from fixed seeds."""

import dataclasses
import os
import signal

import numpy as np
import pytest

from kvrescue_local.gguf_export import TINY_BASE, TINY_HELPER, random_qwen2_weights, write_qwen2_gguf, write_tiny_model
from kvrescue_local.runtime import Model

# A shell that starts a job in the background (`.ci/run &`) makes it ignore SIGINT, every process it execs
# inherits that, and a Python started so never turns Ctrl-C into KeyboardInterrupt: the tests that press
# Ctrl-C on a child would see it ignored. A handler (unlike SIG_IGN) is reset to the default on exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# KVRESCUE_TEST_NGL=99 offloads every layer of the test models (perf/gpu_check.sh on a GPU machine), so that
# the patch's graph ops, K-row reads and compactions run on the GPU's backend; 0 (the default) keeps them on the CPU.
N_GPU_LAYERS = int(os.environ.get("KVRESCUE_TEST_NGL", "0"))


@pytest.fixture(autouse=True)
def in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Every test runs in a temporary folder: a relative output path, or an option's name taken for a missing
    value (`--results --html`), lands there, never in the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def base_path(tiny_dir):
    return write_tiny_model(tiny_dir / "base.gguf", TINY_BASE, seed=1)


@pytest.fixture(scope="session")
def helper_path(tiny_dir):
    return write_tiny_model(tiny_dir / "helper.gguf", TINY_HELPER, seed=2)


@pytest.fixture(scope="session")
def base_model(base_path):
    return Model(base_path, n_gpu_layers=N_GPU_LAYERS)


@pytest.fixture(scope="session")
def helper_model(helper_path):
    return Model(helper_path, n_gpu_layers=N_GPU_LAYERS)


@pytest.fixture(scope="session")
def one_layer_model(tiny_dir):
    """With one layer a token's K/V depend on nothing but the token and its position."""
    return Model(write_tiny_model(tiny_dir / "one-layer.gguf", dataclasses.replace(TINY_BASE, n_layer=1), seed=3),
                 n_gpu_layers=N_GPU_LAYERS)


def constant_model(path, favourite: int | None):
    """A model whose next-token distribution never changes: all tokens share one embedding and every
    block is zero, so the final hidden state is constant. favourite=None gives uniform logits
    (maximal entropy); otherwise that token gets a logit margin of 12 (a repetition loop)."""
    shape = TINY_HELPER
    weights = random_qwen2_weights(shape, seed=0)
    for name in weights:
        if name.startswith("blk.") and not name.endswith("norm.weight"):
            weights[name] = np.zeros_like(weights[name])
    weights["token_embd.weight"] = np.ones_like(weights["token_embd.weight"])
    output = np.zeros_like(weights["token_embd.weight"])
    if favourite is not None:
        output[favourite] = 12.0 / np.sqrt(shape.n_embd)  # the normalised hidden state is all ones
    weights["output.weight"] = output
    return Model(write_qwen2_gguf(path, shape, weights), n_gpu_layers=N_GPU_LAYERS)


@pytest.fixture(scope="session")
def looping_model(tiny_dir):
    return constant_model(tiny_dir / "loop.gguf", favourite=ord("a"))


@pytest.fixture(scope="session")
def blank_line_model(tiny_dir):
    """Every step it writes is a blank line: two tokens, a loop across steps and never within one."""
    return constant_model(tiny_dir / "blank.gguf", favourite=ord("\n"))


@pytest.fixture(scope="session")
def uniform_model(tiny_dir):
    return constant_model(tiny_dir / "uniform.gguf", favourite=None)


@pytest.fixture(scope="session")
def tiny_prm_path(tiny_dir):
    from kvrescue_local.presets import tiny_preset

    return tiny_preset(tiny_dir / "preset").prm


@pytest.fixture(scope="session")
def tiny_prm(tiny_prm_path):
    from kvrescue_local.prm import PRM, PRMParams

    return PRM(tiny_prm_path, PRMParams(n_ctx=2048, max_candidates=16))
