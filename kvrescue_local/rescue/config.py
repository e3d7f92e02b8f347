"""One configuration for every mode of the stepwise search (search-and-learn style).

The dataclass defaults are the project's defaults: the command line takes its defaults from here
(and from a preset's recipe), never from literals of its own. Context sizes are derived here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from ..detect import DetectorParams
from ..errors import KVRescueError, SettingError
from ..eviction import KVBudget
from ..prm.formats import QWEN_MATH_CHAT
from ..runtime import DEFAULT_FLASH_ATTN
from ..runtime.context import check_cache_types
from .record import Mode
from .rules import Judge, Rule, parse_rule

SOME_SETTINGS = ("rule", "helper_tau_entropy", "helper_tau_compression")  # RescueConfig.records
LLAMA_MAX_SEQ = 256  # sequences per llama.cpp context (LLAMA_MAX_SEQ in src/llama-cparams.h)
QWEN_MATH_COT = QWEN_MATH_CHAT  # the real presets' chat format (Qwen2.5-Math's chain-of-thought prompt)
PRM_TEMPLATE_TOKENS = 256  # the PRM's chat template around the problem


def cache_fields(type_k: str, type_v: str) -> dict:
    """The RescueConfig fields that give the base and the helper these K and V cache types (what -ctk/-ctv do)."""
    return {"cache_type_k": type_k, "cache_type_v": type_v, "helper_cache_type_k": type_k, "helper_cache_type_v": type_v}


@dataclass(frozen=True)
class RescueConfig:
    mode: Mode = Mode.KVRESCUE
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
    flash_attn: str = DEFAULT_FLASH_ATTN
    n_threads: int = 0  # llama.cpp threads; 0 = physical cores - 1 (runtime.default_threads)
    n_batch: int = 512
    # KV cache types, llama.cpp's names (runtime.context.CACHE_TYPES): -ctk/-ctv set both sides, -ctkh/-ctvh the helper's
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    helper_cache_type_k: str = "f16"
    helper_cache_type_v: str = "f16"
    helper_ctx: int = 0  # helper (and full-KV base) context; 0 = exactly what the limits need
    # how a round's winner is chosen among its survivors: a commit rule (rescue/rules/), or its spec
    rule: Rule = field(default_factory=Judge)
    # kvrescue mode: the detector's thresholds for the helper's candidates (its windows are the base's); 0 and 0: the
    # helper is not watched, the default, as in every row written before these settings. A round whose candidates
    # all die commits the least degenerate (Step.fallback)
    helper_tau_entropy: float = 0.0
    helper_tau_compression: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        if not isinstance(self.rule, Rule):
            object.__setattr__(self, "rule", parse_rule(self.rule, "rule"))
        if self.n < 1:
            raise SettingError(f"{{n}} must be at least 1 (got {self.n}): it is the number of candidates per model per "
                               "round", "n")
        if self.candidates_per_round >= LLAMA_MAX_SEQ:
            raise SettingError(f"{{n}} {self.n} does not fit: a llama.cpp context holds {LLAMA_MAX_SEQ} sequences, one "
                               f"for the trajectory and {self.mode.sides} x N for the candidates (the PRM scores them all "
                               f"at once); the largest N in {self.mode} mode is {(LLAMA_MAX_SEQ - 1) // self.mode.sides}",
                               "n")
        if self.max_step_tokens < 1 or self.max_tokens < 1 or self.max_steps < 1:
            raise KVRescueError("max_tokens, max_steps and max_step_tokens must be positive")
        if (self.helper_tau_entropy, self.helper_tau_compression) != (0.0, 0.0):  # used in kvrescue mode only
            if self.helper_tau_entropy <= 0 or not 0 < self.helper_tau_compression < 1.5:
                raise KVRescueError(f"the helper's detector takes both thresholds: --helper-tau-entropy > 0 (nats) and "
                                    f"--helper-tau-compression in (0, 1.5) (got {self.helper_tau_entropy}, "
                                    f"{self.helper_tau_compression}); 0 and 0 leave the helper unwatched")
        if "{problem}" not in self.prompt:
            raise KVRescueError("the prompt template must contain {problem}")
        check_cache_types(self.cache_type_k, self.cache_type_v, self.flash_attn, "-ctk", "-ctv")
        check_cache_types(self.helper_cache_type_k, self.helper_cache_type_v, self.flash_attn, "-ctkh", "-ctvh")

    @property
    def commit_rule(self) -> Rule:
        """The commit rule the rounds follow: the rule, a composition by budget resolved at the base's budget."""
        return self.rule.at_budget(self.kv.budget)

    @property
    def helper_detector(self) -> DetectorParams | None:
        """The detector's settings for the helper's candidates; None when the helper is not watched."""
        if (self.helper_tau_entropy, self.helper_tau_compression) == (0.0, 0.0):
            return None
        return dataclasses.replace(self.detector, tau_entropy=self.helper_tau_entropy,
                                   tau_compression=self.helper_tau_compression)

    def records(self, setting: str) -> bool:
        """Whether rows of this configuration record a setting that only some configurations use (SOME_SETTINGS):
        the rule's spec where a judge scores for it, the helper's thresholds where a detector runs."""
        if setting in ("helper_tau_entropy", "helper_tau_compression"):
            return self.mode.detects
        return self.needs_prm

    def cache_types(self, side: str) -> tuple[str, str]:
        """(K, V) cache types of a side's contexts ("base" or "helper")."""
        if side == "helper":
            return self.helper_cache_type_k, self.helper_cache_type_v
        return self.cache_type_k, self.cache_type_v

    @property
    def uses_base(self) -> bool:
        return self.mode.uses_base

    @property
    def uses_helper(self) -> bool:
        return self.mode.uses_helper

    @property
    def evicts(self) -> bool:
        return self.mode.evicts

    @property
    def candidates_per_round(self) -> int:
        return self.n * self.mode.sides

    @property
    def needs_prm(self) -> bool:
        """A judge scores: rounds have more than one candidate and the rule in force needs one."""
        return self.candidates_per_round > 1 and self.commit_rule.needs_judge

    def full_context(self, prompt_tokens: int) -> int:
        """Cells of a context that never evicts (the helper, the full-KV base): the prompt, the whole
        trajectory, one round of N candidates and one batch."""
        needed = prompt_tokens + self.max_tokens + self.n * self.max_step_tokens + self.n_batch
        if self.helper_ctx and self.helper_ctx < needed:
            raise KVRescueError(f"helper context {self.helper_ctx} cannot hold the prompt ({prompt_tokens}) + "
                                f"max length ({self.max_tokens}) + {self.n} candidates of "
                                f"{self.max_step_tokens} tokens: it needs {needed}; raise it or lower --max-tokens")
        return self.helper_ctx or needed

    def context_cells(self, side: str, slots: int, prompt_tokens: int) -> int:
        """Cells of a side's context for `slots` problems at once: the evicted base's sequences each up to budget +
        buffer, otherwise every problem's full context; one decode batch on top."""
        if side == "base" and self.evicts:
            return self.kv.context_cells(slots * (self.n + 1), self.n_batch)
        return slots * (self.full_context(prompt_tokens) - self.n_batch) + self.n_batch

    def scoring_cells(self, slots: int) -> int:
        """Cells the helper's context adds for `--prm helper` (judge.py): every problem's N base candidates, read
        beside the helper's own; none when a round has nothing to choose between."""
        return slots * self.n * self.max_step_tokens if self.candidates_per_round > 1 else 0

    def largest_concurrency(self) -> int:
        """Most problems at once that llama.cpp's sequences allow: N + 1 per problem on a model, and on the PRM one
        per problem beside a round's candidates; the last decode of a round starting holds one token per problem."""
        return min(LLAMA_MAX_SEQ // (self.n + 1), LLAMA_MAX_SEQ - self.candidates_per_round, self.n_batch)

    def check_concurrency(self, concurrency: int) -> None:
        largest = self.largest_concurrency()
        if not 1 <= concurrency <= largest:
            raise KVRescueError(f"concurrency {concurrency} does not fit: {self.mode} mode with N={self.n} runs at "
                                f"most {largest} problems at once ({self.n + 1} of llama.cpp's {LLAMA_MAX_SEQ} "
                                f"sequences each); use --concurrency 1 to {largest}")

    def prm_context(self, problem_bytes: int) -> int:
        """The PRM's cells: its template, the problem (a token covers at least one byte, so the UTF-8
        length bounds its tokens), the trajectory and one batch of candidates."""
        return problem_bytes + PRM_TEMPLATE_TOKENS + self.max_tokens + self.n_batch

    def as_dict(self) -> dict:
        out = asdict(self)
        out["mode"] = self.mode.value
        out["rule"] = self.rule.spec
        return out

    def with_overrides(self, overrides: dict) -> RescueConfig:
        """This config with some fields replaced; `kv` and `detector` take dicts of their own fields."""
        nested = {"kv": self.kv, "detector": self.detector}
        changes = {k: dataclasses.replace(nested[k], **v) if k in nested else v for k, v in overrides.items()}
        unknown = [k for k in changes if k not in {f.name for f in dataclasses.fields(self)}]
        if unknown:
            raise KVRescueError(f"unknown setting {', '.join(unknown)}: a recipe sets fields of RescueConfig")
        return dataclasses.replace(self, **changes)
