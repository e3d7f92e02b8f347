"""The settings of a run, each declared once (SETTINGS): the RescueConfig field it sets, its command-line flags, the
field of a served request that sets it (or none: the server's alone), its help, its kind of value (a click type:
the range), its default (RescueConfig's, or the preset's) and the group its help is shown in. cli/ makes the options
of `solve`, `bench run` and `serve` from it, serve/ the request model, and compose.py maps options to fields by it.
A request's field is checked by its setting's kind (`checked`), so a request cannot ask what the command line
refuses; a refusal that names settings (errors.SettingError) is worded by each interface in its own names."""

from __future__ import annotations

import math
import os
import string
from dataclasses import dataclass

import click

from .errors import KVRescueError
from .eviction import POLICY_HELP, policy_specs
from .files import check_encodable
from .rescue import MODES, RescueConfig
from .rescue.rules import parse_rule, rules_help
from .runtime.context import CACHE_TYPES

SEED = click.IntRange(0, 2 ** 32 - 1)  # llama.cpp's samplers take an unsigned 32-bit seed
POSITIVE = click.IntRange(min=1)
NON_NEGATIVE = click.IntRange(min=0)
MAX_THREADS = os.cpu_count() or 1  # more llama.cpp threads than CPUs spin against each other: a run stalls
THREADS = click.IntRange(0, MAX_THREADS)
MODE = click.Choice(MODES)


