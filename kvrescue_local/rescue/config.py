"""One configuration for every mode of the stepwise search (search-and-learn style).

The dataclass defaults are the project's defaults: the command line takes its defaults from here
(and from a preset's recipe), never from literals of its own. Context sizes are derived here too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field

from ..detect import DetectorParams
from ..errors import KVRescueError, SettingError
from ..eviction import KVBudget
from ..prm.formats import QWEN_MATH_CHAT
from ..runtime import DEFAULT_FLASH_ATTN
from ..runtime.context import check_cache_types
from .record import Mode

# how a round's winner is chosen among its survivors: the PRM's favourite; at random (what the PRM's choice is worth);
# the base's favourite unless the PRM prefers the helper's by more than helper_margin ("base-first"); the helper's
# favourite unless the PRM prefers the base's by more than base_margin ("helper-first"); the survivor most probably
# right by each source's calibrated reward ("calibrated"); by the regime ("regime"): weak_base_choice at budgets up to
# judge_max_budget, where the evicted base writes worse steps than the helper, base-first above
CHOICES = ("prm", "random", "base-first", "helper-first", "calibrated", "regime")
SCORED_CHOICES = ("prm", "base-first", "helper-first", "calibrated", "regime")  # the choices a PRM scores the survivors for
WEAK_BASE_CHOICES = ("prm", "calibrated", "helper-first")  # the regime's rule where the base is the weaker writer
RULE_SETTINGS = {"pick_margin": ("prm", "base-first", "helper-first", "regime"), "helper_margin": ("base-first", "regime"),
                 "base_margin": ("helper-first", "regime"), "calibration": ("calibrated", "regime"),
                 "judge_max_budget": ("regime",), "weak_base_choice": ("regime",)}
SOME_SETTINGS = (*RULE_SETTINGS, "helper_tau_entropy", "helper_tau_compression")  # RescueConfig.records
IDENTITY_CALIBRATION = (1.0, 0.0, 1.0, 0.0)  # base slope, base bias, helper slope, helper bias: P = sigmoid(slope·r + bias)
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
    # the round's winner: the PRM's favourite, or "random": a survivor drawn by a seed of (seed, problem, round),
    # the baseline that says what the PRM's choice is worth
    choice: str = "prm"
    # with choice "prm": the winner is the first survivor, in the round's order (the base's candidates, then the
    # helper's), whose score is within pick_margin of the best; 0: the best. A margin above the layout noise makes
    # the pick of near-equal steps independent of what shared their decodes (docs/prm.md)
    pick_margin: float = 0.0
    # with choice "base-first": the helper's best survivor is committed over the base's best only when its reward is
    # higher by more than this (or no base candidate survives); 1: only then, as a reward lies in [0, 1]
    helper_margin: float = 1.0
    # with choice "helper-first", its mirror: the base's best survivor is committed over the helper's best only when its
    # reward is higher by more than this (or no helper candidate survives); 1: only then
    base_margin: float = 1.0
    # with choice "calibrated": each source's reward r mapped to P(step right) = sigmoid(slope·r + bias), fitted on
    # the labelled steps of training problems (prmtrain/commit.py), as IDENTITY_CALIBRATION's four numbers
    calibration: tuple[float, float, float, float] = IDENTITY_CALIBRATION
    # with choice "regime": the largest base budget at which weak_base_choice commits; above it the rule is
    # base-first. Fitted on training problems (prmtrain/regime.py): the budgets where evicted best-of-N solved fewer of
    # them than the helper alone. 0: base-first at every budget, the base's own trajectory until a kill
    judge_max_budget: int = 0
    # with choice "regime", the rule where the base is the weaker writer: the PRM's favourite ("prm", as every regime
    # row before this setting), calibrated per source ("calibrated"), or the helper's step first ("helper-first")
    # where the PRM is not known to rank the dataset's steps or not calibrated on them (prmtrain/regime.py)
    weak_base_choice: str = "prm"
    # kvrescue mode: the detector's thresholds for the helper's candidates (its windows are the base's); 0 and 0: the
    # helper is not watched, the default, as in every row written before these settings. A round whose candidates
    # all die commits the least degenerate (Step.fallback)
    helper_tau_entropy: float = 0.0
    helper_tau_compression: float = 0.0
    # rounds with a choice: a survivor whose step states false arithmetic ("15 × 0.08 = 12", rescue/arithmetic.py)
    # is set aside while another survivor states none, before the rule chooses; fitted per dataset on training rows
    # (prmtrain/commit.py). A configuration of its own in a sweep (its rows' config key ends "-arith")
    check_arithmetic: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        object.__setattr__(self, "calibration", tuple(float(x) for x in self.calibration))
        if len(self.calibration) != 4 or not all(math.isfinite(x) for x in self.calibration):
            raise KVRescueError(f"calibration takes four finite numbers (base slope, base bias, helper slope, helper "
                                f"bias), not {self.calibration}: refit it with perf/fit_commit.py")
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
        if not 0 <= self.pick_margin < 1:
            raise KVRescueError(f"--pick-margin must be in [0, 1), a difference of rewards (got {self.pick_margin})")
        if (self.helper_tau_entropy, self.helper_tau_compression) != (0.0, 0.0):  # used in kvrescue mode only
            if self.helper_tau_entropy <= 0 or not 0 < self.helper_tau_compression < 1.5:
                raise KVRescueError(f"the helper's detector takes both thresholds: --helper-tau-entropy > 0 (nats) and "
                                    f"--helper-tau-compression in (0, 1.5) (got {self.helper_tau_entropy}, "
                                    f"{self.helper_tau_compression}); 0 and 0 leave the helper unwatched")
        for option, margin in (("--helper-margin", self.helper_margin), ("--base-margin", self.base_margin)):
            if not 0 <= margin <= 1:
                raise KVRescueError(f"{option} must be in [0, 1], a difference of rewards (got {margin})")
        if not isinstance(self.check_arithmetic, bool):
            raise KVRescueError(f"check_arithmetic is true or false, not {self.check_arithmetic!r}: refit the preset's "
                                "commit.json with perf/fit_commit.py")
        if self.weak_base_choice not in WEAK_BASE_CHOICES:
            raise KVRescueError(f"unknown weak-base choice {self.weak_base_choice!r}: use one of "
                                f"{', '.join(WEAK_BASE_CHOICES)}")
        if self.judge_max_budget < 0:
            raise KVRescueError(f"--judge-max-budget must be 0 or more, a KV budget (got {self.judge_max_budget})")
        if self.choice not in CHOICES:
            raise KVRescueError(f"unknown choice {self.choice!r}: use one of {', '.join(CHOICES)}")
        if "{problem}" not in self.prompt:
            raise KVRescueError("the prompt template must contain {problem}")
        check_cache_types(self.cache_type_k, self.cache_type_v, self.flash_attn, "-ctk", "-ctv")
        check_cache_types(self.helper_cache_type_k, self.helper_cache_type_v, self.flash_attn, "-ctkh", "-ctvh")

    @property
    def rule(self) -> str:
        """The commit rule the rounds follow: the choice, with "regime" resolved by the base's budget."""
        if self.choice != "regime":
            return self.choice
        return self.weak_base_choice if self.kv.budget <= self.judge_max_budget else "base-first"

    @property
    def helper_detector(self) -> DetectorParams | None:
        """The detector's settings for the helper's candidates; None when the helper is not watched."""
        if (self.helper_tau_entropy, self.helper_tau_compression) == (0.0, 0.0):
            return None
        return dataclasses.replace(self.detector, tau_entropy=self.helper_tau_entropy,
                                   tau_compression=self.helper_tau_compression)

    def records(self, setting: str) -> bool:
        """Whether rows of this configuration record a setting that only some configurations use (SOME_SETTINGS):
        a rule's parameters where a PRM scores for that rule, the helper's thresholds where a detector runs."""
        if setting in ("helper_tau_entropy", "helper_tau_compression"):
            return self.mode.detects
        return self.needs_prm and self.choice in RULE_SETTINGS[setting]

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
        """A PRM chooses: rounds have more than one candidate and the choice is the PRM's."""
        return self.candidates_per_round > 1 and self.choice in SCORED_CHOICES

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
        out["calibration"] = list(self.calibration)  # as JSON reads it back
        return out

    def with_overrides(self, overrides: dict) -> RescueConfig:
        """This config with some fields replaced; `kv` and `detector` take dicts of their own fields."""
        nested = {"kv": self.kv, "detector": self.detector}
        changes = {k: dataclasses.replace(nested[k], **v) if k in nested else v for k, v in overrides.items()}
        unknown = [k for k in changes if k not in {f.name for f in dataclasses.fields(self)}]
        if unknown:
            raise KVRescueError(f"unknown setting {', '.join(unknown)}: a recipe sets fields of RescueConfig")
        return dataclasses.replace(self, **changes)
