"""`kvrescue-local prm train` and `prm eval` in stages, each resumable:

1. rollouts: `bench run` on the training split (the settings of the Table 2 sweep: full, bon and helper,
   budgets 64 and 128, N = 1, 768 tokens), appended to a results file and resumed like any sweep;
2. features: the PRM backbone's hidden states at each labelled step (features.py), cached per row; for a
   format read as held (helper-value, `--prm helper`) the helper's own context, read by the loop's judge;
3. train: a value head in numpy (fit.py), written where the preset looks for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .. import toy  # noqa: F401  (registers the toy dataset: rollouts on --dataset toy)
from ..bench.datasets import SPLITS, load_dataset
from ..bench.results_file import read_rows, row_key
from ..bench.run import run_sweep, sweep_axes
from ..compose import PROMPT_METADATA, check_head_backbone, helper_head, open_models, select_models
from ..errors import KVRescueError
from ..paths import CACHE
from ..presets import HELPER
from ..prm import PRM, PRMParams, RewardHead, head_path, prm_format
from ..rescue import Generator, Mode, RescueConfig
from ..rescue.judge import HelperJudge
from ..rescue.limits import check_prompts_fit
from ..runtime import Model, SamplingParams
from .evaluate import pair_scores, step_auc
from .examples import LabelledStep, check_split, labelled_steps, usable
from .features import FEATURES_CACHE, FeatureCache, dataset_hidden
from .fit import Fit, fit_head

ROLLOUTS_CACHE = CACHE / "prm-train"
PRM_CTX = 2048  # the PRM's starting context (it grows with a long trajectory)
JUDGE_CTX = 4096  # the least context the helper reads steps as held in (it cannot grow: judge_ctx sizes it first)


@dataclass(frozen=True)
class Rollouts:
    """Stage 1's sweep; the defaults are the coder Table 2 sweep's, so its results file can be reused."""

    dataset: str = "gsm8k"
    limit: int = 100
    modes: tuple[str, ...] = ("full", "bon", "helper")
    budgets: tuple[int, ...] = (64, 128)
    ns: tuple[int, ...] = (1,)
    max_tokens: int = 768
    seed: int = 0
    threads: int = 0

    @property
    def rows(self) -> int:
        """Rows of the whole sweep (modes without eviction run once, whatever the budgets)."""
        return self.limit * len(sweep_axes(self.modes, self.budgets, self.ns, ["one policy"]))

    def default_file(self, preset: str) -> Path:
        return ROLLOUTS_CACHE / f"{preset}-{self.dataset}-train.jsonl"


def run_rollouts(preset: str, plan: Rollouts, results: Path, on_result: Callable[[dict], None] = lambda row: None,
                 on_skip: Callable[[int], None] = lambda n: None) -> int:
    """Stage 1: what is not in `results` yet; returns the rows written."""
    split = "train" if plan.dataset in SPLITS else None
    data = load_dataset(plan.dataset, limit=plan.limit, split=split)
    modes = [Mode.parse(m) for m in plan.modes]
    options = {"preset": preset, "threads": plan.threads or None}
    selection = select_models(options, any(m.uses_base for m in modes), any(m.uses_helper for m in modes),
                              needs_prm=False)
    template = selection.config(options, mode=Mode.KVRESCUE, n=1, kv={"budget": max(plan.budgets)},
                                max_tokens=plan.max_tokens, seed=plan.seed)
    axes = sweep_axes(modes, plan.budgets, plan.ns, [template.kv.policy])
    if any(a.n * a.mode.sides > 1 for a in axes):
        raise KVRescueError("rollouts for a PRM run with one candidate per round (no PRM chooses yet): use --ns 1")
    problems = [p.problem for p in data.problems]
    template, models = open_models(selection, template, any(m.uses_base for m in modes),
                                   any(m.uses_helper for m in modes), 1, problems)
    check_prompts_fit(template, [models.base, models.helper], {f"problem {p.id}": p.problem for p in data.problems})
    return run_sweep(data, axes, template, models, results, resume=True, on_result=on_result, on_skip=on_skip)


def labelled_rows(files: list[Path], split: str) -> tuple[list[dict], list[LabelledStep], int]:
    """The usable rows of results files (checked against the split; a problem and configuration found in two
    files counts once), their labelled steps, and the number of rows left out."""
    rows: dict[tuple, dict] = {}
    for path in files:
        if not path.exists():
            raise KVRescueError(f"rollouts file not found: {path}")
        for row in read_rows(path):
            rows.setdefault(row_key(row), row)
    kept, left_out = usable(list(rows.values()))
    check_split(kept, split, ", ".join(map(str, files)))
    return kept, [s for row in kept for s in labelled_steps(row)], left_out


def open_backbone(preset: str, threads: int, head: Path | None = None, features_only: str | None = None,
                  helper: Path | None = None, rows: list[dict] = ()) -> PRM | HelperJudge:
    """What reads the hidden states: the preset's PRM, or for a format read as held (`--prm helper`) the judge on
    its helper's context (`helper`: another model's, a judge of another size), sized for `rows`. features_only: a
    format name and no head (training one); else `head`, or the preset's."""
    selection = select_models({"preset": preset, "helper": helper and str(helper)}, False, False, needs_prm=True)
    head = head or (None if features_only else head_file(preset))
    fmt = prm_format(features_only or RewardHead.load(head).format)
    if helper and not fmt.as_held:
        raise KVRescueError(f"--helper names the model that reads a head's steps as held (format helper-value); a "
                            f"head of format {fmt.name} reads the PRM's own context")
    if fmt.as_held:
        helper = Model(selection.paths["helper"])
        judged = None if features_only else helper_head(head, helper, preset).head
        return helper_judge(helper, selection.config({}), fmt.name, judged, threads, rows)
    backbone = selection.paths["helper"] if selection.paths["prm"] == HELPER else selection.paths["prm"]
    if backbone is None:
        raise KVRescueError(f"the {preset} preset names no PRM backbone: a head is trained on the preset's PRM model")
    if not features_only:
        check_head_backbone(RewardHead.load(head), head, Path(backbone), "PRM",
                            f"`kvrescue-local prm train --preset {preset}`")
    params = PRMParams(n_ctx=PRM_CTX, max_candidates=16, n_threads=threads)
    return PRM(backbone, params, head=head, features_only=features_only)


