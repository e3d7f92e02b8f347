"""The composition root: from a preset and the command line's choices to a RescueConfig and open
models, with every context sized (`solve`, `bench run` and `toy calibrate` start here).

A setting comes from, in order: the command line, the preset's recipe (when the models are the
preset's), RescueConfig's defaults. The prompt template comes from, in order: --prompt-template, the
`kvrescue.prompt_template` metadata of a GGUF the project wrote, the preset of the models (also when
a path names a bundled preset's own file), RescueConfig's default (Qwen2.5-Math's chat prompt).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import KVRescueError
from .files import check_input_file, file_hash
from .hub import resolve_gguf, resolve_prm
from .paths import CACHE
from .presets import HELPER, Preset, load_preset, owns, preset_of, without_fit
from .prm import PRM, PRMParams, RewardHead, head_path, prm_format
from .rescue import Models, RescueConfig
from .rescue.judge import HelperHead
from .rescue.rules import Rule, parse_rule
from .rescue.rules.calibrated import fits_in, unfitted, with_fit
from .rescue.limits import ModelFacts, RunModels
from .runtime import Model
from .runtime.model import check_gguf_file
from .runtime.rpc import parse_endpoints
from .settings import BY_FIELD, config_overrides

PROMPT_METADATA = "kvrescue.prompt_template"
ALL_LAYERS = -1  # llama.cpp's n_gpu_layers for "every layer"
def preset_config(preset: Preset | None, dataset: str | None = None, **overrides) -> RescueConfig:
    """RescueConfig's defaults, then the preset's prompt and recipe (with what it holds for `dataset`'s problems laid
    over it), then `overrides` (fields; kv and detector as dicts); a calibrated rule without its numbers takes the
    ones the preset fitted for `dataset`."""
    config = RescueConfig()
    if preset is not None:
        recipe = merged(preset.recipe, preset.dataset_recipes.get(dataset, {}) if dataset else {})
        config = config.with_overrides({**recipe, **({"prompt": preset.prompt} if preset.prompt else {})})
    config = config.with_overrides(overrides)
    return dataclasses.replace(config, rule=fitted_rule(preset, dataset, config.rule))


def fitted_rule(preset: Preset | None, dataset: str | None, rule: Rule | str) -> Rule:
    """The rule with the preset's calibration for `dataset` (its commit.json) in each calibrated part that gives no
    numbers of its own; as it is where there is none (Rescue refuses it then)."""
    rule = rule if isinstance(rule, Rule) else parse_rule(rule)
    fitted = (preset.dataset_recipes.get(dataset, {}).get("rule") if preset and dataset else None)
    fits = fits_in(parse_rule(fitted)) if fitted else []
    return with_fit(rule, fits[0]) if fits and unfitted(rule) else rule


def rule_needs_judge(options: dict) -> bool:
    """Whether the run's rule needs a judge, before the preset is read: --rule's word, and True where the rule is
    the preset's (its rules all score)."""
    return parse_rule(options["rule"]).needs_judge if options.get("rule") else True


def check_fitted_for(selection: Selection, name: str | None) -> None:
    """--fitted-for names a dataset the preset fitted a rule for."""
    preset = selection.preset
    if name is None:
        return
    fitted = sorted(preset.dataset_recipes) if preset else []
    if name not in fitted:
        whose = (f"the {preset.name} preset fitted rules for {', '.join(fitted)} only; pass one of those, or --rule SPEC"
                 if fitted else f"the {preset.name if preset else 'chosen'} preset fitted no rule for a dataset: pass "
                                "--rule SPEC")
        raise KVRescueError(f"--fitted-for {name}: {whose}")


def rule_note(selection: Selection, rule: Rule, given: str | None, fitted_for: str | None, dataset: str | None) -> str:
    """Which rule applies and why (solve and bench run say it once): --rule, the preset's rule fitted for the dataset
    (--fitted-for, else --dataset), the preset's default, or the project's."""
    preset = selection.preset
    if given:
        return f"rule: {rule} (--rule)"
    name = fitted_for or dataset
    if preset and name in preset.dataset_recipes:
        how = "--fitted-for" if fitted_for else "--dataset"
        return f"rule: {rule} (the {preset.name} preset's, fitted for {name}: {how} {name})"
    if preset and "rule" in preset.recipe:
        hint = (f"; --fitted-for NAME takes the one fitted for {', '.join(sorted(preset.dataset_recipes))}"
                if preset.dataset_recipes else "")
        return f"rule: {rule} (the {preset.name} preset's default{hint})"
    return f"rule: {rule} (the default; --rule sets one)"