class Finite(click.ParamType):
    """A finite float within [low, high] (an open end where low_open / high_open): NaN and infinity are refused,
    as they would silently switch a check off or write a JSON file that is not JSON."""

    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None, low_open: bool = False,
                 high_open: bool = False) -> None:
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open

    def range_text(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return " and ".join(parts)

    def convert(self, value, param, ctx) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number: give one {self.range_text() or 'that is finite'}", param, ctx)
        too_low = self.low is not None and (number <= self.low if self.low_open else number < self.low)
        too_high = self.high is not None and (number >= self.high if self.high_open else number > self.high)
        if too_low or too_high:
            self.fail(f"{number:g} is out of range: it must be {self.range_text()}", param, ctx)
        return number


TEMPERATURE = Finite(0)
TOP_P = Finite(0, 1, low_open=True)


class PolicySpecs(click.ParamType):
    """Eviction policy specs (one, or a comma-separated list where several): each known, its options valid and
    each option given once; a list names each spec once."""

    name = "policy"

    def __init__(self, several: bool) -> None:
        self.several = several

    def convert(self, value, param, ctx) -> str | list[str]:
        if isinstance(value, list):
            return value
        specs = policy_specs(str(value))  # its KVRescueError is the command's one Error: line
        if not self.several and len(specs) > 1:
            self.fail(f"{value!r} names {len(specs)} policies; give one here (bench run --policies takes several)",
                      param, ctx)
        for spec in specs:
            name, _, options = spec.partition(":")
            keys = [item.partition("=")[0].strip() for item in options.split(",") if item.strip()]
            twice = sorted({k for k in keys if keys.count(k) > 1})
            if twice:
                self.fail(f"{spec!r} sets {', '.join(twice)} more than once: give each option of {name} once",
                          param, ctx)
        repeated = sorted({s for s in specs if specs.count(s) > 1})
        if repeated:
            self.fail(f"{', '.join(repeated)} is given more than once: name each policy once", param, ctx)
        return specs if self.several else specs[0]


POLICY = PolicySpecs(several=False)


class PromptTemplate(click.ParamType):
    """A prompt template: {problem} where the problem goes and no other field ({{ and }} for literal braces)."""

    name = "template"

    def convert(self, value, param, ctx) -> str:
        try:  # it is written into every record: text that UTF-8 cannot encode is refused here, not after solving
            check_encodable(value, repr(value), "pass the template as UTF-8 text")
        except KVRescueError as exc:
            self.fail(str(exc), param, ctx)
        try:
            fields = [(field, spec, conversion) for _, field, spec, conversion in string.Formatter().parse(value)
                      if field is not None]
        except ValueError as exc:
            self.fail(f"{value!r} is not a template ({exc}): write {{{{ and }}}} for a literal brace", param, ctx)
        others = sorted({"{" + field + "}" for field, spec, conversion in fields
                         if (field, spec, conversion) != ("problem", "", None)})
        if others:
            self.fail(f"{value!r} holds {', '.join(others)}: the only field is {{problem}} (write {{{{ and }}}} for a "
                      "literal brace)", param, ctx)
        if not fields:
            self.fail(f"{value!r} has no field: it must contain {{problem}} where the problem goes", param, ctx)
        return value


class RuleSpec(click.ParamType):
    """A commit rule's spec (rescue/rules/base.py), checked and written back canonically: its error lists the
    rules and their parameters."""

    name = "rule"

    def convert(self, value, param, ctx) -> str:
        return parse_rule(str(value)).spec  # its KVRescueError is the command's one Error: line


RULE = RuleSpec()


def checked(kind: click.ParamType, value):
    """`value` checked and converted by an option's type outside the command line (a served request's field): the
    server applies the very checks of the option that sets the field's default. A bad value raises ValueError with
    the option's message."""
    try:
        return kind.convert(value, None, None)
    except click.BadParameter as exc:
        raise ValueError(exc.message) from None
    except KVRescueError as exc:  # a policy spec's own check
        raise ValueError(str(exc)) from None


# the groups of the commands' help, in order (llama.cpp's own help shows its common options first, then one group
# each); an option outside SETTINGS is shown among the common ones unless its command says otherwise
GROUPS = ("common", "eviction", "sampling", "rule", "detector", "llama.cpp")
DEFAULTS = RescueConfig()


@dataclass(frozen=True)
class Setting:
    """One setting of a run. field: RescueConfig's ("kv.budget" for a nested one); flags: the command line's, the
    one its messages name it by first, or "--on/--off" for a switch; request: the served request's field that sets it
    (None: the server's alone, as -t, -ngl); json: the JSON type a request gives it (an int is a number too);
    default: the default's words where RescueConfig's value does not say it; name: the option's parameter name (the
    field's own by default); follows: the setting whose value it takes when it is not given; axis: the `bench run`
    option that sweeps it in its place there; values: the values it takes in words, where its kind does not say them
    (or says them per machine)."""

    field: str
    flags: tuple[str, ...]
    kind: click.ParamType | None
    help: str
    group: str
    request: str | None = None
    json: type = int
    default: str | None = None
    name: str | None = None
    follows: str | None = None
    axis: str | None = None
    values: str | None = None

    @property
    def param(self) -> str:
        return self.name or self.field.rpartition(".")[2]

    @property
    def switch(self) -> bool:
        return "/" in self.flags[0]

    @property
    def flag(self) -> str:
        """The flag that names it on the command line (a switch's "on" flag)."""
        return self.flags[0].split("/")[0]

    @property
    def default_value(self):
        value = DEFAULTS
        for part in self.field.split("."):
            value = getattr(value, part)
        return value

    @property
    def default_text(self) -> str:
        return self.default or f"the preset's, else {self.default_value}"


def cache_type_setting(field: str, flags: tuple[str, ...], help: str, **more) -> Setting:
    return Setting(field, flags, click.Choice(list(CACHE_TYPES)), help, "llama.cpp", json=str, **more)


# Options left unset (None) take the preset's recipe, else RescueConfig's defaults (compose.py)
SETTINGS = (
    Setting("mode", ("--mode",), MODE, "the search: evicted base and full helper (kvrescue), the "
            "full-KV base alone (full), evicted best-of-N (bon), the helper alone (helper)", "common",
            request="mode", json=str, axis="--modes"),
    Setting("n", ("-n", "--n"), POSITIVE, "candidates per model per round (serve: the most a request may ask)",
            "common", request="n", axis="--ns"),
    Setting("kv.budget", ("--budget",), POSITIVE, "base KV budget (entries kept)", "common", request="budget",
            axis="--budgets"),
    Setting("max_tokens", ("--max-tokens",), POSITIVE, "trajectory length cap (serve: the most a request may ask)",
            "common", request="max_tokens"),
    Setting("prompt", ("--prompt-template",), PromptTemplate(), "the chat prompt, with {problem} where the problem "
            "goes", "common", json=str, name="prompt_template", values="text with {problem}",
            default="the model's (preset or GGUF metadata), else Qwen2.5-Math's"),
    Setting("kv.policy", ("--policy",), POLICY, POLICY_HELP, "eviction", request="policy", json=str,
            axis="--policies", values="a policy spec"),
    Setting("kv.buffer", ("--buffer",), POSITIVE, "entries added before each eviction", "eviction"),
    Setting("kv.n_sink", ("--n-sink",), NON_NEGATIVE, "first entries always kept", "eviction",
            default="the preset's, else the policy's: streaming 4, the others 0"),
    Setting("kv.window", ("--window",), POSITIVE, "recent entries always kept", "eviction"),
    Setting("kv.protect_prompt", ("--protect-prompt/--evict-prompt",), None, "never evict the prompt", "eviction",
            json=bool),
    Setting("temperature", ("--temp",), TEMPERATURE, "sampling temperature", "sampling", request="temperature",
            json=float),
    Setting("top_p", ("--top-p",), TOP_P, "nucleus sampling's top-p", "sampling", request="top_p", json=float),
    Setting("seed", ("--seed", "-s"), SEED, "the run's seed (a request's: the trajectory solve --seed gives)",
            "sampling", request="seed"),
    Setting("max_steps", ("--max-steps",), POSITIVE, "committed steps at most", "sampling"),
    Setting("max_step_tokens", ("--max-step-tokens",), POSITIVE, "a candidate step's tokens at most (it is cut there)",
            "sampling"),
    Setting("rule", ("--rule",), RULE, "how a round's winner is chosen among its survivors, a rule spec "
            f"(docs/prm.md): {rules_help()}", "rule", request="rule", json=str, axis="--rule",
            default="the preset's for the dataset, else judge", values="a rule spec"),
    Setting("detector.tau_entropy", ("--tau-entropy",), Finite(0), "mean entropy (nats) above which a base "
            "candidate dies", "detector", json=float),
    Setting("detector.tau_compression", ("--tau-compression",), Finite(0), "zstd ratio below which a base candidate "
            "dies", "detector", json=float),
    Setting("helper_tau_entropy", ("--helper-tau-entropy",), Finite(0), "mean entropy (nats) above which a helper "
            "candidate dies (0 and 0: the helper is not watched)", "detector", json=float),
    Setting("helper_tau_compression", ("--helper-tau-compression",), Finite(0), "zstd ratio below which a helper "
            "candidate dies", "detector", json=float),
    Setting("n_gpu_layers", ("--n-gpu-layers", "-ngl"), click.IntRange(min=-1), "layers offloaded to the GPU (-1: "
            "all)", "llama.cpp"),
    Setting("n_threads", ("--threads", "-t"), THREADS, "llama.cpp threads, at most the machine's CPUs (0: "
            "KVRESCUE_THREADS, else physical cores - 1: one core stays free for other work)", "llama.cpp",
            name="threads", values="an integer >= 0 and <= the CPUs"),
    Setting("flash_attn", ("--flash-attn", "-fa"), click.Choice(["on", "off", "auto"]), "flash attention",
            "llama.cpp", json=str),
    # llama.cpp's names: -ctk/-ctv for the model, and for the second model the draft model's -ctkd/-ctvd, h for helper
    cache_type_setting("cache_type_k", ("--cache-type-k", "-ctk"), "KV cache type for K, base and helper "
                       "(llama.cpp's -ctk)"),
    cache_type_setting("cache_type_v", ("--cache-type-v", "-ctv"), "KV cache type for V, base and helper "
                       "(llama.cpp's -ctv; a quantized V needs -fa on)"),
    cache_type_setting("helper_cache_type_k", ("--cache-type-k-helper", "-ctkh"), "the helper's K cache type, as "
                       "llama.cpp's -ctkd sets its draft model's", default="-ctk's", name="cache_type_k_helper",
                       follows="cache_type_k"),
    cache_type_setting("helper_cache_type_v", ("--cache-type-v-helper", "-ctvh"), "the helper's V cache type, as "
                       "llama.cpp's -ctvd sets its draft model's", default="-ctv's", name="cache_type_v_helper",
                       follows="cache_type_v"),
)
BY_FIELD = {setting.field: setting for setting in SETTINGS}


def config_overrides(values: dict) -> dict:
    """The RescueConfig fields that the given settings set, by their parameter names (None: not given; a setting that
    follows another takes that one's value): nested fields as dicts of their own ({"kv": {"budget": 64}})."""
    out: dict = {}
    for setting in SETTINGS:
        value = values.get(setting.param)
        if value is None and setting.follows:
            value = values.get(BY_FIELD[setting.follows].param)
        if value is None:
            continue
        group, _, name = setting.field.rpartition(".")
        (out.setdefault(group, {}) if group else out)[name] = value
    return out


def request_name(field: str) -> str:
    """A setting as a served request names it: its field there, else the server's setting (its flag without
    dashes: a request's message speaks of no command line)."""
    setting = BY_FIELD.get(field)
    if setting is None:
        return field
    return setting.request or f"the server's {setting.flag.lstrip('-')}"


def command_line_name(field: str) -> str:
    """A setting as the command line names it: its flag."""
    setting = BY_FIELD.get(field)
    return setting.flag if setting else field


def range_text(setting: Setting) -> str:
    """The values a setting takes, in words (docs/usage.md's table)."""
    kind = setting.kind
    if setting.values:
        return setting.values
    if setting.switch:
        return "on or off"
    if isinstance(kind, click.Choice):
        return ", ".join(kind.choices)
    if isinstance(kind, click.IntRange):
        ends = [f">= {kind.min}" if kind.min is not None else "", f"<= {kind.max}" if kind.max is not None else ""]
        return "an integer " + " and ".join(end for end in ends if end)
    if isinstance(kind, Finite):
        return f"a number {kind.range_text()}"
    return kind.name
