"""The kinds of value only the command line takes: every option value is checked as click parses it (a click type
per kind of value), so a bad value ends in one `Error:` line before any model loads, and no value can reach
llama.cpp in a form it asserts on (the settings' kinds, which a served request's fields share, live in
settings.py). Sizes that depend on the run (the PRM's context against its batch, a budget against the base model's
trained context) are checked as soon as what they depend on is known, before any context is made."""

from __future__ import annotations

import click

from ..errors import KVRescueError
from ..rescue import RescueConfig
from ..runtime import Model
from ..runtime.context import CACHE_TYPES, check_cache_blocks

PORT = click.IntRange(1, 65535)


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


def check_prm_ctx(config: RescueConfig, prm_ctx: int) -> None:
    """Before the PRM opens: llama.cpp asserts on a context smaller than the batch it decodes at once."""
    if 0 < prm_ctx < config.n_batch:
        raise KVRescueError(f"--prm-ctx {prm_ctx} is smaller than one batch of {config.n_batch} tokens the PRM "
                            f"decodes at once: pass at least {config.n_batch}, or 0 to size it from the problem")


def check_cache_fit(configs: list[RescueConfig], base: Model | None, helper: Model | None) -> None:
    """After the models open, before their contexts are made: each side's cache types must tile its heads."""
    for config in configs:
        for side, model, options in (("base", base, ("-ctk", "-ctv")), ("helper", helper, ("-ctk/-ctkh", "-ctv/-ctvh"))):
            if model is not None and (config.uses_base if side == "base" else config.uses_helper):
                check_cache_blocks(model, *config.cache_types(side), *options)
