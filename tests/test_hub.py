"""Hub models resolved from a local directory laid out as a Hugging Face cache (no network)."""

import shutil

import pytest

from hf_checkpoint import write_prm_checkpoint
from kvrescue_local.errors import KVRescueError
from kvrescue_local.hub import resolve_gguf, resolve_prm
from kvrescue_local.prm import PRM, PRMParams, head_path
from kvrescue_local.runtime import Model

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def fake_repo(cache, repo, files, repo_type="model"):
    """Snapshot + refs/main as huggingface_hub lays them out; files maps name -> source path."""
    root = cache / f"{repo_type}s--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    for name, source in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, snapshot / name, dirs_exist_ok=True)
        else:
            shutil.copy(source, snapshot / name)
    return snapshot


def test_gguf_specs_resolve_from_the_cache_offline(tmp_path, base_path):
    cache = tmp_path / "hub"
    fake_repo(cache, "someone/Tiny-GGUF", {"Tiny-Q8_0.gguf": base_path, "Tiny-Q4_K_M.gguf": base_path,
                                             "big/Tiny-Q2_K-00001-of-00002.gguf": base_path,
                                             "big/Tiny-Q2_K-00002-of-00002.gguf": base_path})
    by_quant = resolve_gguf("someone/Tiny-GGUF:Q8_0", cache_dir=cache, offline=True)
    assert by_quant.name == "Tiny-Q8_0.gguf" and Model(by_quant).n_vocab > 256
    assert resolve_gguf("someone/Tiny-GGUF:Tiny-Q4_K_M.gguf", cache_dir=cache, offline=True).name == "Tiny-Q4_K_M.gguf"
    assert resolve_gguf("someone/Tiny-GGUF:q2_k", cache_dir=cache, offline=True).name.endswith("00001-of-00002.gguf")
    assert resolve_gguf(str(base_path)) == base_path
    with pytest.raises(KVRescueError, match="no GGUF of quantization IQ1_S.*Tiny-Q8_0.gguf"):
        resolve_gguf("someone/Tiny-GGUF:IQ1_S", cache_dir=cache, offline=True)
    with pytest.raises(KVRescueError, match="not in the Hugging Face cache.*models pull"):
        resolve_gguf("someone/Tiny-GGUF:Missing.gguf", cache_dir=cache, offline=True)
    with pytest.raises(KVRescueError, match="neither an existing file"):
        resolve_gguf("not-a-repo:Q8_0", cache_dir=cache, offline=True)


def test_prm_checkpoint_is_converted_once_and_reused(tmp_path):
    source = tmp_path / "src"
    write_prm_checkpoint(source, "qwen-prm", seed=2)
    cache = tmp_path / "hub"
    fake_repo(cache, "Qwen/Tiny-PRM", {p.name: p for p in source.iterdir()})
    out_dir = tmp_path / "converted"
    gguf = resolve_prm("Qwen/Tiny-PRM", out_dir, quantize=None, cache_dir=cache, offline=True)
    assert head_path(gguf).exists()
    stamp = gguf.stat().st_mtime_ns
    assert resolve_prm("Qwen/Tiny-PRM", out_dir, quantize=None, cache_dir=cache, offline=True) == gguf
    assert gguf.stat().st_mtime_ns == stamp, "the second call reuses the conversion"
    prm = PRM(gguf, PRMParams(n_ctx=512))
    prm.start("1+1?")
    assert 0 <= prm.score(["1+1=2."])[0] <= 1
    with pytest.raises(KVRescueError, match="could not get the PRM checkpoint.*models pull"):
        resolve_prm("Qwen/Absent-PRM", out_dir, quantize=None, cache_dir=cache, offline=True)


def test_models_commands_list_presets_and_refuse_offline_without_cache():
    from click.testing import CliRunner

    from kvrescue_local.cli import main

    listed = CliRunner().invoke(main, ["models", "list"])
    assert listed.exit_code == 0 and "qwen2.5-math-7b" in listed.output and "tiny" in listed.output
    pulled = CliRunner().invoke(main, ["models", "pull", "qwen2.5-math-7b", "--offline"])  # nothing cached here
    assert pulled.exit_code != 0 and "not in the Hugging Face cache" in pulled.output
    unknown = CliRunner().invoke(main, ["models", "pull", "qwen9"])
    assert unknown.exit_code != 0 and "unknown preset 'qwen9'" in unknown.output