def helper_judge(helper: Model, config: RescueConfig, fmt: str, judged: RewardHead | None, threads: int,
                 rows: list[dict]) -> HelperJudge:
    """The helper's context reading `rows`' steps as held, with the head `judged` (None: features only, to train
    one of format `fmt`), in the settings of `config`."""
    # the prompt the loop gives the helper (compose.open_models), or the one the head was trained under
    prompt = (judged.prompt or prm_format(fmt).prompt) if judged else helper.metadata(PROMPT_METADATA) or config.prompt
    gen = Generator("helper", helper, 1, judge_ctx(helper, prompt, rows), None, SamplingParams(),
                    config.max_step_tokens, n_batch=config.n_batch, flash_attn=config.flash_attn,
                    type_k=config.helper_cache_type_k, type_v=config.helper_cache_type_v, n_threads=threads,
                    scores=True)
    return HelperJudge(gen, prm_format(fmt), judged, prompt=prompt)


def judge_ctx(helper: Model, prompt: str, rows: list[dict]) -> int:
    """Cells the helper needs to read these rows' steps as held, one trajectory at a time: its prompt and every
    committed step, and a step (of the longest any row has) read on the prefix; at least JUDGE_CTX, in whole
    blocks of 256 (MATH500 rows run to 4,096 tokens and more)."""
    def needed(row: dict) -> int:
        record = row["trajectory"]
        steps = [len(helper.tokenize(step["text"], special=False)) for step in record["steps"]]
        killed = {c["text"] for step in record["steps"] for c in step.get("candidates", ())} - {
            step["text"] for step in record["steps"]}
        longest = max([*steps, *(len(helper.tokenize(text, special=False)) for text in killed), 0])
        # the prompt, the committed prefix, the longest step read on it and its closing token
        return len(helper.tokenize(prompt.format(problem=record["problem"]))) + sum(steps) + longest + 2
    longest = max(map(needed, rows), default=0)
    return max(JUDGE_CTX, -(-longest // 256) * 256)


def head_file(preset: str, fmt: str | None = None) -> Path:
    """Where the preset reads its PRM's head (its default one; of format `fmt`: read as held, the head of `--prm
    helper`)."""
    selection = select_models({"preset": preset}, False, False, needs_prm=True)
    p, paths = selection.preset, selection.paths
    if fmt is None:
        return paths["prm_head"] or head_path(paths["prm"])
    if prm_format(fmt).as_held:
        if p.helper_head is None:
            raise KVRescueError(f"the {preset} preset has no place for a head on its helper's context: pass --out")
        return p.helper_head
    return p.prm_head or head_path(p.helper if p.prm == HELPER else p.prm)


def features(prm: PRM, rows: list[dict], progress: Callable[[bool], None] = lambda cached: None,
             cache_dir: Path | None = None) -> np.ndarray:
    return dataset_hidden(FeatureCache(prm, cache_dir or FEATURES_CACHE), rows, progress)


def train(hidden: np.ndarray, steps: list[LabelledStep], fmt: str) -> Fit:
    return fit_head(hidden, np.array([s.label for s in steps]), [s.problem for s in steps], fmt)


@dataclass(frozen=True)
class Evaluation:
    steps: int
    positives: int
    auc: float
    pairs: list


def evaluate(rewards: np.ndarray, steps: list[LabelledStep]) -> Evaluation:
    return Evaluation(len(steps), sum(s.label for s in steps), step_auc(steps, rewards), pair_scores(steps, rewards))


class Stopwatch:
    def __init__(self) -> None:
        self.started = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.started = now - self.started, now
        return seconds
