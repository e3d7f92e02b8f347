"""`kvrescue-local fit`: a preset folder for a base and a helper, fitted on training problems in the order a preset
needs its parts:

1. the detector's thresholds (detector.py): the base alone, full KV and evicted best-of-N at each budget, watched;
2. the judge: a value head on the helper's own context (`--prm helper`, format helper-value), trained on the pair's
   rollouts (full, evicted best-of-N at each budget and the helper alone, N = 1), unless a PRM is given;
3. the rule (rules_file.py): the regime's budget from those best-of-N and helper-alone rows, then, where the base
   is the weaker writer, the calibration from KV-Rescue rows with the judge choosing at that budget.

Every sweep appends to a file of the folder's `rows/` as each problem ends, and a run skips what they hold: a
stopped run (Ctrl-C, a crash) resumes where it stopped and ends with the same folder. The folder records what it
was fitted on (preset.json's "fitted": each model's file, path and fingerprint, the problems, the budgets, the
day); `--preset FOLDER` loads it (presets.folder_preset).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Callable

import numpy as np

from ..bench.datasets import SPLITS, Dataset, load_dataset
from ..bench.results_file import read_rows
from ..bench.run import run_sweep, sweep_axes
from ..compose import Selection, helper_head
from ..detect.calibrate import save_params
from ..errors import KVRescueError
from ..files import file_hash, write_output
from ..presets import FITTED, HELPER
from ..rescue import Models, RescueConfig, longest_prompt
from ..rescue.limits import check_prompts_fit
from ..runtime import Context, ContextParams, Model
from .detector import collect, fit_detector, read_stats, settings
from .features import FeatureCache, dataset_hidden
from .examples import labelled_steps
from .pipeline import helper_judge, labelled_rows, train
from .regime import fit_regime
from .rules_file import fit_rules

JUDGE_FORMAT = "helper-value"  # the judge fit trains: a head on the helper's own context
JUDGE_RULE = "judge:margin=0.005"  # the KV-Rescue rows the calibration is fitted on (docs/prm.md)
HEAD = "helper.head.npz"  # where a folder keeps the judge fit trained (presets.folder_preset reads it)


@dataclass(frozen=True)
class Plan:
    folder: Path
    dataset: Dataset
    budgets: tuple[int, ...]
    template: RescueConfig  # the sweeps' settings (one thread); mode, N, budget and rule are the stages'
    prm: str | None = None  # a PRM given (a GGUF, or helper:HEAD.npz): no judge is trained

    @property
    def rows(self) -> Path:
        return self.folder / "rows"

    @property
    def solves(self) -> dict[str, int]:
        """Problems each stage solves, the calibration's at one budget (which it learns after stage 2)."""
        problems = len(self.dataset.problems)
        return {"detector": problems * (1 + len(self.budgets)), "rollouts": problems * (2 + len(self.budgets)),
                "calibration": problems}


def training_problems(name: str | None, data: Path | None, limit: int | None) -> Dataset:
    """A dataset's training split (a dataset without one is refused: nothing tells its evaluation problems apart),
    or a --data file, any problem of which that is an evaluation problem of a split dataset is refused."""
    if name is not None:
        if name not in SPLITS:
            raise KVRescueError(f"--dataset {name} has no training split (only {', '.join(SPLITS)} have one): pass "
                                "--data FILE.jsonl of training problems")
        return load_dataset(name, split="train", limit=limit)
    dataset = load_dataset(path=data, limit=limit)
    for split_dataset in SPLITS:
        held = {p.problem.strip(): p.id for p in load_dataset(split_dataset, split="eval").problems}
        for problem in dataset.problems:
            if problem.problem.strip() in held:
                raise KVRescueError(f"--data {data}: problem {problem.id} is {split_dataset}'s evaluation problem "
                                    f"{held[problem.problem.strip()]}: fit on training problems only (--dataset "
                                    f"{split_dataset} takes its training split)")
    return dataset


def decode_rate(model: Model, threads: int, tokens: int = 16) -> float:
    """Tokens per second the model decodes one sequence at, measured on `tokens` decodes at `threads` threads."""
    ctx = Context(model, ContextParams(n_ctx=256, n_threads=threads))
    prompt = model.tokenize("1 + 1 = 2")
    ctx.prefill(0, prompt)
    token = np.array([prompt[-1]], np.int32)
    started = time.perf_counter()
    for _ in range(tokens):
        ctx.step(np.array([0]), token)
    return tokens / max(time.perf_counter() - started, 1e-9)


