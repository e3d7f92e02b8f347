"""The command line's one validation layer: every option value is checked as click parses it (a click type
per kind of value), so a bad value ends in one `Error:` line before any model loads, and no value can reach
llama.cpp in a form it asserts on. Sizes that depend on the run (the PRM's context against its batch, a budget
against the base model's trained context) are checked as soon as what they depend on is known, before any
context is made."""

from __future__ import annotations

import math
import os
import string

import click

from ..errors import KVRescueError
from ..eviction import policy_specs
from ..files import check_encodable
from ..rescue import MODES, RescueConfig
from ..rescue.rules import parse_rule
from ..rescue.limits import check_budget_trained
from ..runtime import Model
from ..runtime.context import CACHE_TYPES, check_cache_blocks

MAX_THREADS = os.cpu_count() or 1  # more llama.cpp threads than CPUs spin against each other: a run stalls
SEED = click.IntRange(0, 2 ** 32 - 1)  # llama.cpp's samplers take an unsigned 32-bit seed
THREADS = click.IntRange(0, MAX_THREADS)
POSITIVE = click.IntRange(min=1)
NON_NEGATIVE = click.IntRange(min=0)
PORT = click.IntRange(1, 65535)
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


def comma_items(value) -> list[str]:
    """The non-empty, stripped items of a comma-separated option value."""
    return [x.strip() for x in str(value).split(",") if x.strip()]


class IntList(click.ParamType):
    """Comma-separated integers, at least one, each at least `low`."""

    name = "integers"

    def __init__(self, low: int = 1) -> None:
        self.low = low

    def convert(self, value, param, ctx) -> list[int]:
        if isinstance(value, list):
            return value
        items = comma_items(value)
        if not items:
            self.fail(f"{value!r} holds no values: give comma-separated integers, e.g. 64,128", param, ctx)
        try:
            numbers = [int(x) for x in items]
        except ValueError:
            self.fail(f"expected comma-separated integers, not {value!r}", param, ctx)
        small = [n for n in numbers if n < self.low]
        if small:
            self.fail(f"{small[0]} is out of range: every value must be >= {self.low}", param, ctx)
        return numbers


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


class Names(click.ParamType):
    """One name of `allowed` (case as `allowed` spells it, matched in any case), or a comma-separated list of them
    (several), each named once."""

    def __init__(self, allowed, what: str, several: bool = False, fold_case: bool = True) -> None:
        self.allowed, self.what, self.several, self.fold_case = list(allowed), what, several, fold_case
        self.name = what

    def convert(self, value, param, ctx) -> str | list[str]:
        if isinstance(value, list):
            return value
        spelled = {(a.lower() if self.fold_case else a): a for a in self.allowed}
        items = comma_items(value) if self.several else [str(value).strip()]
        names = []
        for item in items:
            name = spelled.get(item.lower() if self.fold_case else item)
            if name is None:
                self.fail(f"{item!r} is not a {self.what}: use {', '.join(self.allowed)}", param, ctx)
            names.append(name)
        if not names:
            self.fail(f"{value!r} names no {self.what}: give one or more of {', '.join(self.allowed)}", param, ctx)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            self.fail(f"{', '.join(repeated)} is given more than once: name each {self.what} once", param, ctx)
        return names if self.several else names[0]


class CacheTypeList(click.ParamType):
    """Comma-separated KV cache types for the sweep, each `TYPE` (K and V) or `K/V`, each named once."""

    name = "cache types"

    def convert(self, value, param, ctx) -> list[str]:
        if isinstance(value, list):
            return value
        labels = comma_items(value)
        if not labels:
            self.fail(f"{value!r} names no cache type: give e.g. f16,q8_0,q4_0 (or K/V such as q8_0/f16)", param, ctx)
        for label in labels:
            parts = label.split("/")
            unknown = [p for p in parts if p not in CACHE_TYPES]
            if len(parts) > 2 or unknown:
                self.fail(f"{label!r} is not TYPE or K/V of the KV cache types {', '.join(CACHE_TYPES)}", param, ctx)
        repeated = sorted({x for x in labels if labels.count(x) > 1})
        if repeated:
            self.fail(f"{', '.join(repeated)} is given more than once: name each cache type once", param, ctx)
        return labels


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


def check_prm_ctx(config: RescueConfig, prm_ctx: int) -> None:
    """Before the PRM opens: llama.cpp asserts on a context smaller than the batch it decodes at once."""
    if 0 < prm_ctx < config.n_batch:
        raise KVRescueError(f"--prm-ctx {prm_ctx} is smaller than one batch of {config.n_batch} tokens the PRM "
                            f"decodes at once: pass at least {config.n_batch}, or 0 to size it from the problem")


def check_kv_sizes(configs: list[RescueConfig], base: Model | None, prompt_tokens: int, budget_option: str) -> None:
    """After the base opens, before its contexts are made: a budget or buffer beyond its trained context never
    evicts (checked from the GGUF header before, limits.check_context_sizes, and here for each base a sweep
    opens); a protected prompt that fills the budget leaves the policy nothing to choose among."""
    for config in (c for c in configs if c.evicts and base is not None):
        check_budget_trained(config, base, budget_option)
        kv = config.kv
        needed = prompt_tokens + kv.window
        if kv.protect_prompt and needed > kv.budget:
            raise KVRescueError(f"--protect-prompt keeps the prompt's {prompt_tokens} tokens, and with the recent "
                                f"window of {kv.window} they do not fit in {budget_option} {kv.budget}: raise "
                                f"{budget_option} to at least {needed}, or pass --evict-prompt")


def check_cache_fit(configs: list[RescueConfig], base: Model | None, helper: Model | None) -> None:
    """After the models open, before their contexts are made: each side's cache types must tile its heads."""
    for config in configs:
        for side, model, options in (("base", base, ("-ctk", "-ctv")), ("helper", helper, ("-ctk/-ctkh", "-ctv/-ctvh"))):
            if model is not None and (config.uses_base if side == "base" else config.uses_helper):
                check_cache_blocks(model, *config.cache_types(side), *options)
