"""The KV-Rescue loop: rounds of candidate steps from the evicted base and the full-context helper,
degenerate base candidates killed early, the PRM's favourite committed to one shared trajectory.

Modes share this machinery: `full` (base, no eviction), `bon` (base with eviction), `helper`
(helper alone) and `kvrescue` (both, with the detector on the base).
"""

from __future__ import annotations

import time
import zlib
from typing import Callable

import numpy as np

from ..answers import last_boxed
from ..detect import Detector
from ..errors import KVRescueError
from ..prm import PRM
from ..runtime import Model, SamplingParams
from .config import RescueConfig
from .generator import Draft, Generator
from .record import Step, Trajectory
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


def check_compatible(base: Model, helper: Model) -> bool:
    """Refuse models that cannot share one trajectory; True when their vocabularies are identical."""
    for token in CHAT_TOKENS:
        for model in (base, helper):
            if len(model.tokenize(token)) != 1:
                raise KVRescueError(f"{model.path.name} has no {token} control token: base and helper must share the "
                                    "Qwen chat template (use a base and helper of the same family)")
    if base.token_bytes(base.eos) != helper.token_bytes(helper.eos):
        raise KVRescueError(f"base and helper end generation with different tokens ({base.token_bytes(base.eos)!r} vs "
                            f"{helper.token_bytes(helper.eos)!r}): use a base and helper of the same family")
    return base.n_vocab == helper.n_vocab and all(
        base.token_bytes(t) == helper.token_bytes(t) for t in range(base.n_vocab))


def longest_prompt(config: RescueConfig, models: list[Model | None], problems: list[str]) -> int:
    """Tokens the longest problem's prompt takes in any of the models (sizes the contexts)."""
    return max(len(m.tokenize(config.prompt.format(problem=p))) for m in models if m is not None for p in problems)


def choose(survivors: list[Draft], config: RescueConfig, problem: str, round_index: int) -> Draft:
    """The round's winner: the best scored survivor, or with choice "random" one drawn by a seed of the run's
    seed, the problem and the round (reproducible, and not the same draw on every problem)."""
    if config.choice == "random":
        rng = np.random.default_rng([config.seed, zlib.crc32(problem.encode()), round_index])
        return survivors[int(rng.integers(len(survivors)))]
    return max(survivors, key=lambda c: c.score if c.score is not None else 0.0)


