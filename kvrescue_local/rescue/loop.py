"""The KV-Rescue engine: K problems at once, each in rounds of candidate steps from the evicted base and
the full-context helper, degenerate base candidates killed early, the PRM's favourite committed to the
problem's trajectory.

Modes share this machinery: `full` (base, no eviction), `bon` (base with eviction), `helper`
(helper alone) and `kvrescue` (both, with the detector on the base). The problems in flight share one
context per model (a slot of sequences each, see generator.py) and the PRM's (none with `--prm helper`: the
head reads the helper's own context, judge.py): a round decodes the candidates of every problem together,
scores all of them in one PRM call, commits each problem's winner,
and a finished problem's slot takes the next one from the queue at once. Beyond `problems_per_context` (on a CPU
the attention over the other problems' cells outweighs what the batch shares), the problems run in lanes, each
an engine of its own contexts, one round of each lane after the other. Seeds come from the problem's
text, the round, the side and the candidate, so a trajectory does not depend on what shares its batch.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar


from ..answers import last_boxed
from ..detect import Detector
from ..errors import KVRescueError
from ..prm import PRM
from ..runtime import Model, SamplingParams
from ..runtime.context import kv_bytes_per_cell
from .config import LLAMA_MAX_SEQ, RescueConfig
from .generator import Draft, Generator, Request
from .judge import HelperHead, HelperJudge
from .record import Step, Trajectory
from .rules.calibrated import unfitted

CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
Item = TypeVar("Item")


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


def check_helper_judge(config: RescueConfig, judge: HelperHead, concurrency: int) -> None:
    """The head reads the helper's context: the mode must have a helper, prompting it as in training, with N
    llama.cpp sequences per problem to spare for the base's candidates."""
    most = LLAMA_MAX_SEQ // (2 * config.n + 1)
    if concurrency > most:
        raise KVRescueError(f"concurrency {concurrency} does not fit with --prm helper: the helper's context holds "
                            f"{2 * config.n + 1} of llama.cpp's {LLAMA_MAX_SEQ} sequences per problem, N + 1 and N to "
                            f"score the base's candidates in; use --concurrency 1 to {most}")
    if not config.uses_helper:
        raise KVRescueError(f"--prm helper scores in the helper's context, and mode {config.mode} has no helper: use "
                            "mode kvrescue or helper, or pass --prm with a PRM model of its own")
    if config.prompt != judge.prompt:
        raise KVRescueError(f"the head {judge.head_file.name} was trained on the helper prompted otherwise than this "
                            "run prompts it: drop --prompt-template, retrain the head in this prompt, or pass --prm "
                            "with a PRM model of its own")


def longest_prompt(config: RescueConfig, models: list[Model | None], problems: list[str]) -> int:
    """Tokens the longest problem's prompt takes in any of the models (sizes the contexts)."""
    return max(len(m.tokenize(config.prompt.format(problem=p))) for m in models if m is not None for p in problems)


def problem_key(problem: str) -> int:
    """A stable number for a problem's text, part of its seeds: the same in `solve` and `bench`, at any K."""
    return int.from_bytes(hashlib.sha256(problem.encode()).digest()[:4], "little")


def least_degenerate(killed: list[Draft]) -> Draft:
    """Of a round's candidates, all killed, the one whose text repeated least (the highest zstd ratio it reached),
    then the least uncertain: the trajectory goes on from it rather than stopping."""
    return max(killed, key=lambda c: (c.monitor.min_compression, -c.monitor.max_mean_entropy))


def sampling_of(config: RescueConfig) -> SamplingParams:
    """The settings a candidate's sampler chain takes from a configuration (its seed the root of the candidates')."""
    return SamplingParams(temperature=config.temperature, top_p=config.top_p, seed=config.seed)


def own_failure(exc: Exception) -> str:
    """The error of a problem whose own work failed (any other exception than the project's named by its type)."""
    detail = str(exc) if isinstance(exc, KVRescueError) else f"{type(exc).__name__}: {exc}"
    return f"solving this problem failed: {detail}"


