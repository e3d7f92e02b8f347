"""Declarative shapes of the JSON records read back from files (results rows, trajectories): each field's type and
range, written once beside the record it describes and checked in one walk when the record is read, so that a reader
never meets a list where it hashes an id, a string where it reads a setup, or a 0 it divides by.

`Record({...}, required=(...), other=...)` is an object of the named fields (`other`: the shape of any further
field; ANY by default, so that a reader of this version keeps reading rows that record more); `Number`, `Text`,
`Boolean`, `Maybe` (or null), `ListOf` and `ANY` are the rest. `check(value, shape)` raises ShapeError, whose text
names the field by its dotted path ("setup.models.base.size is "x", not an integer >= 0").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


class ShapeError(ValueError):
    """A value that is not of its shape; str() names the field and what it should be."""


def _path(path: str) -> str:
    return path or "the line"


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _wrong(value, path: str, expected: str) -> ShapeError:
    return ShapeError(f"{_path(path)} is {_shown(value)}, not {expected}")


class Shape:
    def check(self, value, path: str) -> None:
        raise NotImplementedError


class Anything(Shape):
    def check(self, value, path: str) -> None:
        pass


ANY = Anything()


class Boolean(Shape):
    def check(self, value, path: str) -> None:
        if not isinstance(value, bool):
            raise _wrong(value, path, "true or false")


BOOLEAN = Boolean()


@dataclass(frozen=True)
class Number(Shape):
    """A finite number (never a boolean), an integer where `integer`, within [low, high] where given."""

    low: float | None = None
    high: float | None = None
    integer: bool = False

    def check(self, value, path: str) -> None:
        kinds = int if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or (
                self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise _wrong(value, path, self.expected)

    @property
    def expected(self) -> str:
        what = "an integer" if self.integer else "a finite number"
        if self.low is not None and self.high is not None:
            return f"{what} from {self.low:g} to {self.high:g}"
        if self.low is not None:
            return f"{what} >= {self.low:g}"
        return what


@dataclass(frozen=True)
class Text(Shape):
    """A string, one of `choices` where given."""

    choices: tuple[str, ...] = ()

    def check(self, value, path: str) -> None:
        if not isinstance(value, str) or (self.choices and value not in self.choices):
            raise _wrong(value, path, f"one of {', '.join(self.choices)}" if self.choices else "a string")


TEXT = Text()


@dataclass(frozen=True)
class Maybe(Shape):
    """null, or a value of `shape`."""

    shape: Shape

    def check(self, value, path: str) -> None:
        if value is not None:
            self.shape.check(value, path)


@dataclass(frozen=True)
class ListOf(Shape):
    item: Shape

    def check(self, value, path: str) -> None:
        if not isinstance(value, list):
            raise _wrong(value, path, "a list")
        for i, item in enumerate(value):
            self.item.check(item, f"{path}[{i}]")


@dataclass(frozen=True)
class Record(Shape):
    """An object whose named fields have their shapes (the `required` ones present) and any other field `other`'s."""

    fields: dict[str, Shape] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    other: Shape = ANY

    def check(self, value, path: str) -> None:
        if not isinstance(value, dict):
            raise _wrong(value, path, "an object")
        missing = [f"{path}.{name}" if path else name for name in self.required if name not in value]
        if missing:
            raise ShapeError(f"it misses {', '.join(missing)}")
        for name, item in value.items():
            self.fields.get(name, self.other).check(item, f"{path}.{name}" if path else name)


def check(value, shape: Shape) -> None:
    """Raise ShapeError naming the first field of value that is not of its shape."""
    shape.check(value, "")


COUNT = Number(low=0, integer=True)
SECONDS = Number(low=0)