def merged(*layers: dict) -> dict:
    """Override dicts laid over each other; the nested kv and detector dicts are merged field by field."""
    out: dict = {}
    for layer in layers:
        for key, value in layer.items():
            out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


@dataclass(frozen=True)
class Selection:
    """The model files of a run and the preset whose prompt and recipe apply to them (None: none does)."""

    paths: dict
    preset: Preset | None
    rpc: tuple[str, ...] = ()  # --rpc: the servers the models' layers are offloaded to
    rpc_layers: int = ALL_LAYERS  # how many of them go there: -ngl where given, else every layer

    def config(self, options: dict, dataset: str | None = None, **overrides) -> RescueConfig:
        """The run's settings; `dataset`: whose fitted rules apply (--dataset, or --fitted-for)."""
        check_fitted_for(self, options.get("fitted_for"))
        return preset_config(self.preset, dataset, **merged(config_overrides(options), overrides))

    @property
    def head(self) -> Path | None:
        """The PRM's reward head: the one given or the preset's, else the one beside the PRM's backbone (None: no
        PRM, or `--prm helper` with no head)."""
        if self.paths["prm_head"]:
            return Path(self.paths["prm_head"])
        return None if self.paths["prm"] in (None, HELPER) else head_path(self.paths["prm"])


def check_calibration_head(selection: Selection, dataset: str | None, configs: list[RescueConfig]) -> None:
    """A preset's calibration for `dataset` maps the rewards of the head it was fitted on (Preset.calibration_heads):
    a configuration that commits by it between the base's and the helper's steps with another head would read that
    head's rewards as probabilities they are not, so it is refused before any model loads. (Among one side's
    candidates the map, rising in the reward, picks the best-rewarded whatever its fit.)"""
    preset = selection.preset
    fitted = preset.calibration_heads.get(dataset) if preset and dataset else None
    head = selection.head
    if fitted is None or head is None or not head.exists():  # a missing head is open_models' error
        return
    calibrated = [config for config in configs
                  if config.needs_prm and config.mode.sides > 1 and fits_in(config.commit_rule)]
    if not calibrated:
        return
    used = file_hash(head)
    if used != fitted:
        raise KVRescueError(f"the {preset.name} preset's {dataset} calibration (its commit.json) was fitted on the "
                            f"rewards of head {fitted[:8]}, and --rule {calibrated[0].rule} at budget "
                            f"{calibrated[0].kv.budget} would read those of {head} ({used[:8]}) through it: pass "
                            "a --rule without calibrated (judge, lead:base, lead:helper), or refit the calibration on "
                            "rows this head scored (`kvrescue-local fit`, docs/prm.md)")


def prm_head_given(value: str | None) -> tuple[str | None, Path | None]:
    """--prm helper[:HEAD.npz] or PATH.gguf[:HEAD.npz]: the PRM without its head, and the head file given (None:
    the preset's, else the one beside the backbone)."""
    if value is None or ":" not in value or not value.endswith(".npz"):
        return value, None
    prm, head = value.rsplit(":", 1)
    return prm, Path(head)


