"""Where kvrescue-local keeps its files.

CACHE: the tiny preset, converted PRMs, training checkpoints ($XDG_CACHE_HOME/kvrescue-local;
patches/build.py keeps its sdists and wheels there too, with its own copy of this line because it
runs before the package is installed).
SHIPPED_MODELS: the trained models that ship with the package (models/ in the repository, installed
as package data kvrescue_local/models/ by `pip install .`).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvrescue-local"

_INSTALLED = Path(__file__).resolve().parent / "models"
SHIPPED_MODELS = _INSTALLED if _INSTALLED.is_dir() else Path(__file__).resolve().parent.parent / "models"
