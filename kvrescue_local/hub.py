"""Models from the Hugging Face hub, kept in its cache (download with progress, reuse, offline).

A model is given as a path, as `repo:file.gguf`, or as `repo:QUANT` (the file of that
quantization, as llama.cpp's `-hf` reads it; a split GGUF brings all its parts). PRMs are
Hugging Face checkpoints converted locally once (`convert-prm`) into our cache.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import KVRescueError

SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
PRM_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]


@dataclass(frozen=True)
class HubModels:
    """A preset of hub models: base and helper as GGUF specs, the PRM as a checkpoint repo."""

    name: str
    base: str
    helper: str
    prm_repo: str
    prm_quantize: str | None = "q8_0"
    note: str = ""


HUB_PRESETS = {
    "qwen2.5-math-7b": HubModels("qwen2.5-math-7b", "bartowski/Qwen2.5-Math-7B-Instruct-GGUF:Q4_K_M",
                                 "bartowski/Qwen2.5-Math-1.5B-Instruct-GGUF:Q8_0", "Qwen/Qwen2.5-Math-PRM-7B",
                                 note="Qwen2.5-Math-7B-Instruct base, 1.5B helper, Qwen2.5-Math-PRM-7B"),
    "qwen2.5-math-72b": HubModels("qwen2.5-math-72b", "bartowski/Qwen2.5-Math-72B-Instruct-GGUF:Q4_K_M",
                                  "bartowski/Qwen2.5-Math-1.5B-Instruct-GGUF:Q8_0", "Qwen/Qwen2.5-Math-PRM-7B",
                                  note="Qwen2.5-Math-72B-Instruct base, 1.5B helper, Qwen2.5-Math-PRM-7B"),
}


def offline_default(offline: bool | None) -> bool:
    if offline is not None:
        return offline
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no")


def not_cached(what: str, offline: bool, fix: str) -> str:
    """The message for a file the Hugging Face cache lacks, which the hub gave not: downloads were off, or the
    hub could not be reached (huggingface_hub raises LocalEntryNotFoundError for both)."""
    if offline:
        return f"{what} is not in the Hugging Face cache and downloads are off (offline): {fix}"
    return f"{what} is not in the Hugging Face cache and the hub could not be reached: check the network, or {fix}"


def split_spec(spec: str) -> tuple[str, str] | None:
    """(repo, file-or-quant) for `owner/name:x`; None when spec is a plain path."""
    if Path(spec).exists() or ":" not in spec:
        return None
    repo, _, what = spec.rpartition(":")
    if repo.count("/") != 1 or not what:
        raise KVRescueError(f"model {spec!r} is neither an existing file nor owner/name:FILE.gguf or owner/name:QUANT")
    return repo, what


def cached_files(repo: str, cache_dir: str | Path | None, repo_type: str = "model") -> list[str]:
    """Files of the repo's snapshots already in the hub cache (what offline mode can use)."""
    from huggingface_hub import constants

    root = Path(cache_dir or constants.HF_HUB_CACHE) / f"{repo_type}s--{repo.replace('/', '--')}" / "snapshots"
    if not root.exists():
        return []
    return sorted({str(p.relative_to(s)) for s in root.iterdir() for p in s.rglob("*") if p.is_file()})


def repo_files(repo: str, cache_dir: str | Path | None, offline: bool) -> list[str]:
    if offline:
        files = cached_files(repo, cache_dir)
        if not files:
            raise KVRescueError(f"{repo} is not in the Hugging Face cache and downloads are off (offline): run "
                                "`kvrescue-local models pull` online first")
        return files
    from huggingface_hub import list_repo_files

    try:
        return list_repo_files(repo)
    except Exception as exc:
        raise KVRescueError(f"could not list {repo} on the Hugging Face hub ({type(exc).__name__}): check the name "
                            "and the network, or use --offline with a filled cache") from None


def pick_quant(files: list[str], quant: str, repo: str) -> list[str]:
    """The GGUF file(s) of one quantization; all parts of a split file, first part first."""
    wanted = [f for f in files if f.endswith(".gguf") and quant.lower() in Path(f).name.lower()]
    if not wanted:
        ggufs = sorted(Path(f).name for f in files if f.endswith(".gguf"))
        raise KVRescueError(f"{repo} has no GGUF of quantization {quant} (files: {', '.join(ggufs) or 'none'}): "
                            "pick one of those with owner/name:FILE.gguf")
    split = [f for f in wanted if SPLIT_PART.search(f)]
    if split:
        return sorted(split)
    if len(wanted) > 1:
        raise KVRescueError(f"{repo}: quantization {quant} matches several files ({', '.join(wanted)}): name the file")
    return wanted


def download(repo: str, filename: str, cache_dir, offline: bool) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo, filename, cache_dir=cache_dir, local_files_only=offline))
    except LocalEntryNotFoundError:  # offline, or online with the hub out of reach: the cache did not have it
        raise KVRescueError(not_cached(f"{repo}/{filename}", offline, "run `kvrescue-local models pull` online "
                                       "first")) from None
    except Exception as exc:
        raise KVRescueError(f"could not download {repo}/{filename} ({type(exc).__name__}): check the network, "
                            "the name and your Hugging Face token") from None


def resolve_gguf(spec: str | Path, cache_dir=None, offline: bool | None = None) -> Path:
    """A local GGUF path for a path, `repo:file.gguf` or `repo:QUANT` (downloaded into the hub cache)."""
    parts = split_spec(str(spec))
    if parts is None:
        return Path(spec)
    repo, what = parts
    offline = offline_default(offline)
    files = [what] if what.endswith(".gguf") else pick_quant(repo_files(repo, cache_dir, offline), what, repo)
    paths = [download(repo, f, cache_dir, offline) for f in files]
    return paths[0]


def resolve_prm(repo: str, out_dir: Path, quantize: str | None, cache_dir=None, offline: bool | None = None) -> Path:
    """The converted PRM backbone GGUF (its head beside it), converting the checkpoint on first use."""
    from .prm.convert import convert_prm
    from .prm.head import head_path

    out = out_dir / repo.replace("/", "--") / f"prm-{quantize or 'f16'}.gguf"
    if out.exists() and head_path(out).exists():
        return out
    from huggingface_hub import snapshot_download

    offline = offline_default(offline)
    try:
        checkpoint = snapshot_download(repo, allow_patterns=PRM_FILES, cache_dir=cache_dir, local_files_only=offline)
    except Exception as exc:
        raise KVRescueError(f"could not get the PRM checkpoint {repo} ({type(exc).__name__}): run "
                            "`kvrescue-local models pull` online first, or pass --prm PATH.gguf") from None
    return convert_prm(checkpoint, out, quantize=quantize)