def select_models(options: dict, needs_base: bool, needs_helper: bool, needs_prm: bool = True,
                  note: Callable[[str], None] = lambda text: None) -> Selection:
    """--base/--helper/--prm, falling back to --preset for what is not given. A PRM is needed only where a
    round has a choice (more than one candidate); `--prm helper` reads the helper's context with the preset's
    helper head, `--prm helper:HEAD.npz` with that one; `--prm PATH.gguf:HEAD.npz` is a separate PRM whose head
    is not beside it. A preset's judge, detector thresholds and rules were fitted for its own pair: where --base or
    --helper gives a model of another fingerprint (presets.owns), they do not apply, and a run that needs the
    preset's judge is refused (refuse_judge_of_another_pair)."""
    given = {role: options.get(role) for role in ("base", "helper", "prm")}
    given["prm"], head_given = prm_head_given(given["prm"])
    in_helper = given["prm"] == HELPER
    needed = {"base": needs_base, "helper": needs_helper or in_helper and needs_prm, "prm": needs_prm}
    preset = None
    notes = []  # said once the pair is checked: an Error line comes first
    if any(given[role] is None for role, need in needed.items() if need) or (in_helper and needs_prm and not head_given):
        preset = load_preset(options["preset"])
        if preset.note:
            notes.append(f"preset {preset.name}: {preset.note}")
        for role, need in needed.items():  # the note describes the preset's own models
            if need and options.get(role) and options[role] != str(getattr(preset, role)):
                notes.append(f"{role}: {options[role]} (--{role}), in place of the preset's")
    paths = {role: given[role] or (getattr(preset, role) if preset else None) for role in given}
    # a preset's head may ship apart from its backbone; a --prm backbone has its head beside it unless one is given
    if paths["prm"] == HELPER:
        paths["prm_head"] = head_given or (preset.helper_head if preset else None)
    else:
        paths["prm_head"] = head_given or (preset.prm_head if preset and not given["prm"] else None)
    for role in ("base", "helper"):
        paths[role] = paths[role] and resolve_gguf(paths[role])
    if given["prm"] and not in_helper and not Path(given["prm"]).exists() and given["prm"].count("/") == 1:
        paths["prm"] = resolve_prm(given["prm"], CACHE / "prm", quantize="q8_0")
    preset_judge = given["prm"] is None or in_helper and not head_given
    replaced = replaced_models(preset, given, paths, needed) if preset_judge else []
    if replaced:
        if needs_prm:
            refuse_judge_of_another_pair(preset, given, replaced)
        paths["prm"] = paths["prm_head"] = None  # a run that may not need it (serve) goes without, never with it
    for text in notes:
        note(text)
    primary = "base" if needs_base else "helper"
    if given[primary] is None or preset is not None and owns(preset, primary, paths[primary]):
        source = preset
    else:
        source = preset_of(primary, paths[primary])
    others = [role for role in ("base", "helper") if needed[role] and source and not owns(source, role, paths[role])]
    if others:  # its prompt and settings still serve the model of its that runs; what was fitted for its pair not
        note(f"the {source.name} preset's detector thresholds and rules were fitted for its own pair, and the "
             f"{' and '.join(others)} is not its: they do not apply (`kvrescue-local fit` fits this pair's)")
        source = without_fit(source)
    rpc = parse_endpoints(options["rpc"]) if options.get("rpc") else ()
    given_layers = options.get("n_gpu_layers")
    selection = Selection(paths, source, rpc, ALL_LAYERS if given_layers is None else given_layers)
    check_model_files(selection, given)
    return selection


def replaced_models(preset: Preset | None, given: dict, paths: dict, needed: dict) -> list[str]:
    """The roles whose model --base or --helper gives in place of the preset's own (preset.owns)."""
    if preset is None:
        return []
    # a file that is no GGUF (missing, a FIFO, another format) is refused by its reader first, naming the file
    return [role for role in ("base", "helper") if needed[role] and given[role] and is_gguf(Path(paths[role]))
            and not owns(preset, role, paths[role])]


def refuse_judge_of_another_pair(preset: Preset, given: dict, replaced: list[str]) -> None:
    """A preset's judge is fitted for its own pair: one Error line names how to get a judge for this one."""
    options = " and ".join(f"--{role} {given[role]}" for role in replaced)
    raise KVRescueError(f"{options} replace{'s' if len(replaced) == 1 else ''} the {preset.name} preset's "
                        f"model{'s' if len(replaced) > 1 else ''}, and its judge was fitted for its own pair: fit "
                        "one for this pair (`kvrescue-local fit --base BASE.gguf --helper HELPER.gguf --data "
                        "TRAIN.jsonl --out FOLDER`, then --preset FOLDER), pass a judge for it (--prm "
                        "PATH.gguf[:HEAD.npz] or --prm helper:HEAD.npz), or a rule that needs no judge (--rule "
                        "random)")


