"""The server's counters, rendered in Prometheus' text exposition format for /metrics."""

from __future__ import annotations

import threading
from collections import Counter

from ..rescue import Trajectory

SIDES = ("base", "helper")


class Metrics:
    """Written by the engine thread and the app, read by /metrics: one lock around all of it."""

    def __init__(self, model_names: dict[str, str]) -> None:
        self.model_names = model_names  # side -> model file name, the `model` label
        self.lock = threading.Lock()
        self.in_flight = 0
        self.queued = 0
        self.responses: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.tokens: Counter[str] = Counter()  # side -> tokens generated
        self.llama_seconds: Counter[str] = Counter()  # side -> seconds inside llama.cpp
        self.prm_seconds = 0.0
        self.evictions = 0
        self.early_exits = 0  # base candidates the detector killed
        self.steps = 0
        self.cancelled = 0  # requests whose client left before they finished
        self.engines = 0  # engines alive (serve/engine.py), each with the contexts of one configuration of settings

    def respond(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.responses[(endpoint, status)] += 1

    def finished(self, trajectory: Trajectory) -> None:
        timings = trajectory.timings
        with self.lock:
            for side in SIDES:
                self.tokens[side] += trajectory.tokens.get(side, 0)
                self.llama_seconds[side] += timings.get(f"llama_{side}", 0.0)
            self.prm_seconds += timings.get("prm", 0.0)
            self.evictions += (trajectory.evictions or {}).get("evictions", 0)
            self.early_exits += trajectory.killed
            self.steps += trajectory.n_steps

    def render(self) -> str:
        with self.lock:
            lines = [
                "# HELP kvrescue_requests_in_flight Requests holding an engine slot.",
                "# TYPE kvrescue_requests_in_flight gauge",
                f"kvrescue_requests_in_flight {self.in_flight}",
                "# HELP kvrescue_requests_queued Requests waiting for an engine slot.",
                "# TYPE kvrescue_requests_queued gauge",
                f"kvrescue_requests_queued {self.queued}",
                "# HELP kvrescue_engines Engines alive, each holding the contexts of one configuration of settings.",
                "# TYPE kvrescue_engines gauge",
                f"kvrescue_engines {self.engines}",
                "# HELP kvrescue_responses_total Responses by endpoint and HTTP status.",
                "# TYPE kvrescue_responses_total counter",
                *(f'kvrescue_responses_total{{endpoint="{e}",status="{s}"}} {n}'
                  for (e, s), n in sorted(self.responses.items())),
                "# HELP kvrescue_tokens_total Tokens generated (candidates included) by each model.",
                "# TYPE kvrescue_tokens_total counter",
                *(f'kvrescue_tokens_total{{side="{side}",model="{name}"}} {self.tokens[side]}'
                  for side, name in self.model_names.items()),
                "# HELP kvrescue_llama_seconds_total Seconds inside llama.cpp, by model.",
                "# TYPE kvrescue_llama_seconds_total counter",
                *(f'kvrescue_llama_seconds_total{{side="{side}",model="{name}"}} {self.llama_seconds[side]:.6f}'
                  for side, name in self.model_names.items()),
                "# HELP kvrescue_tokens_per_second Tokens per second inside llama.cpp, by model, since the start.",
                "# TYPE kvrescue_tokens_per_second gauge",
                *(f'kvrescue_tokens_per_second{{side="{side}",model="{name}"}} '
                  f'{self.tokens[side] / self.llama_seconds[side] if self.llama_seconds[side] else 0.0:.3f}'
                  for side, name in self.model_names.items()),
                "# HELP kvrescue_prm_seconds_total Seconds the PRM spent scoring.",
                "# TYPE kvrescue_prm_seconds_total counter",
                f"kvrescue_prm_seconds_total {self.prm_seconds:.6f}",
                "# HELP kvrescue_evictions_total Evictions in the base's KV cache.",
                "# TYPE kvrescue_evictions_total counter",
                f"kvrescue_evictions_total {self.evictions}",
                "# HELP kvrescue_early_exits_total Base candidates the detector killed early.",
                "# TYPE kvrescue_early_exits_total counter",
                f"kvrescue_early_exits_total {self.early_exits}",
                "# HELP kvrescue_steps_total Steps committed.",
                "# TYPE kvrescue_steps_total counter",
                f"kvrescue_steps_total {self.steps}",
                "# HELP kvrescue_requests_cancelled_total Requests whose client left before they finished.",
                "# TYPE kvrescue_requests_cancelled_total counter",
                f"kvrescue_requests_cancelled_total {self.cancelled}",
            ]
        return "\n".join(lines) + "\n"