@dataclass
class Solving:
    """A problem in flight: its slot, its trajectory so far and the seconds charged to it."""

    item: object
    slot: int
    trajectory: Trajectory
    key: int
    started: float
    round: int = 0
    tail: bytes = b""
    drafts: list[Draft] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # llama_<side>, prm, total: its share of each round
    error: str | None = None
    sampling: SamplingParams | None = None  # the temperature, top-p and seed its item asks for (None: the config's)

    @property
    def seed(self) -> int | None:
        return self.sampling.seed if self.sampling else None

    def charge(self, costs: dict[str, float]) -> None:
        for k, v in costs.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v


@dataclass(frozen=True)
class Progress:
    """Where a problem in flight stands between rounds: its steps committed and their tokens, the source of the last
    (None before the first), the cells its base sequence holds and the evictions of its base sequences so far."""

    steps: int = 0
    committed_tokens: int = 0
    last_source: str | None = None
    base_cells: int = 0
    evictions: int = 0


@dataclass
class Models:
    """The models a run opened, None where its modes use none: a Rescue's base, helper and judge."""

    base: Model | None
    helper: Model | None
    prm: PRM | HelperHead | None  # HelperHead: `--prm helper`, the helper's own context (its model is the helper)

    def files(self) -> dict[str, Path | None]:
        return {"base": self.base and self.base.path, "helper": self.helper and self.helper.path,
                "prm": self.prm and self.prm.model.path}