def is_gguf(path: Path) -> bool:
    """A regular file (a FIFO is never opened: it would block) that begins as a GGUF does."""
    try:
        if not path.is_file():
            return False
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def check_model_files(selection: Selection, given: dict) -> None:
    """Each model file of the run and the PRM's reward head a regular file, checked before anything reads them
    (their headers, the head's arrays, llama.cpp's load): a FIFO would block each reader forever. A missing one
    is left to the reader that opens it, which names the fix."""
    for role in ("base", "helper", "prm"):
        path = selection.paths[role]
        if path is not None and path != HELPER:
            check_input_file(path, f"--{role}" if given[role] else f"the preset's {role} model",
                             "pass the path of a .gguf model file", missing_ok=True)
    if selection.head is not None:
        check_input_file(selection.head, "the PRM's reward head", "pass a .head.npz file (--prm PATH.gguf:HEAD.npz)",
                         missing_ok=True)


def model_facts(selection: Selection, needs_base: bool, needs_helper: bool, max_candidates: int) -> RunModels:
    """The facts (limits.ModelFacts) of the models open_models would open with these arguments, read from their
    GGUF headers: nothing is loaded, so the sizes are checked before llama.cpp allocates anything."""
    paths = selection.paths
    own_prm = max_candidates > 1 and paths["prm"] not in (None, HELPER)
    return RunModels(ModelFacts.read(paths["base"]) if needs_base else None,
                     ModelFacts.read(paths["helper"]) if needs_helper else None,
                     ModelFacts.read(paths["prm"]) if own_prm else None)


# settings whose default a model may not honour (settings.SETTINGS' fields), and the models whose trained context
# bounds each (the buffer only where the base evicts)
TRAINED_BOUNDS = (("max_tokens", ("base", "helper")), ("max_step_tokens", ("base", "helper")), ("kv.buffer", ("base",)))


def fit_defaults(config: RescueConfig, models: RunModels, options: dict,
                 note: Callable[[str], None] = lambda text: None) -> RescueConfig:
    """config with each setting the command line did not give that a model it uses cannot honour (RescueConfig's
    defaults are sized for models of 4,096 positions; a preset's recipe for the preset's own models) lowered to that
    model's trained context, saying so in one note. A value the command line gave is left for check_context_sizes
    to refuse."""
    given = config_overrides(options)
    used = {"base": models.base if config.uses_base else None, "helper": models.helper if config.uses_helper else None}
    lowered, said = [], []
    for field, roles in TRAINED_BOUNDS:
        group, _, name = field.rpartition(".")
        value = getattr(getattr(config, group) if group else config, name)
        is_given = name in (given.get(group, {}) if group else given)
        bounds = [used[role] for role in roles if used[role] is not None and (not group or config.evicts)]
        model = min(bounds, key=lambda m: m.n_ctx_train, default=None)
        if is_given or model is None or value <= model.n_ctx_train:
            continue
        lowered.append({group: {name: model.n_ctx_train}} if group else {name: model.n_ctx_train})
        said.append(f"{BY_FIELD[field].flag} {value:,} to {model.n_ctx_train:,}, the positions {model.name} was "
                    "trained on")
    if not lowered:
        return config
    note(f"lowered the default {'; '.join(said)} (give them to choose)")
    return config.with_overrides(merged(*lowered))


def open_model(selection: Selection, config: RescueConfig, path: Path) -> Model:
    """A base or helper model with the run's offload: over RPC every layer goes to the servers unless -ngl says how
    many (-ngl 0: none)."""
    return Model(path, n_gpu_layers=selection.rpc_layers if selection.rpc else config.n_gpu_layers, rpc=selection.rpc)


