"""The kinds of value that a setting takes both on the command line and in a served request, one click type each:
an option of cli/ is declared with its kind, and serve/ checks a request's field with the kind of the option that
sets the field's default (`checked`), so a request cannot ask what the command line refuses."""

from __future__ import annotations

import math

import click

from .errors import KVRescueError
from .eviction import policy_specs
from .rescue import MODES
from .rescue.rules import parse_rule

SEED = click.IntRange(0, 2 ** 32 - 1)  # llama.cpp's samplers take an unsigned 32-bit seed
POSITIVE = click.IntRange(min=1)
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
