"""What a commit rule is, the registry of rules by name, and rule specs ("lead:base,margin=0.3").

A rule chooses a round's winner among its survivors (the candidates the detector left alive, the base's first).
A spec names a rule and its parameters, and composes:

    RULE  := NAME[:ARG,ARG,...]
    judge:margin=0.005            a rule's parameters as KEY=VALUE; some are also given by position:
    lead:helper,margin=0.3        lead's side, calibrated's four numbers
    by-budget:64,judge,lead:base  a composition: its positional values (the budget), then its rules, in order
    arith:by-budget:64,judge,lead:base

Every rule takes a fixed number of rules (by-budget two, arith one, the others none), so a spec reads one way only:
an item that names a rule starts that rule, and any other item belongs to the innermost rule still taking values.
A rule's `spec` writes it back in that grammar with its defaults left out (its canonical spelling, which results
rows record).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ...errors import KVRescueError
from ..generator import Draft

RULES: dict[str, type[Rule]] = {}


def register(cls: type[Rule]) -> type[Rule]:
    RULES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Rule:
    """A commit rule: how a round's winner is chosen among its survivors."""

    name: ClassVar[str]
    positional: ClassVar[tuple[str, ...]] = ()  # the parameters that may be given by position, in order
    rules: ClassVar[tuple[str, ...]] = ()  # the fields that hold the rules it composes
    usage: ClassVar[str]  # its spec's form and what it does, one clause (the listing a bad spec shows)

    @property
    def needs_judge(self) -> bool:
        """Whether a judge (the PRM, or the helper's head) scores the survivors for it."""
        return True

    @property
    def key_name(self) -> str:
        """What a configuration's key and the report call the rule (its results rows' names)."""
        return self.name

    @property
    def checks_arithmetic(self) -> bool:
        return False

    def at_budget(self, budget: int) -> Rule:
        """The rule in force at a base KV budget: itself, but for a composition by budget."""
        return self

    def choose(self, survivors: list[Draft], seeds: tuple[int, int, int]) -> Draft:
        """The winner of survivors (at least one); `seeds`: the run's seed, the problem's key and the round."""
        raise NotImplementedError

    @property
    def spec(self) -> str:
        values = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.rules:
                values.append(value.spec)
            elif f.name in self.positional:
                if value is not None:
                    values.extend(spelled(v) for v in (value if isinstance(value, tuple) else (value,)))
            elif value != f.default:
                values.append(f"{f.name}={spelled(value)}")
        return self.name + (":" + ",".join(values) if values else "")

    def __str__(self) -> str:
        return self.spec


def spelled(value) -> str:
    """A parameter as a spec writes it: 0.005, 64, base (a float without its ".0")."""
    if isinstance(value, float):
        text = repr(value)
        return text[:-2] if text.endswith(".0") else text
    return str(value)


def rules_help() -> str:
    """Every registered rule with its parameters, one clause each."""
    return "; ".join(RULES[name].usage for name in RULES)


class SpecError(ValueError):
    pass


def parse_rule(text: str, option: str = "--rule") -> Rule:
    """A rule from its spec; a bad spec is one KVRescueError naming what is wrong and listing the rules."""
    try:
        items = [item.strip() for item in str(text).split(",")]
        if not text or not str(text).strip() or not all(items):
            raise SpecError("it has an empty item")
        tokens = [part.strip() for item in items for part in split_names(item)]
        rule, end = read_rule(tokens, 0)
        if end < len(tokens):
            raise SpecError(f"{','.join(tokens[end:])!r} follows a complete rule")
        return rule
    except SpecError as error:
        raise KVRescueError(f"{option} {text!r} is not a rule spec ({error}): write one of {rules_help()}") from None


def split_names(item: str) -> list[str]:
    """'arith:lead:base' -> arith, lead, base: a rule's name and its first value, each a token of their own."""
    head, colon, rest = item.partition(":")
    return [head, *split_names(rest)] if colon and head in RULES else [item]