def open_models(selection: Selection, config: RescueConfig, needs_base: bool, needs_helper: bool,
                max_candidates: int, problems: list[str], prompt_given: bool = False, prm_ctx: int = 0,
                before_prm: Callable[[RescueConfig, list[Model | None]], None] | None = None
                ) -> tuple[RescueConfig, Models]:
    """The models, opened; the config with the prompt template of the primary model's GGUF when it names
    one (and no --prompt-template was given). The PRM is opened only when it chooses in a round (max_candidates
    > 1: the most candidates it chooses among); its context starts at prm_ctx, else at what the longest problem
    needs, and grows in the PRM's own tokens as the trajectory does. Its head is the preset's, else the one beside
    the backbone. before_prm: checks of the open base and helper (a problem too long for them) made before the
    PRM's context, which is sized from the longest problem, is allocated."""
    paths = selection.paths
    name = selection.preset.name if selection.preset else "NAME"
    if max_candidates > 1 and paths["prm"] is None:  # checked before any model loads
        raise KVRescueError(f"the {selection.preset.name if selection.preset else 'chosen'} preset has no PRM yet, and "
                            f"{max_candidates} candidates per round need one to choose between them: pass --prm "
                            "PATH.gguf (or use -n 1 in mode full, bon or helper, or --rule random)")
    in_helper = paths["prm"] == HELPER
    if max_candidates > 1 and in_helper and (paths["prm_head"] is None or not Path(paths["prm_head"]).exists()):
        missing = f"the {name} preset has none" if paths["prm_head"] is None else f"{paths['prm_head']} is missing"
        raise KVRescueError(f"--prm helper needs a head trained on the helper's context, and {missing}: "
                            f"`kvrescue-local prm train --preset {name} --format helper-value` trains one, or pass "
                            "--prm helper:HEAD.npz")
    head = selection.head
    if max_candidates > 1 and not in_helper:
        if not Path(head).exists():
            raise KVRescueError(f"the PRM's reward head {head} is missing: `kvrescue-local prm train --preset {name}` "
                                "trains one (or pass --prm with a converted PRM)")
        preset_prm = selection.preset.prm if selection.preset else None  # None: a preset without a PRM of its own
        own = preset_prm is not None and Path(paths["prm"]) == Path(preset_prm)
        check_head_backbone(RewardHead.load(Path(head)), Path(head), Path(paths["prm"]), "PRM",
                            f"`kvrescue-local prm train --preset {name}`" if own else None)
    base = open_model(selection, config, paths["base"]) if needs_base else None
    helper = open_model(selection, config, paths["helper"]) if needs_helper else None
    template = (base or helper).metadata(PROMPT_METADATA)
    if template and not prompt_given:
        config = dataclasses.replace(config, prompt=template)
    if before_prm is not None:
        before_prm(config, [base, helper])
    if max_candidates <= 1:
        return config, Models(base, helper, None)
    if in_helper:
        if helper is None:
            raise KVRescueError("--prm helper scores in the helper's context, and this mode has no helper: use mode "
                                "kvrescue or helper, or pass --prm with a PRM model of its own")
        return config, Models(base, helper, helper_head(Path(head), helper, name))
    longest = max(len(p.encode()) for p in problems)
    prm = PRM(paths["prm"], PRMParams(n_ctx=prm_ctx or config.prm_context(longest), max_candidates=max_candidates,
                                      n_gpu_layers=config.n_gpu_layers, flash_attn=config.flash_attn,
                                      n_threads=config.n_threads, n_batch=config.n_batch), head=head)
    return config, Models(base, helper, prm)


def helper_head(path: Path, helper: Model, preset: str) -> HelperHead:
    """The head for `--prm helper`: one of a format that reads steps as the helper holds them, trained on this
    helper's very file (its fingerprint, which fixes its hidden size too), else one Error line."""
    head = RewardHead.load(path)
    train = f"`kvrescue-local prm train --preset {preset} --format helper-value`"
    if not prm_format(head.format).as_held:
        raise KVRescueError(f"the head {path} is of format {head.format}, which reads steps in a PRM context of its "
                            f"own: --prm helper needs one trained on the helper's context ({train}), or pass --prm "
                            "with the PRM model it belongs to")
    check_head_backbone(head, path, helper.path, "helper", train, required=True)
    return HelperHead(head, path, helper)


def check_head_backbone(head: RewardHead, path: Path, model: Path, role: str, train: str | None,
                        required: bool = False) -> None:
    """A head that records the model file it was trained on (`prm train` writes its fingerprint, of the GGUF's
    header and tensor index: a copy keeps it, a requantized file does not) reads that file's hidden states alone:
    on another model's its rewards mean nothing, and a calibration fitted on them (commit.json) less. A head with
    none recorded (converted from a checkpoint, or trained before heads recorded theirs) is read on any model of its
    hidden size, unless one is required (the helper's judge, which only `prm train` writes). train: the command that
    trains one on `model`, where there is one."""
    if head.backbone is None and not required:
        return
    used = file_hash(check_gguf_file(model))
    if head.backbone != used:
        trained = f"another model file ({head.backbone[:8]})" if head.backbone else "an unrecorded model file"
        retrain = f"train one on it ({train}), or " if train else ""
        raise KVRescueError(f"the head {path} was trained on the hidden states of {trained}, not on the {role} "
                            f"{model.name} ({used[:8]}): {retrain}pass the model it was trained on")