class Rescue:
    """Runs problems through one mode; models, contexts and the PRM are created once and reused."""

    def __init__(self, config: RescueConfig, base: Model | None = None, helper: Model | None = None,
                 prm: PRM | None = None, prompt_tokens_max: int = 512) -> None:
        self.config = config
        if config.uses_base and base is None:
            raise KVRescueError(f"mode {config.mode} needs a base model: pass --base")
        if config.uses_helper and helper is None:
            raise KVRescueError(f"mode {config.mode} needs a helper model: pass --helper")
        if prm is None and config.needs_prm:
            raise KVRescueError(f"{config.candidates_per_round} candidates per round need a PRM to choose between "
                                "them: pass --prm (or use N=1, or --choice random)")
        self.same_vocab = check_compatible(base, helper) if config.uses_base and config.uses_helper else False
        self.prm = prm if config.needs_prm else None  # with one candidate there is nothing to choose
        sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p, seed=config.seed)
        full_ctx = config.full_context(prompt_tokens_max)
        common = dict(sampling=sampling, max_step_tokens=config.max_step_tokens, n_batch=config.n_batch,
                      flash_attn=config.flash_attn, kv_type=config.kv_type, n_threads=config.n_threads)
        self.sides: dict[str, Generator] = {}
        if config.uses_base:
            kv = config.kv if config.evicts else None
            n_ctx = kv.context_cells(config.n + 1, config.n_batch) if kv else full_ctx
            self.sides["base"] = Generator("base", base, config.n, n_ctx, kv, **common)
        if config.uses_helper:
            self.sides["helper"] = Generator("helper", helper, config.n, full_ctx, None, **common)
        self.detector = Detector(config.detector) if config.mode.detects else None
        self.prompt_tokens_max = prompt_tokens_max

    def solve(self, problem: str, on_step: Callable[[Step], None] | None = None) -> Trajectory:
        cfg = self.config
        started = time.perf_counter()
        llama_before = {name: g.llama_seconds for name, g in self.sides.items()}
        budget = self.sides["base"].budget if "base" in self.sides else None
        evictions_before = (budget.evictions, budget.fallback_evictions) if budget else (0, 0)
        prm_seconds = 0.0
        prompt = cfg.prompt.format(problem=problem)
        traj = Trajectory(problem, cfg.as_dict())
        for name, gen in self.sides.items():
            tokens = gen.model.tokenize(prompt)
            if len(tokens) > self.prompt_tokens_max:
                raise KVRescueError(f"the problem is {len(tokens)} tokens long, over the {self.prompt_tokens_max} "
                                    "reserved for the prompt: shorten it or raise prompt_tokens_max")
            gen.start(tokens)
        if self.prm:
            self.prm.start(problem)
        tail = b""
        for round_index in range(cfg.max_steps):
            candidates: list[Draft] = []
            for side_index, (name, gen) in enumerate(self.sides.items()):
                detector = self.detector if name == "base" else None
                candidates += gen.propose(cfg.seed * 1_000_003 + round_index * 2 + side_index, detector, tail)
            survivors = [c for c in candidates if not c.killed]
            if not survivors:
                traj.stop = "all_killed"
                break
            if self.prm and len(survivors) > 1:
                t0 = time.perf_counter()
                for cand, score in zip(survivors, self.prm.score([c.content for c in survivors])):
                    cand.score = float(score)
                prm_seconds += time.perf_counter() - t0
            winner = choose(survivors, cfg, problem, round_index)
            self.commit(winner)
            if self.prm:
                t0 = time.perf_counter()
                self.prm.commit(winner.content)
                prm_seconds += time.perf_counter() - t0
            tail = (tail + bytes(winner.text))[-cfg.detector.text_window:]
            step = Step(round_index, winner.content, winner.side, winner.score, winner.finished,
                        [c.record() for c in candidates])
            traj.steps.append(step)
            traj.tokens["committed"] += len(winner.tokens)
            if "base" in self.sides:
                base = self.sides["base"]
                peak = base.budget.peak_cells if base.budget else 0  # most cells any base sequence held
                traj.base_cells.append({"committed": base.resident_cells(), "max_candidate": peak})
            if on_step:
                on_step(step)
            if winner.finished == "eos":
                traj.stop = "eos"
                break
            if traj.tokens["committed"] >= cfg.max_tokens:
                traj.stop = "max_tokens"
                break
        else:
            traj.stop = "max_steps"
        traj.answer = last_boxed(traj.text)
        if budget:  # the observation-window fallbacks must stay 0: see BudgetedSequences
            traj.evictions = {"evictions": budget.evictions - evictions_before[0],
                              "fallback_evictions": budget.fallback_evictions - evictions_before[1]}
        for name, gen in self.sides.items():
            traj.tokens[name] = gen.tokens_generated
        in_llama = {name: g.llama_seconds - llama_before[name] for name, g in self.sides.items()}
        total = time.perf_counter() - started
        traj.timings = {**{f"llama_{k}": round(v, 4) for k, v in in_llama.items()}, "prm": round(prm_seconds, 4),
                        "orchestration": round(total - sum(in_llama.values()) - prm_seconds, 4), "total": round(total, 4)}
        return traj

    def commit(self, winner: Draft) -> None:
        """Every side continues from the winner: its own side keeps the sequence, the others encode the text."""
        for name, gen in self.sides.items():
            if name == winner.side:
                gen.commit_own(winner)
            elif self.same_vocab:
                gen.commit_foreign([t for t in winner.tokens if not gen.model.is_eog(t)])
            else:
                gen.commit_foreign(gen.model.tokenize(winner.content, special=False))