def estimate_seconds(plan: Plan, base_rate: float, helper_rate: float) -> float:
    """A bound on the sweeps' decoding time: each solve runs to the token cap (most end sooner), the base's at its
    rate, the helper's at its own, a KV-Rescue round decoding both (the judge's reads, a small share, left out)."""
    cap = plan.template.max_tokens
    solves = plan.solves
    base_solves = solves["detector"] + solves["rollouts"] - len(plan.dataset.problems) + solves["calibration"]
    helper_solves = len(plan.dataset.problems) + solves["calibration"]
    return cap * (base_solves / base_rate + helper_solves / helper_rate)


def model_record(path: Path) -> dict:
    return {"file": path.name, "path": str(path.resolve()), "sha256": file_hash(path)}


PAIR = "pair.json"  # rows/'s record of the models its rows ran: a resume must be of the same pair


def check_own_folder(folder: Path, paths: dict) -> None:
    """--out is a folder of this pair's fit, or a new one: another preset's folder (its preset.json records no fit,
    or another pair's) or rows of another pair are refused before anything is written."""
    models = {role: model_record(Path(paths[role])) for role in ("base", "helper")}
    spec = folder / "preset.json"
    if spec.is_file():
        recorded = (json.loads(spec.read_text()).get(FITTED) or {}).get("models") or {}
        if any((recorded.get(role) or {}).get("sha256") != models[role]["sha256"] for role in models):
            raise KVRescueError(f"--out {folder} holds another preset (its preset.json is no fit of this pair): pass a "
                                "new folder")
    pair = folder / "rows" / PAIR
    fingerprints = {role: models[role]["sha256"] for role in models}
    if pair.is_file() and json.loads(pair.read_text()) != fingerprints:
        raise KVRescueError(f"{folder / 'rows'} holds the rows of another pair ({pair}): pass a new folder to --out, "
                            "or remove that one")
    pair.parent.mkdir(parents=True, exist_ok=True)
    write_output(pair, json.dumps(fingerprints) + "\n", "--out")


