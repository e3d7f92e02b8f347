"""Per-sequence llama.cpp sampler chains."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import KVRescueError
from .lib import llama


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise KVRescueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise KVRescueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise KVRescueError(f"min_p must be in [0, 1), got {self.min_p}")


class Sampler:
    """A llama.cpp sampler chain: top-k, top-p, min-p, temperature, then a seeded draw (greedy at temperature 0)."""

    def __init__(self, params: SamplingParams) -> None:
        low = llama()
        self.params = params
        self.handle = low.llama_sampler_chain_init(low.llama_sampler_chain_default_params())
        if params.temperature == 0:
            low.llama_sampler_chain_add(self.handle, low.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            low.llama_sampler_chain_add(self.handle, low.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1:
            low.llama_sampler_chain_add(self.handle, low.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0:
            low.llama_sampler_chain_add(self.handle, low.llama_sampler_init_min_p(params.min_p, 1))
        low.llama_sampler_chain_add(self.handle, low.llama_sampler_init_temp(params.temperature))
        low.llama_sampler_chain_add(self.handle, low.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))

    def sample(self, context, row: int) -> int:
        """Draw a token from batch row `row` of context's last decode (the chain accepts it).

        The time spent is added to context.sample_seconds (llama.cpp's share of the work)."""
        started = time.perf_counter()
        token = llama().llama_sampler_sample(self.handle, context.handle, row)
        context.sample_seconds += time.perf_counter() - started
        return token

    def free(self) -> None:
        if getattr(self, "handle", None):
            llama().llama_sampler_free(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.free()
