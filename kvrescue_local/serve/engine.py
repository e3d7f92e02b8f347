"""The bridge between HTTP requests and the multi-problem engine.

One thread owns the models and runs engines (rescue.Rescue) over the queued requests, one round after another
(continuous batching: a slot that frees takes the next queued request before the next round). A request's sampling
(temperature, top-p, seed) is its own: llama.cpp's sampler chains are per sequence, so requests that differ only
there share an engine and its rounds, each with the trajectory `solve` gives with its settings. Requests of other
engine settings (mode, N, budget, policy, rule) get an engine of their own beside the first, and the engines in
use take one turn each after the other, as lanes do: neither drains before the other starts. At most MAX_ENGINES
engines stay alive, and only while their KV caches together fit --memory; an engine is kept when its requests are
done, for the next requests of its settings, until a request of other settings needs its room: then its contexts
are freed (the heap they held given back to the system) before the new engine's are made, and that request (with
those queued behind it) waits until an engine has nothing in flight. Events go back to each request's asyncio queue
through its event loop; a request cancelled by its client (or done by a stop sequence or its max_tokens) leaves its
slot before the next round. A failure inside a round (the shared decode) fails the requests of that engine, whose
contexts go; one in a problem's own work fails that request alone (Rescue.run).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import KVRescueError, SettingError
from ..prm import PRM
from ..rescue import Models, Progress, Rescue, RescueConfig, Step, Trajectory
from ..rescue.limits import models_kv_memory
from ..settings import request_name
from .metrics import Metrics

LENGTH_STOPS = ("max_tokens", "max_steps")  # the `kvrescue.stop`s whose finish_reason is "length"
# engines of different settings alive at once: two serve a mix of two settings (budget 64 and 96 requests) with no
# waits and no contexts made twice; each costs its contexts' memory (toy preset, 32 slots: about 240 MiB)
MAX_ENGINES = 2


SHUTTING_DOWN = "the server is shutting down (SIGINT or SIGTERM): this request was ended before it finished"


class QueueFull(KVRescueError):
    pass


class ShuttingDown(KVRescueError):
    pass


@dataclass(eq=False)  # a job is itself, not its fields: it sits in sets
class Job:
    """One request: its problem and settings, where its events go, and what has been sent so far."""

    problem: str
    config: RescueConfig  # the request's settings, its seed included
    max_tokens: int
    stops: list[str]
    prompt_tokens: int
    loop: asyncio.AbstractEventLoop
    ident: str  # the id of its response (chatcmpl-..., cmpl-...)
    slot: int | None = None  # its number among the server's --concurrency slots while it holds one
    progress: Progress = Progress()  # as the engine thread last recorded it, under Engine.cond
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.perf_counter)
    first_step: float | None = None  # perf_counter when its first step was sent
    cancelled: bool = False
    text: str = ""
    tokens: int = 0
    finish: str | None = None  # "stop_sequence" or "max_tokens" when the request ends before its trajectory does

    def send(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    @property
    def engine_key(self) -> RescueConfig:
        """The settings of the engine that runs it: its own but for the sampling, which each problem brings to the
        engine (an engine's own is never used)."""
        return dataclasses.replace(self.config, temperature=0.0, top_p=1.0, seed=0)

    def slot_state(self) -> dict:
        """llama-server's shape of a slot in /slots, the rescue's own fields under `kvrescue`; called under
        Engine.cond, which guards `slot` and `progress`."""
        config, progress = self.config, self.progress
        return {"id": self.slot, "id_task": self.ident, "is_processing": True,
                "params": {"n_predict": self.max_tokens, "seed": config.seed, "temperature": config.temperature,
                           "top_p": config.top_p, "stop": self.stops},
                "next_token": {"has_next_token": True, "n_decoded": progress.committed_tokens,
                               "n_remain": max(0, self.max_tokens - progress.committed_tokens)},
                "kvrescue": {"mode": config.mode.value, "n": config.n, "rule": config.rule.spec,
                             "budget": config.kv.budget if config.evicts else None,
                             "policy": config.kv.policy if config.evicts else None,
                             "prompt_tokens": self.prompt_tokens, "steps": progress.steps,
                             "last_source": progress.last_source, "evictions": progress.evictions,
                             "base_tokens": progress.base_cells}}

    def stop_reason(self) -> str | None:
        if self.cancelled:
            return "the client went away"
        return f"finished ({self.finish})" if self.finish else None


def step_tokens(step: Step) -> int:
    """The committed step's tokens: those of the candidate it is."""
    return next(c.tokens for c in step.candidates if c.side == step.source and c.text == step.text)


def give_back_freed_heap() -> None:
    """Return the heap that freed contexts leave to the system (glibc's malloc_trim; elsewhere nothing). glibc keeps
    freed blocks for later allocations: contexts of 32 slots made and freed five times took a process from 361 to 522
    MiB of RSS, and a trim after each freeing held it at 400-405."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim:
        trim(0)


@dataclass(eq=False)
class Configuration:
    """The engine of one configuration of settings (Job.engine_key), the requests it holds (in its slots, or handed
    to it for the next free one) and its lanes' problems in flight between its turns."""

    key: RescueConfig
    rescue: Rescue
    kv_bytes: int  # its KV caches' bytes, allocated up front
    prm: PRM | None  # a PRM sibling made for it, freed with it; None: the models' own PRM (or none)
    jobs: set[Job] = field(default_factory=set)
    inbox: deque[Job] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.flying = self.rescue.slots_in_flight()

    def handed(self):
        """The requests handed to it, one to each free slot of its lanes that asks (a new iterator every turn)."""
        while self.inbox:
            yield self.inbox.popleft()

    def close(self) -> None:
        self.rescue.close()
        if self.prm:
            self.prm.ctx.free()


class Engine:
    def __init__(self, models: Models, concurrency: int, prompt_tokens_max: int, max_queue: int,
                 metrics: Metrics, memory: int | None = None) -> None:
        """memory: the bytes the engines' KV caches may take together (--memory; None: MAX_ENGINES alone bounds
        them)."""
        self.models = models
        self.concurrency = concurrency
        self.prompt_tokens_max = prompt_tokens_max
        self.max_queue = max_queue
        self.metrics = metrics
        self.cond = threading.Condition()
        self.pending: deque[Job] = deque()
        self.running: set[Job] = set()
        self.closing = False
        self.memory = memory
        # the engine thread's alone: least recently used first
        self.configurations: dict[RescueConfig, Configuration] = {}
        self.thread = threading.Thread(target=self.serve, name="kvrescue-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Ends every request the engine holds, queued or running, with a 503 event, and takes no more: the engine
        thread returns once its round is over (a round is one decode in llama.cpp, which nothing interrupts)."""
        with self.cond:
            self.closing = True
            ended = [*self.pending, *self.running]
            self.pending.clear()
            self.metrics.queued = 0
            for job in ended:
                job.cancelled = True
            self.cond.notify_all()
        for job in ended:
            job.send("error", (503, SHUTTING_DOWN))

    def close(self, wait: float | None = None) -> bool:
        """stop, then wait up to `wait` seconds (None: however long) for the engine thread's round to end; whether
        it has."""
        self.stop()
        if self.thread.is_alive():
            self.thread.join(wait)
        return not self.thread.is_alive()

    def slots(self) -> list[dict]:
        """The requests that hold a slot, by slot (/slots): a snapshot under the lock the engine thread records
        them under."""
        with self.cond:
            return [job.slot_state() for job in sorted(self.running, key=lambda j: j.slot)]

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closing:
                raise ShuttingDown(SHUTTING_DOWN)
            if len(self.pending) + len(self.running) >= self.concurrency + self.max_queue:
                raise QueueFull(f"{len(self.running)} requests are running and {len(self.pending)} are queued, the "
                                f"most this server takes (--concurrency {self.concurrency}, --max-queue "
                                f"{self.max_queue}): retry later")
            self.pending.append(job)
            self.metrics.queued = len(self.pending)
            self.cond.notify_all()

    # --- the engine thread -------------------------------------------------
    def serve(self) -> None:
        try:
            while self.wait_for_work():
                self.admit()
                for configuration in [c for c in self.configurations.values() if c.jobs]:
                    self.turn(configuration)
        finally:
            for configuration in list(self.configurations.values()):
                self.close_configuration(configuration)

    def wait_for_work(self) -> bool:
        """Until a request is queued or in flight; False once the engine closes and its cancelled requests have left."""
        with self.cond:
            while not self.pending and not self.running and not self.closing:
                self.cond.wait()
            return not (self.closing and not self.running)

    def admit(self) -> None:
        """Hand queued requests, oldest first, to the engine of their settings while the server has a slot free. One
        whose settings need an engine there is no room for yet waits, and those queued behind it with it."""
        while True:
            with self.cond:
                if self.closing or not self.pending or len(self.running) >= self.concurrency:
                    return
                job = self.pending[0]
                if job.cancelled:
                    self.pending.popleft()
                    self.metrics.queued = len(self.pending)
                    self.metrics.cancelled += 1
                    continue
            key = job.engine_key
            configuration = self.configurations.pop(key, None)
            if configuration is None:
                if not self.make_room(key):
                    return
                try:
                    configuration = self.open(key)
                except KVRescueError as exc:  # a setting named as a request names it
                    said = exc.worded(request_name) if isinstance(exc, SettingError) else str(exc)
                    self.refuse(key, f"the engine cannot run these settings: {said}")
                    continue
            self.configurations[key] = configuration  # the most recently used last
            with self.cond:
                self.pending.popleft()
                job.slot = min(set(range(self.concurrency)) - {j.slot for j in self.running})
                self.running.add(job)
                self.metrics.queued, self.metrics.in_flight = len(self.pending), len(self.running)
            configuration.jobs.add(job)
            configuration.inbox.append(job)

    def kv_bytes(self, key: RescueConfig) -> int:
        models = self.models
        return models_kv_memory(key, self.concurrency, models.base, models.helper, models.prm, self.prompt_tokens_max)

    def make_room(self, key: RescueConfig) -> bool:
        """Close idle engines, least recently used first, until one of settings `key` fits beside the others
        (MAX_ENGINES, and their KV caches together within --memory); False while the engines in use leave no room."""
        need = self.kv_bytes(key)
        while self.configurations and (
                len(self.configurations) >= MAX_ENGINES or self.memory is not None
                and need + sum(c.kv_bytes for c in self.configurations.values()) > self.memory):
            idle = next((c for c in self.configurations.values() if not c.jobs), None)
            if idle is None:
                return False
            self.close_configuration(idle)
        return True

    def open(self, key: RescueConfig) -> Configuration:
        """The engine of settings `key`, its contexts made; a PRM of its own (a sibling on the same backbone) when
        another engine holds the models' own, as two engines cannot share a PRM's slots."""
        models = self.models
        shared = isinstance(models.prm, PRM) and any(c.prm is None for c in self.configurations.values())
        prm = models.prm.sibling() if shared else None
        rescue = Rescue(key, models.base, models.helper, prm or models.prm, prompt_tokens_max=self.prompt_tokens_max,
                        concurrency=self.concurrency)
        self.metrics.engines = len(self.configurations) + 1
        return Configuration(key, rescue, self.kv_bytes(key), prm)

    def close_configuration(self, configuration: Configuration) -> None:
        del self.configurations[configuration.key]
        configuration.close()
        give_back_freed_heap()
        self.metrics.engines = len(self.configurations)

    def turn(self, configuration: Configuration) -> None:
        """One turn of each of the engine's lanes. A failure in it (a shared decode) fails the engine's requests and
        closes it: its slots hold half a round, so the next requests of its settings start on fresh contexts."""
        try:
            for job, trajectory, error in configuration.rescue.turns(
                    configuration.handed(), configuration.flying, lambda j: j.problem, self.on_step,
                    lambda j: j.config, Job.stop_reason):
                configuration.jobs.discard(job)
                self.finished(job, trajectory, error)
            progress = configuration.rescue.progress(configuration.flying)
            with self.cond:
                for job, state in progress:
                    job.progress = state
        except Exception as exc:  # noqa: BLE001 - the engine failed mid-round: its requests get a 500
            failed = configuration.jobs
            with self.cond:
                self.running -= failed
                self.metrics.in_flight = len(self.running)
            for job in failed:
                job.send("error", (500, f"the engine failed: {exc}"))
            self.close_configuration(configuration)

    def refuse(self, key: RescueConfig, message: str) -> None:
        """Every queued request of configuration `key` gets a 500 with `message`; the others wait on."""
        with self.cond:
            refused = [j for j in self.pending if j.engine_key == key]
            self.pending = deque(j for j in self.pending if j.engine_key != key)
            self.metrics.queued = len(self.pending)
        for job in refused:
            job.send("error", (500, message))

    def on_step(self, job: Job, step: Step) -> None:
        if job.finish or job.cancelled:
            return
        text = job.text + step.text
        cut = min((i for i in (text.find(s) for s in job.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, job.finish = text[:cut], "stop_sequence"
        delta, job.text = text[len(job.text):], text
        job.tokens += step_tokens(step)
        if job.tokens >= job.max_tokens and not job.finish:
            job.finish = "max_tokens"
        if job.first_step is None:
            job.first_step = time.perf_counter()
        job.send("step", {"text": delta, "source": step.source, "score": step.score, "round": step.round})

    def finished(self, job: Job, trajectory: Trajectory, error: str | None) -> None:
        with self.cond:
            self.running.discard(job)
            self.metrics.in_flight = len(self.running)
        self.metrics.finished(trajectory)
        if job.cancelled:
            self.metrics.cancelled += 1
            return
        if error and not job.finish:
            job.send("error", (500, error))
            return
        stop = job.finish or trajectory.stop  # finish_reason follows from it: the two always agree
        job.send("done", {"finish_reason": "length" if stop in LENGTH_STOPS else "stop", "answer": trajectory.answer,
                          "stop": stop, "usage": {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.tokens,
                                                  "total_tokens": job.prompt_tokens + job.tokens,
                                                  "base_tokens": trajectory.tokens.get("base", 0),
                                                  "helper_tokens": trajectory.tokens.get("helper", 0)}})
