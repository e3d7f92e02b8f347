"""The bridge between HTTP requests and the multi-problem engine.

One thread owns the models and runs Rescue.run over a feeder that hands it queued requests whenever a
slot is free (continuous batching). Requests of one engine configuration (mode, N, budget, policy,
rule, temperature, top-p) share a run; each carries its own seed, so its trajectory is the one `solve`
gives with that seed. When the oldest waiting request needs another configuration, the run stops taking
new requests, finishes those in flight and the next run builds that configuration's contexts. Events go
back to each request's asyncio queue through its event loop; a request cancelled by its client (or done
by a stop sequence or its max_tokens) leaves its slot before the next round. A failure inside a round (the
shared decode) fails the requests in that round; one in a problem's own work fails that request alone
(Rescue.run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import KVRescueError, SettingError
from ..rescue import Models, Rescue, RescueConfig, Step, Trajectory
from ..settings import request_name
from .metrics import Metrics

LENGTH_STOPS = ("max_tokens", "max_steps")  # the `kvrescue.stop`s whose finish_reason is "length"


class QueueFull(KVRescueError):
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
        return dataclasses.replace(self.config, seed=0)

    def stop_reason(self) -> str | None:
        if self.cancelled:
            return "the client went away"
        return f"finished ({self.finish})" if self.finish else None


def step_tokens(step: Step) -> int:
    """The committed step's tokens: those of the candidate it is."""
    return next(c.tokens for c in step.candidates if c.side == step.source and c.text == step.text)


class Feeder:
    """The queued requests of one configuration, for Rescue.run: empty for now is not exhausted (run asks again
    when a slot is free), and it stops giving once the oldest waiting request needs another configuration."""

    def __init__(self, engine: Engine, key: RescueConfig) -> None:
        self.engine, self.key = engine, key

    def __iter__(self):
        return self

    def __next__(self) -> Job:
        engine = self.engine
        with engine.cond:
            while not engine.closing and engine.pending and engine.pending[0].engine_key == self.key:
                job = engine.pending.popleft()
                engine.metrics.queued = len(engine.pending)
                if job.cancelled:
                    engine.metrics.cancelled += 1
                    continue
                engine.running.add(job)
                engine.metrics.in_flight = len(engine.running)
                return job
        raise StopIteration


class Engine:
    def __init__(self, models: Models, concurrency: int, prompt_tokens_max: int, max_queue: int,
                 metrics: Metrics) -> None:
        self.models = models
        self.concurrency = concurrency
        self.prompt_tokens_max = prompt_tokens_max
        self.max_queue = max_queue
        self.metrics = metrics
        self.cond = threading.Condition()
        self.pending: deque[Job] = deque()
        self.running: set[Job] = set()
        self.closing = False
        self.thread = threading.Thread(target=self.serve, name="kvrescue-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        with self.cond:
            self.closing = True
            for job in self.running:
                job.cancelled = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join()

    def submit(self, job: Job) -> None:
        with self.cond:
            if len(self.pending) + len(self.running) >= self.concurrency + self.max_queue:
                raise QueueFull(f"{len(self.running)} requests are running and {len(self.pending)} are queued, the "
                                f"most this server takes (--concurrency {self.concurrency}, --max-queue "
                                f"{self.max_queue}): retry later")
            self.pending.append(job)
            self.metrics.queued = len(self.pending)
            self.cond.notify_all()

    # --- the engine thread -------------------------------------------------
    def serve(self) -> None:
        rescue: Rescue | None = None
        while True:
            with self.cond:
                while not self.pending and not self.closing:
                    self.cond.wait()
                if self.closing:
                    return
                key = self.pending[0].engine_key
            if rescue is None or rescue.config != key:
                rescue = None  # its contexts go before the next configuration's are made
                try:
                    rescue = Rescue(key, self.models.base, self.models.helper, self.models.prm,
                                    prompt_tokens_max=self.prompt_tokens_max, concurrency=self.concurrency)
                except KVRescueError as exc:  # a setting named as a request names it
                    said = exc.worded(request_name) if isinstance(exc, SettingError) else str(exc)
                    self.refuse(key, f"the engine cannot run these settings: {said}")
                    continue
            try:
                for job, trajectory, error in rescue.run(Feeder(self, key), text=lambda j: j.problem,
                                                         on_step=self.on_step, seed_of=lambda j: j.config.seed,
                                                         stop_of=Job.stop_reason):
                    self.finished(job, trajectory, error)
            except Exception as exc:  # noqa: BLE001 - the engine failed mid-round: its requests get a 500
                with self.cond:
                    failed, self.running = list(self.running), set()
                    self.metrics.in_flight = 0
                for job in failed:
                    job.send("error", (500, f"the engine failed: {exc}"))
                rescue = None  # its slots hold half a round: the next requests start on fresh contexts

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