def read_rule(tokens: list[str], at: int) -> tuple[Rule, int]:
    """The rule starting at tokens[at], and where what follows it starts."""
    if at >= len(tokens):
        raise SpecError("a rule is missing at its end")
    name = tokens[at]
    if name not in RULES:
        raise SpecError(f"unknown rule {name!r}")
    cls = RULES[name]
    at += 1
    positional: list[str] = []
    named: dict[str, str] = {}
    if cls.rules:  # a composition: its positional values, then its rules
        while len(positional) < len(cls.positional):
            if at >= len(tokens) or tokens[at] in RULES or "=" in tokens[at]:
                raise SpecError(f"{name} takes {', '.join(cls.positional)} first")
            positional.append(tokens[at])
            at += 1
        parts = []
        for _ in cls.rules:
            part, at = read_rule(tokens, at)
            parts.append(part)
        return build(cls, positional, named, parts), at
    while at < len(tokens) and tokens[at] not in RULES:
        key, eq, value = tokens[at].partition("=")
        if eq:
            if key.strip() in named:
                raise SpecError(f"{name} sets {key.strip()} twice")
            named[key.strip()] = value.strip()
        elif named:
            raise SpecError(f"{tokens[at]!r} follows {name}'s KEY=VALUE parameters")
        else:
            positional.append(tokens[at])
        at += 1
    return build(cls, positional, named, []), at


def build(cls: type[Rule], positional: list[str], named: dict[str, str], parts: list[Rule]) -> Rule:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict = dict(zip(cls.rules, parts))
    numbers = [k for k in cls.positional if fields[k].type.startswith("tuple")]  # one parameter of several numbers
    if numbers:
        if positional:
            values[numbers[0]] = tuple(number(cls.name, numbers[0], x, float) for x in positional)
    elif len(positional) > len(cls.positional):
        raise SpecError(f"{cls.name} takes {len(cls.positional) or 'no'} value{'s' * (len(cls.positional) != 1)} by "
                        f"position, not {', '.join(positional)}")
    else:
        values.update(zip(cls.positional, positional))
    for key, text in named.items():
        if key not in fields or key in cls.rules or key in numbers:
            known = [k for k in fields if k not in cls.rules and k not in numbers]
            raise SpecError(f"{cls.name} has no parameter {key!r}" + (f" (its parameters: {', '.join(known)})"
                                                                       if known else ""))
        if key in values:
            raise SpecError(f"{cls.name} is given {key} twice")
        values[key] = text
    for key, text in list(values.items()):
        if isinstance(text, str) and fields[key].type in ("int", "float"):
            values[key] = number(cls.name, key, text, int if fields[key].type == "int" else float)
    try:
        return cls(**values)
    except ValueError as error:
        raise SpecError(str(error)) from None


def number(rule: str, key: str, text: str, kind: type):
    try:
        value = kind(text)
    except ValueError:
        raise SpecError(f"{rule}'s {key} is {'an integer' if kind is int else 'a number'}, not {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise SpecError(f"{rule}'s {key} must be finite, not {text!r}")
    return value


def check_margin(rule: str, key: str, value: float, open_top: bool = False) -> None:
    """A margin is a difference of rewards, which lie in [0, 1]."""
    if not (0 <= value < 1 if open_top else 0 <= value <= 1):
        raise ValueError(f"{rule}'s {key} must be in [0, {'1)' if open_top else '1]'}, a difference of rewards "
                         f"(got {spelled(value)})")


def reward(draft: Draft) -> float:
    return draft.score if draft.score is not None else 0.0


def favourite(survivors: list[Draft], margin: float) -> Draft:
    """The best-scored survivor, or the first (in the round's order) within margin of it."""
    best = max(reward(c) for c in survivors)
    return next(c for c in survivors if reward(c) >= best - margin)