class Rescue:
    """Runs problems through one mode, `concurrency` at a time; models, contexts and the PRM are created once
    and reused. `prm`: a PRM of its own, or a HelperHead that scores in the helper's context."""

    def __init__(self, config: RescueConfig, base: Model | None = None, helper: Model | None = None,
                 prm: PRM | HelperHead | None = None, prompt_tokens_max: int = 512, concurrency: int = 1,
                 per_context: int | None = None) -> None:
        """per_context: most problems that share one context per model [default: `problems_per_context`]; more
        problems at once run in lanes of their own contexts, one round of each lane after the other."""
        self.config = config
        self.rule = config.commit_rule
        if unfitted(self.rule):
            raise KVRescueError(f"rule {config.rule} has a calibrated part without its four numbers, and this run has "
                                "no fitted calibration to take: give them (calibrated:BS,BB,HS,HB), or run a dataset "
                                "the preset fitted one for (docs/prm.md)")
        if config.uses_base and base is None:
            raise KVRescueError(f"mode {config.mode} needs a base model: pass --base")
        if config.uses_helper and helper is None:
            raise KVRescueError(f"mode {config.mode} needs a helper model: pass --helper")
        if prm is None and config.needs_prm:
            raise KVRescueError(f"{config.candidates_per_round} candidates per round need a PRM to choose between "
                                "them: pass --prm (or use N=1, or --rule random)")
        config.check_concurrency(concurrency)  # the limits of one context hold in lanes too: a GPU runs one
        judge = prm if config.needs_prm else None  # with one candidate, or a random choice, nothing to score
        in_helper = isinstance(judge, HelperHead)
        if in_helper:
            check_helper_judge(config, judge, concurrency)
        self.concurrency = concurrency
        self.prm_own_seconds = 0.0
        self.took = False  # whether the last turn's slots took a problem from the queue
        per_context = per_context or problems_per_context(config, [base, helper, prm], prompt_tokens_max)
        self.lanes: list[Rescue] = []
        if concurrency > per_context:
            count = -(-concurrency // per_context)
            self.lanes = [Rescue(config, base, helper, prm.sibling() if isinstance(prm, PRM) else prm, prompt_tokens_max,
                                 concurrency // count + (i < concurrency % count), per_context) for i in range(count)]
            self.sides: dict[str, Generator] = {}
            self.prm = self.scorer = None
            return
        self.same_vocab = check_compatible(base, helper) if config.uses_base and config.uses_helper else False
        self.prm = None if in_helper else judge  # the PRM with a context of its own
        if self.prm:
            self.prm.reserve(concurrency)
        common = dict(sampling=sampling_of(config), max_step_tokens=config.max_step_tokens, n_batch=config.n_batch,
                      flash_attn=config.flash_attn, n_threads=config.n_threads,
                      slots=concurrency, slot_cells=config.full_context(prompt_tokens_max))
        self.sides: dict[str, Generator] = {}
        for side, model in {"base": base if config.uses_base else None,
                            "helper": helper if config.uses_helper else None}.items():
            if model is not None:
                kv = config.kv if side == "base" and config.evicts else None
                scores = in_helper and side == "helper"  # room for the base's candidates, read beside the helper's
                n_ctx = config.context_cells(side, concurrency, prompt_tokens_max) + scores * config.scoring_cells(concurrency)
                type_k, type_v = config.cache_types(side)
                self.sides[side] = Generator(side, model, config.n, n_ctx, kv, type_k=type_k, type_v=type_v,
                                             scores=scores, **common)
        self.scorer = HelperJudge(self.sides["helper"], judge.format, judge.head) if in_helper else self.prm
        self.detector = Detector(config.detector) if config.mode.detects else None
        self.helper_detector = Detector(config.helper_detector) if config.mode.detects and config.helper_detector else None
        self.prompt_tokens_max = prompt_tokens_max

    def close(self) -> None:
        """Free the llama.cpp contexts this engine made, its lanes' and their PRM siblings' with them, at once rather
        than when the garbage collector gets to them; the models and the PRM it was given stay. It runs no more."""
        for lane in self.lanes:
            lane.close()
            if lane.prm:
                lane.prm.ctx.free()
        for gen in self.sides.values():
            gen.ctx.free()

    def solve(self, problem: str, on_step: Callable[[Step], None] | None = None) -> Trajectory:
        """One problem (the engine with one slot busy); a problem that cannot finish raises its error."""
        ((_, trajectory, error),) = self.run([problem], on_step=(lambda _, step: on_step(step)) if on_step else None)
        if error:
            raise KVRescueError(error)
        return trajectory

    def run(self, items: Iterable[Item], text: Callable[[Item], str] = str,
            on_step: Callable[[Item, Step], None] | None = None,
            config_of: Callable[[Item], RescueConfig] | None = None,
            stop_of: Callable[[Item], str | None] | None = None) -> Iterator[tuple[Item, Trajectory, str | None]]:
        """Solve the problems `text(item)`, `concurrency` at a time, yielding (item, trajectory, error) as each
        finishes (error: why it could not finish, its trajectory then holds what it did). `config_of(item)` gives an
        item settings of its own, which differ from the run's in their sampling alone (temperature, top-p, seed: they
        are per sequence in llama.cpp), and the trajectory a run of those settings gives; `stop_of(item)`, asked
        before each round, ends an item early with the reason it returns (a served request whose client left).
        `items` is asked for more whenever a slot is free: an iterator that is empty for now and has items later is
        served then."""
        queue = iter(items)
        flying = self.slots_in_flight()
        while True:
            idle = not any(flying)
            yield from self.turns(queue, flying, text, on_step, config_of, stop_of)
            if idle and not any(flying) and not any(lane.took for lane in self.lanes or [self]):
                return  # a pass that started with nothing in flight found nothing in the queue

    def slots_in_flight(self) -> list[dict[int, Solving]]:
        """Empty bookkeeping for `turns`: each lane's problems in flight by slot."""
        return [{} for _ in self.lanes or [self]]

    def progress(self, flying: list[dict[int, Solving]]) -> list[tuple[object, Progress]]:
        """Each problem in flight (`flying`, as `turns` keeps it) and its Progress; read on the thread that runs the
        turns, between them, as it reads llama.cpp's cells."""
        out = []
        for lane, solving in zip(self.lanes or [self], flying):
            base = lane.sides.get("base")
            for s in solving.values():
                steps = s.trajectory.steps
                out.append((s.item, Progress(len(steps), s.trajectory.tokens["committed"],
                                             steps[-1].source if steps else None,
                                             base.resident_cells(s.slot) if base else 0,
                                             base.evictions(s.slot)[0] if base else 0)))
        return out

    def turns(self, queue: Iterator[Item], flying: list[dict[int, Solving]], text, on_step, config_of,
              stop_of) -> Iterator[tuple[Item, Trajectory, str | None]]:
        """One turn of each lane (see `run`); a caller that runs several engines, one turn of each after the other,
        keeps each engine's `slots_in_flight` between its turns."""
        for lane, solving in zip(self.lanes or [self], flying):
            yield from lane.turn(queue, solving, text, on_step, config_of, stop_of)

    def turn(self, queue: Iterator[Item], flying: dict[int, Solving], text, on_step, config_of,
             stop_of) -> Iterator[tuple[Item, Trajectory, str | None]]:
        """Fill this engine's free slots from the queue, end the problems that cannot go on, then run one round;
        yields the problems that end."""
        self.took = False
        for slot in (s for s in range(self.concurrency) if s not in flying):
            item = next(queue, queue)
            if item is queue:
                break
            self.took = True
            flying[slot] = self.begin(item, text(item), slot, config_of(item) if config_of else None)
        for solving in flying.values():
            solving.error = (solving.error or (stop_of and stop_of(solving.item))
                             or next(filter(None, (g.overflow(solving.slot) for g in self.sides.values())), None))
        failed = [s for s in flying.values() if s.error is not None]
        for solving in failed:
            yield self.end(flying.pop(solving.slot))
        if failed or not flying:
            return  # their slots take the next problems first
        for solving in self.round(list(flying.values()), on_step):
            yield self.end(flying.pop(solving.slot))

    def begin(self, item, problem: str, slot: int, own: RescueConfig | None = None) -> Solving:
        """Start a problem in `slot`; `own`: its settings when it has its own sampling (run's config_of)."""
        solving = Solving(item, slot, Trajectory(problem, (own or self.config).as_dict()), problem_key(problem),
                          time.perf_counter())
        prompt = self.config.prompt.format(problem=problem)
        llama_before = {name: g.llama_seconds for name, g in self.sides.items()}
        try:  # a failure here is the problem's own: its slot ends at once, the others are not touched
            if own:
                solving.sampling = sampling_of(own)
            for gen in self.sides.values():
                tokens = gen.model.tokenize(prompt)
                if len(tokens) > self.prompt_tokens_max:
                    solving.error = (f"the problem is {len(tokens)} tokens long, over the {self.prompt_tokens_max} "
                                     "reserved for the prompt: shorten it or raise prompt_tokens_max")
                    return solving
                gen.start(slot, tokens)
            if self.prm:
                self.prm.start(problem, slot)
        except Exception as exc:  # noqa: BLE001 - as in advance_alone
            solving.error = own_failure(exc)
        finally:  # emptying the slot is llama.cpp work of this problem's, charged to it as its rounds' is
            solving.charge({f"llama_{name}": g.llama_seconds - llama_before[name] for name, g in self.sides.items()})
        return solving

    def round(self, flying: list[Solving], on_step) -> list[Solving]:
        """One round of every problem in flight; returns those that finished."""
        started = time.perf_counter()
        llama_before = {name: g.llama_seconds for name, g in self.sides.items()}
        judged_before, committed_before = self.judged_seconds, self.committed_from_reads_seconds
        prm_before = self.prm_own_seconds
        for gen in self.sides.values():  # the prompts and last round's commits, charged as this round's work
            gen.flush()
        for s in flying:
            s.drafts = []
        for side_index, (name, gen) in enumerate(self.sides.items()):
            requests = [Request(s.slot, (s.key, s.round, side_index), s.tail, s.sampling) for s in flying]
            drafts = gen.propose(requests, self.detector if name == "base" else self.helper_detector)
            for s in flying:
                s.drafts += drafts[s.slot]
        self.score([s for s in flying if sum(not c.killed for c in s.drafts) > 1])
        finished = [s for s in flying if self.advance_alone(s, on_step)]
        costs = {f"llama_{name}": g.llama_seconds - llama_before[name] for name, g in self.sides.items()}
        # the helper context's time scoring is the PRM's, but for the base winners' tokens it read, which the
        # helper commits with any choice: those are the helper's, as a commit of their text would be
        committed = self.committed_from_reads_seconds - committed_before
        if "llama_helper" in costs:
            costs["llama_helper"] -= self.judged_seconds - judged_before - committed
        costs["prm"] = self.prm_own_seconds - prm_before - committed
        costs["total"] = time.perf_counter() - started
        for s in flying:  # a round's work is shared: each problem in it is charged an equal part
            s.charge({k: v / len(flying) for k, v in costs.items()})
        return finished

    def score(self, flying: list[Solving]) -> None:
        """The PRM scores the survivors of every problem that has a choice, in one call; a text that several
        candidates share is scored once, so equal steps get equal scores."""
        if not self.scorer or not flying:
            return
        t0 = time.perf_counter()
        if isinstance(self.scorer, HelperJudge):
            helper = self.sides["helper"]
            by_slot = self.scorer.score_round({s.slot: [c for c in s.drafts if not c.killed] for s in flying},
                                              lambda draft: self.foreign_tokens(helper, draft))
        else:
            texts = {s.slot: list(dict.fromkeys(c.content for c in s.drafts if not c.killed)) for s in flying}
            rewards = self.scorer.score_many(texts)
            by_slot = {slot: dict(zip(texts[slot], rewards[slot])) for slot in texts}
        for s in flying:
            by_text = by_slot[s.slot]
            for cand in (c for c in s.drafts if not c.killed):
                cand.score = float(by_text[cand.content])
        self.prm_own_seconds += time.perf_counter() - t0

    def advance_alone(self, s: Solving, on_step) -> bool:
        """advance, where a failure in the problem's own work (its choice, its commit, the caller's on_step) ends
        that problem with the error and leaves the others' round as it is: only its own sequences were touched."""
        try:
            return self.advance(s, on_step)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is this problem's error, not the run's
            s.error = own_failure(exc)
            return True

    def advance(self, s: Solving, on_step) -> bool:
        """Commit the problem's winner of this round; True when the problem is finished."""
        traj = s.trajectory
        survivors = [c for c in s.drafts if not c.killed]
        seeds = (self.config.seed if s.seed is None else s.seed, s.key, s.round)
        winner = self.rule.choose(survivors, seeds) if survivors else least_degenerate(s.drafts)
        step = Step(s.round, winner.content, winner.side, winner.score, winner.finished, [c.record() for c in s.drafts],
                    fallback=not survivors)
        traj.steps.append(step)
        traj.tokens["committed"] += len(winner.tokens)
        s.round += 1
        if winner.finished == "eos":
            traj.stop = "eos"
        elif traj.tokens["committed"] >= self.config.max_tokens:
            traj.stop = "max_tokens"
        elif s.round >= self.config.max_steps:
            traj.stop = "max_steps"
        else:  # it goes on from the winner
            self.commit(s.slot, winner)
            if self.prm:
                self.prm.commit(winner.content, s.slot)
            s.tail = (s.tail + bytes(winner.text))[-self.config.detector.text_window:]
        if "base" in self.sides:
            base = self.sides["base"]
            traj.base_cells.append({"committed": base.resident_cells(s.slot),
                                    "max_candidate": base.peak_candidate_cells(s.slot)})
        if on_step:
            on_step(s.item, step)
        return bool(traj.stop)

    def end(self, s: Solving) -> tuple[object, Trajectory, str | None]:
        """Close the problem's record and free its slot."""
        traj = s.trajectory
        traj.answer = last_boxed(traj.text)
        if "base" in self.sides and self.sides["base"].budget:  # the observation-window fallbacks must stay 0
            evictions, fallbacks = self.sides["base"].evictions(s.slot)
            traj.evictions = {"evictions": evictions, "fallback_evictions": fallbacks}
        for name, gen in self.sides.items():
            traj.tokens[name] = gen.tokens_generated[s.slot]
            gen.finish(s.slot)
        if self.prm:
            self.prm.finish(s.slot)
        if isinstance(self.scorer, HelperJudge):  # its scoring sequences went with the slot
            self.scorer.held.pop(s.slot, None)
        if s.error:
            traj.stop = "error"
        seconds = {k: round(v, 4) for k, v in s.seconds.items() if k != "total"}
        total = s.seconds.get("total", 0.0)
        seconds["orchestration"] = round(total - sum(v for k, v in s.seconds.items() if k != "total"), 4)
        traj.timings = {**seconds, "total": round(total, 4), "wall": round(time.perf_counter() - s.started, 4)}
        return s.item, traj, s.error

    def commit(self, slot: int, winner: Draft) -> None:
        """Every side continues from the winner: its own side keeps the sequence, the others encode the text."""
        judge = self.scorer if isinstance(self.scorer, HelperJudge) else None
        for name, gen in self.sides.items():
            if name == winner.side:
                gen.commit_own(slot, winner)
            elif not (judge and judge.gen is gen and judge.commit_held(slot, winner.content)):
                gen.commit_foreign(slot, self.foreign_tokens(gen, winner))
        if judge:
            judge.held.pop(slot, None)

    def foreign_tokens(self, gen: Generator, draft: Draft) -> list[int]:
        """The tokens `gen` commits another side's step in: as sampled when the vocabularies are the same."""
        if self.same_vocab:
            return [t for t in draft.tokens if not gen.model.is_eog(t)]
        return gen.model.tokenize(draft.content, special=False).tolist()

    @property
    def judged_seconds(self) -> float:
        """The helper context's llama.cpp time spent scoring (`--prm helper`) so far."""
        return self.scorer.llama_seconds if isinstance(self.scorer, HelperJudge) else 0.0

    @property
    def committed_from_reads_seconds(self) -> float:
        """The part of `judged_seconds` that decoded steps since committed from where they were read."""
        return self.scorer.committed_seconds if isinstance(self.scorer, HelperJudge) else 0.0

    def peak_kv_bytes(self) -> dict[str, int]:
        """The most KV bytes each context held at the end of a round so far (base, helper, PRM; with `--prm helper`
        the helper's includes the base candidates it scores), every lane's together."""
        out = {name: gen.peak_used_cells * gen.ctx.kv_bytes_per_cell for name, gen in self.sides.items()}
        if self.prm:
            out["prm"] = self.prm.peak_cells * kv_bytes_per_cell(self.prm.model, self.prm.params.kv_type, self.prm.params.kv_type)
        for lane in self.lanes:
            for name, value in lane.peak_kv_bytes().items():
                out[name] = out.get(name, 0) + value
        return out

    @property
    def prm_seconds(self) -> float:
        """Wall time the PRM spent scoring so far, every lane's together."""
        return self.prm_own_seconds + sum(lane.prm_seconds for lane in self.lanes)

    def llama_seconds(self) -> dict[str, float]:
        """Wall time inside llama.cpp so far per model side ("base", "helper"), every lane's together."""
        out = {name: gen.llama_seconds for name, gen in self.sides.items()}
        for lane in self.lanes:
            for name, value in lane.llama_seconds().items():
                out[name] = out.get(name, 0.0) + value
        return out


# On a CPU with flash attention on, the most problems a context per model takes: as many as keep the attention a
# token pays over the other problems' cells (llama.cpp's unified KV cache: every query attends over every resident
# cell, masked) under the FLOPs of the weights it pays anyway, which the batch shares (per model, the least).
OTHERS_ATTENTION_SHARE = 1.0


def problems_per_context(config: RescueConfig, models: list, prompt_tokens_max: int) -> int:
    """Most problems one context per model holds; more at once run in lanes of their own contexts.

    On a GPU (-ngl > 0) every problem shares one context: the weights dominate a decode there. On a CPU with flash
    attention off, one problem a context: the plain softmax costs each row of a decode every resident cell, so a
    problem beside others costs more than alone (perf/concurrency_perf.py, docs/throughput.md). With it on, the tiled
    kernel shares the batch's work: from each model's parameters against the cells a problem holds in it."""
    if config.n_gpu_layers:
        return LLAMA_MAX_SEQ
    if config.flash_attn == "off":
        return 1
    cells = {"base": (config.n + 1) * config.kv.limit if config.evicts else config.full_context(prompt_tokens_max),
             "helper": config.full_context(prompt_tokens_max),
             "prm": config.prm_context(prompt_tokens_max) - config.n_batch}
    most = LLAMA_MAX_SEQ
    for side, model in zip(("base", "helper", "prm"), models):
        if isinstance(model, PRM):  # its backbone (a head on the helper reads the helper's context)
            model = model.model
        if isinstance(model, Model):
            attention = 4 * model.n_layer * model.n_embd * cells[side]  # KQ and KQV, multiply and add, per cell
            most = min(most, max(1, int(OTHERS_ATTENTION_SHARE * 2 * model.n_params / attention)))
    return most
