"""Tiny qwen2 GGUF models, written once per test session from fixed seeds."""

import dataclasses

import pytest

from kvrescue_local.gguf_export import TINY_BASE, TINY_HELPER, write_tiny_model
from kvrescue_local.runtime import Model


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
    return Model(base_path)


@pytest.fixture(scope="session")
def helper_model(helper_path):
    return Model(helper_path)


@pytest.fixture(scope="session")
def one_layer_model(tiny_dir):
    """With one layer a token's K/V depend on nothing but the token and its position."""
    return Model(write_tiny_model(tiny_dir / "one-layer.gguf", dataclasses.replace(TINY_BASE, n_layer=1), seed=3))
