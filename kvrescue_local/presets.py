"""Model presets: which base, helper and PRM files a name stands for.

`tiny` is written on first use from fixed seeds (random weights: it exercises the whole
machinery offline, it does not reason).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import KVRescueError
from .gguf_export import TINY_BASE, TINY_HELPER, write_tiny_model
from .prm import RewardHead, head_path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvrescue-local"


@dataclass(frozen=True)
class Preset:
    name: str
    base: Path
    helper: Path
    prm: Path
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


PRESETS = {"tiny": tiny_preset}


def load_preset(name: str) -> Preset:
    try:
        return PRESETS[name]()
    except KeyError:
        raise KVRescueError(f"unknown preset {name!r}: use one of {', '.join(sorted(PRESETS))} or pass "
                            "--base/--helper/--prm paths") from None