class Fitter:
    """The stages on open models; `say` hears what each fitted, `progress(label, total)` gives a callback a stage
    calls once per problem done (or skipped: done by an earlier run)."""

    def __init__(self, plan: Plan, selection: Selection, models: Models, say: Callable[[str], None],
                 progress: Callable[[str, int], Callable[[int], None]]) -> None:
        self.plan, self.selection, self.models, self.say, self.progress = plan, selection, models, say, progress
        texts = {f"problem {p.id}": p.problem for p in plan.dataset.problems}
        check_prompts_fit(plan.template, [models.base, models.helper], texts)
        self.reserve = longest_prompt(plan.template, [models.base, models.helper], list(texts.values()))

    def mine(self, rows: list[dict]) -> list[dict]:
        """The rows of this plan's problems and budgets: a folder's rows/ may hold more from an earlier, larger fit."""
        problems = {(self.plan.dataset.label, p.id) for p in self.plan.dataset.problems}
        budgets = {0, *self.plan.budgets}

        def budget(row: dict) -> int:  # a results row's, or a statistics line's setting ("full", "bon@64")
            if "config" in row:
                return int((row.get("config") or {}).get("budget") or 0)
            return int(str(row.get("setting")).partition("@")[2] or 0)

        return [r for r in rows if (str(r.get("dataset")), str(r.get("id"))) in problems and budget(r) in budgets]

    def detector(self):
        stats = self.plan.rows / "detector.jsonl"
        configs = settings(self.plan.template, list(self.plan.budgets))
        label = self.plan.dataset.label
        step = self.progress("1/4 detector", self.plan.solves["detector"])
        collect(self.models.base, configs, [(label, p.id, p.problem) for p in self.plan.dataset.problems], stats,
                self.reserve, on_solved=lambda *solved: step(1), on_skip=step)
        params = fit_detector(self.mine(read_stats([stats])), self.plan.template.detector)
        how = "fitted" if params != self.plan.template.detector else "the starting thresholds kept: no signal separated"
        self.say(f"detector: entropy {params.tau_entropy} nats, zstd {params.tau_compression} ({how} on {stats})")
        return params

    def sweep(self, name: str, label: str, modes: list[str], budgets: tuple[int, ...], rule: str,
              template: RescueConfig, models: Models) -> Path:
        results = self.plan.rows / f"{name}.jsonl"
        axes = sweep_axes(modes, budgets, [1], [template.kv.policy], [rule])
        step = self.progress(label, len(axes) * len(self.plan.dataset.problems))
        run_sweep(self.plan.dataset, axes, template, models, results, resume=True, on_result=lambda row: step(1),
                  on_skip=step)
        return results

    def judge(self, rollouts: Path) -> Path | None:
        """Stage 2's head, trained on the rollouts (None where a PRM was given)."""
        if self.plan.prm is not None:
            self.say(f"judge: the PRM given ({self.plan.prm}), no head trained")
            return None
        rows, _, _ = labelled_rows([rollouts], "train")
        rows = self.mine(rows)
        steps = [step for row in rows for step in labelled_steps(row)]
        reader = helper_judge(self.models.helper, self.plan.template, JUDGE_FORMAT, None,
                              self.plan.template.n_threads, rows)
        step = self.progress("3/4 judge's features", len(rows))
        hidden = dataset_hidden(FeatureCache(reader, self.plan.rows / "features"), rows, lambda cached: step(1))
        fit = train(hidden, steps, JUDGE_FORMAT)
        head = self.plan.folder / HEAD
        dataclasses.replace(fit.head, backbone=file_hash(self.models.helper.path), prompt=reader.prompt).save(head)
        self.say(f"judge: {fit.choice.label} on {fit.steps} steps ({fit.positives} right), cross-validated AUC "
                 f"{max(fit.validation.values(), default=float('nan')):.3f}; wrote {head}")
        return head

    def run(self) -> dict:
        """Every stage, then the folder's files; returns its record."""
        template = self.plan.template
        detector = self.detector()
        rollouts = self.sweep("rollouts", "2/4 rollouts", ["full", "bon", "helper"], self.plan.budgets, "judge",
                              template, self.models)
        head = self.judge(rollouts)
        rows_of = {rollouts: self.mine(read_rows(rollouts))}
        judge_rows = {rollouts: rows_of[rollouts]} if head else {}
        # the regime first: the calibration's rows run at the largest budget where the base is the weaker writer
        budget = max(r.judge_max_budget for r in fit_regime(rows_of[rollouts], str(rollouts)))
        if budget:
            judged = template.with_overrides({"detector": {"tau_entropy": detector.tau_entropy,
                                                           "tau_compression": detector.tau_compression}})
            # the head trained here, else the PRM given (open_models opened it)
            judge = self.models.prm if head is None else helper_head(head, self.models.helper, str(self.plan.folder))
            models = dataclasses.replace(self.models, prm=judge)
            calibration = self.sweep("calibration", "4/4 calibration", ["kvrescue"], (budget,), JUDGE_RULE, judged,
                                     models)
            rows_of[calibration] = self.mine(read_rows(calibration))
        commit = fit_rules(rows_of, judge_rows, say=self.say)
        self.say(f"rule: {commit['rule']}")
        return self.write(detector, commit, head)

    def write(self, detector, commit: dict, head: Path | None) -> dict:
        folder, template = self.plan.folder, self.plan.template
        save_params(detector, folder / "detector.json")
        write_output(folder / "commit.json", json.dumps(commit, indent=2) + "\n", "--out")
        paths = self.selection.paths
        models = {"base": model_record(Path(paths["base"])), "helper": model_record(Path(paths["helper"]))}
        if self.plan.prm is not None and paths["prm"] not in (None, HELPER):
            models["prm"] = {**model_record(Path(paths["prm"])), "head": str(Path(self.selection.head).resolve())}
        elif self.plan.prm is not None:
            models["prm"] = {"head": str(Path(self.selection.head).resolve())}
        problems = self.plan.dataset.problems
        record = {"models": models, "problems": {"dataset": self.plan.dataset.label, "count": len(problems),
                                                 "ids": [p.id for p in problems]},
                  "budgets": list(self.plan.budgets), "date": date.today().isoformat()}
        recipe = {"kv": {"buffer": template.kv.buffer, "window": template.kv.window, "policy": template.kv.policy,
                         "n_sink": template.kv.n_sink, "protect_prompt": template.kv.protect_prompt},
                  "detector": {"entropy_window": template.detector.entropy_window,
                               "text_window": template.detector.text_window,
                               "check_every": template.detector.check_every},
                  **{name: getattr(template, name) for name in ("max_tokens", "max_steps", "max_step_tokens",
                                                                 "temperature", "top_p")}}
        spec = {"note": f"fitted by `kvrescue-local fit` on {len(problems)} {self.plan.dataset.label} training "
                        f"problems: base {models['base']['file']}, helper {models['helper']['file']}",
                "prompt": template.prompt, "recipe": recipe, FITTED: record}
        write_output(folder / "preset.json", json.dumps(spec, indent=1) + "\n", "--out")
        return record
