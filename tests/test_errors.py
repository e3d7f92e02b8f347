"""Bad input ends in a KVRescueError whose one-line message names the fix."""

import ctypes
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvrescue_local.cli import main
from kvrescue_local.errors import KVRescueError
from kvrescue_local.runtime import Context, ContextParams, Model, library_path
from kvrescue_local.runtime.lib import REQUIRED_PATCH_LEVEL, bind_patch


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


def test_missing_file(tmp_path):
    with pytest.raises(KVRescueError) as err:
        Model(tmp_path / "nope.gguf")
    assert "not found" in one_line(err) and "existing .gguf" in one_line(err)


def test_text_file_named_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("<html>404 Not Found</html>")
    with pytest.raises(KVRescueError) as err:
        Model(fake)
    assert "not a GGUF file" in one_line(err) and "download it again" in one_line(err)


def test_truncated_gguf(tmp_path, base_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(base_path).read_bytes()[:4096])
    with pytest.raises(KVRescueError) as err:
        Model(cut)
    assert "could not load" in one_line(err) and "corrupt" in one_line(err)


def test_sequence_beyond_n_seq_max(base_model):
    ctx = Context(base_model, ContextParams(n_ctx=256, n_seq_max=2))
    ctx.prefill(0, base_model.tokenize("abc"))
    with pytest.raises(KVRescueError) as err:
        ctx.fork(0, 2)
    assert "n_seq_max >= 3" in one_line(err) and "larger n_seq_max" in one_line(err)
    with pytest.raises(KVRescueError):
        ctx.step([0, 5], [1, 2])


def test_decoding_into_a_full_cache(base_model):
    ctx = Context(base_model, ContextParams(n_ctx=256, n_seq_max=1))
    ctx.prefill(0, np.full(256, ord("x"), np.int32))
    with pytest.raises(KVRescueError) as err:
        ctx.step([0], [ord("y")])
    assert "KV cache is full" in one_line(err) and "raise n_ctx" in one_line(err)
    assert ctx.pos_max(0) == 255, "a refused decode leaves the cache as it was"
    ctx.remove(0, 4, 20)
    ctx.step([0], [ord("y")])  # room again after eviction
    assert ctx.pos_max(0) == 256


def test_token_from_another_vocabulary(base_model):
    ctx = Context(base_model, ContextParams(n_ctx=256))
    with pytest.raises(KVRescueError) as err:
        ctx.prefill(0, [1, 2, base_model.n_vocab + 10])
    assert "another model's vocabulary" in one_line(err)


def test_unpatched_library():
    # libggml sits beside libllama in the same wheel and has none of the patch's symbols.
    ggml = Path(library_path()).parent / "libggml.so"
    with pytest.raises(KVRescueError) as err:
        bind_patch(ctypes.CDLL(str(ggml)))
    assert "unpatched llama.cpp" in one_line(err) and "patches/build.py" in one_line(err)
    assert bind_patch(ctypes.CDLL(library_path())).llama_kvr_patch_level() >= 1


def test_bad_context_settings(base_model):
    with pytest.raises(KVRescueError):
        Context(base_model, ContextParams(type_k="f8"))
    with pytest.raises(KVRescueError):
        Context(base_model, ContextParams(flash_attn="maybe"))


def test_doctor_decodes_a_tiny_model():
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    assert f"patch level: {REQUIRED_PATCH_LEVEL}" in result.output and result.output.strip().endswith("ok")
    from kvrescue_local.runtime.lib import backends

    if [name for name, _ in backends()] == ["CPU"]:
        assert "backends: CPU (1 device)" in result.output and "GPU offload: no (CPU build)" in result.output
