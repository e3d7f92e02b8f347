"""One configuration for every mode of the stepwise search (search-and-learn style)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..detect import DetectorParams
from ..errors import KVRescueError
from ..eviction import KVBudget

MODES = ("full", "bon", "helper", "kvrescue")
LLAMA_MAX_SEQ = 256  # sequences per llama.cpp context (LLAMA_MAX_SEQ in src/llama-cparams.h)
QWEN_MATH_COT = ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{{}}."
                 "<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n")


@dataclass(frozen=True)
class RescueConfig:
    mode: str = "kvrescue"
    n: int = 8  # candidates per model per round
    kv: KVBudget = field(default_factory=KVBudget)  # the base's budget in bon and kvrescue modes
    detector: DetectorParams = field(default_factory=DetectorParams)  # kvrescue mode, base candidates
    max_tokens: int = 4096  # trajectory length cap
    max_steps: int = 512
    max_step_tokens: int = 256  # a candidate is cut here and stays a candidate
    temperature: float = 0.7
    top_p: float = 0.8
    seed: int = 0
    prompt: str = QWEN_MATH_COT
    n_gpu_layers: int = 0
    flash_attn: str = "off"  # llama.cpp's CPU flash attention is slow on multi-sequence batches
    n_threads: int = 0  # llama.cpp threads; 0 = physical cores - 1 (runtime.default_threads)
    n_batch: int = 512
    kv_type: str = "f16"
    helper_ctx: int = 0  # helper (and full-KV base) context; 0 = exactly what the limits need

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise KVRescueError(f"unknown mode {self.mode!r}: use one of {', '.join(MODES)}")
        if self.n < 1:
            raise KVRescueError(f"N must be at least 1 (got {self.n}): it is the number of candidates per model per round")
        sides = int(self.uses_base) + int(self.uses_helper)
        if self.candidates_per_round >= LLAMA_MAX_SEQ:
            raise KVRescueError(f"N={self.n} does not fit: a llama.cpp context holds {LLAMA_MAX_SEQ} sequences, one "
                                f"for the trajectory and {sides} x N for the candidates (the PRM scores them all at "
                                f"once); the largest N in {self.mode} mode is {(LLAMA_MAX_SEQ - 1) // sides}")
        if self.max_step_tokens < 1 or self.max_tokens < 1 or self.max_steps < 1:
            raise KVRescueError("max_tokens, max_steps and max_step_tokens must be positive")
        if "{problem}" not in self.prompt:
            raise KVRescueError("the prompt template must contain {problem}")

    @property
    def uses_base(self) -> bool:
        return self.mode != "helper"

    @property
    def uses_helper(self) -> bool:
        return self.mode in ("helper", "kvrescue")

    @property
    def evicts(self) -> bool:
        return self.mode in ("bon", "kvrescue")

    @property
    def candidates_per_round(self) -> int:
        return self.n * (int(self.uses_base) + int(self.uses_helper))

    def as_dict(self) -> dict:
        return asdict(self)
