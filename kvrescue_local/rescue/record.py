"""What a run leaves behind: the typed records of candidates, committed steps and trajectories,
and the modes with their semantics.

Every reader of a trajectory (the CLI, `bench run`, `report`, the HTML viewer, the toy world) goes
through these types, never through string keys. `Trajectory.to_json()` writes schema
`SCHEMA_VERSION`; `Trajectory.from_json()` also reads schema 1 (the records written before the
version field existed: the same layout without "schema").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..errors import KVRescueError
from ..shape import BOOLEAN, COUNT, SECONDS, TEXT, ListOf, Maybe, Number, Record, ShapeError, check

SCHEMA_VERSION = 2
SIDES = ("base", "helper")
LENGTH_CAPS = ("max_tokens", "max_steps")  # the stops that mean "ran to the length limit"


class Mode(str, Enum):
    """A search mode; its value is what configs, results lines and the command line spell."""

    # in the order of the report's tables: the baselines without eviction first
    FULL = "full"  # the base alone with its full KV cache: the accuracy eviction loses
    HELPER = "helper"  # the full-context helper alone
    BON = "bon"  # the base alone, evicted: best-of-N under the budget
    KVRESCUE = "kvrescue"  # evicted base + helper, the detector on the base, the PRM choosing

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value: str | Mode) -> Mode:
        try:
            return cls(value)
        except ValueError:
            raise KVRescueError(f"unknown mode {value!r}: use one of {', '.join(m.value for m in cls)}") from None

    @property
    def uses_base(self) -> bool:
        return self is not Mode.HELPER

    @property
    def uses_helper(self) -> bool:
        return self in (Mode.HELPER, Mode.KVRESCUE)

    @property
    def evicts(self) -> bool:
        return self in (Mode.BON, Mode.KVRESCUE)

    @property
    def sides(self) -> int:
        """Models that propose candidates each round."""
        return int(self.uses_base) + int(self.uses_helper)

    @property
    def detects(self) -> bool:
        """The degeneration detector watches the base's candidates (and base and helper share one trajectory)."""
        return self is Mode.KVRESCUE

    @property
    def label(self) -> str:
        return {"full": "full KV", "bon": "evicted best-of-N", "helper": "helper alone", "kvrescue": "KV-Rescue"}[self.value]


MODES = tuple(m.value for m in Mode)


def _not_a_record(where: str, what: str) -> KVRescueError:
    return KVRescueError(f"{where}: {what}: pass the file written by `kvrescue-local solve --json`")


# what a record's readers rely on, field by field (kvrescue_local/shape.py); further fields are let through
SCORE = Maybe(Number())
CANDIDATE_SHAPE = Record({"side": TEXT, "index": COUNT, "text": TEXT, "tokens": COUNT, "finished": Maybe(TEXT),
                          "score": SCORE, "detector": Maybe(Record()), "false_arithmetic": Maybe(ListOf(TEXT))})
STEP_SHAPE = Record({"round": COUNT, "text": TEXT, "source": TEXT, "score": SCORE, "finished": Maybe(TEXT),
                     "candidates": ListOf(CANDIDATE_SHAPE), "fallback": BOOLEAN})
TRAJECTORY_SHAPE = Record({"schema": Number(low=1, integer=True), "problem": TEXT, "answer": Maybe(TEXT),
                           "stop": Maybe(TEXT), "text": TEXT, "n_steps": COUNT, "tokens": Record(other=COUNT),
                           "early_exit_fraction": Number(low=0, high=1), "base_cells": ListOf(Record(other=COUNT)),
                           "evictions": Record(other=COUNT), "timings": Record(other=SECONDS), "config": Record(),
                           "steps": ListOf(STEP_SHAPE)}, required=("steps",))


@dataclass
class Candidate:
    """One proposed step, as it ended: at a blank line ("step"), end of generation ("eos"), the step
    length cap ("max_step") or killed by the detector ("killed")."""

    side: str
    index: int
    text: str
    tokens: int
    finished: str | None
    score: float | None = None  # the PRM's, when it had to choose
    detector: dict | None = None  # the detector's statistics (base candidates in kvrescue mode)
    false_arithmetic: list[str] | None = None  # the false equalities its step states, where the round checked

    @property
    def killed(self) -> bool:
        return self.finished == "killed"

    def to_json(self) -> dict:
        out = {"side": self.side, "index": self.index, "text": self.text, "tokens": self.tokens,
               "finished": self.finished, "score": self.score}
        if self.detector is not None:
            out["detector"] = self.detector
        if self.false_arithmetic is not None:
            out["false_arithmetic"] = self.false_arithmetic
        return out

    @classmethod
    def from_json(cls, data: dict) -> Candidate:
        """From a record of CANDIDATE_SHAPE."""
        return cls(data.get("side", "?"), data.get("index", 0), data.get("text", ""), data.get("tokens", 0),
                   data.get("finished"), data.get("score"), data.get("detector"), data.get("false_arithmetic"))


@dataclass
class Step:
    """A committed step: the winning candidate's text and origin, and every candidate of its round."""

    round: int
    text: str
    source: str
    score: float | None
    finished: str | None
    candidates: list[Candidate] = field(default_factory=list)
    fallback: bool = False  # every candidate was killed: this is the least degenerate of them

    @property
    def killed(self) -> int:
        return sum(c.killed for c in self.candidates)

    @property
    def set_aside(self) -> int:
        """Survivors set aside for stating false arithmetic: where another survivor was checked and stated none."""
        survivors = [c for c in self.candidates if not c.killed]
        if not any(c.false_arithmetic == [] for c in survivors):
            return 0
        return sum(bool(c.false_arithmetic) for c in survivors)

    def to_json(self) -> dict:
        out = {"round": self.round, "text": self.text, "source": self.source, "score": self.score,
               "finished": self.finished, "candidates": [c.to_json() for c in self.candidates]}
        if self.fallback:
            out["fallback"] = True
        return out

    @classmethod
    def from_json(cls, data: dict) -> Step:
        """From a record of STEP_SHAPE."""
        return cls(data.get("round", 0), data.get("text", ""), data.get("source", "?"), data.get("score"),
                   data.get("finished"), [Candidate.from_json(c) for c in data.get("candidates", [])],
                   data.get("fallback", False))


@dataclass
class Trajectory:
    """One problem solved under one configuration: the committed steps and what they cost."""

    problem: str
    config: dict
    steps: list[Step] = field(default_factory=list)
    stop: str = ""  # "eos" or a length cap (LENGTH_CAPS); "all_killed" in records from before a round whose
    # candidates all died fell back to the least degenerate
    answer: str | None = None
    tokens: dict = field(default_factory=lambda: {"base": 0, "helper": 0, "committed": 0})
    base_cells: list[dict] = field(default_factory=list)  # per step: cells of the committed base sequence, peak
    # evictions of the base's sequences, and those that could not rank by the observation window (reads 0)
    evictions: dict = field(default_factory=lambda: {"evictions": 0, "fallback_evictions": 0})
    timings: dict = field(default_factory=dict)  # seconds: llama_<side>, prm, orchestration, total

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.steps)

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def mode(self) -> Mode | None:
        mode = self.config.get("mode")
        return Mode(mode) if mode in MODES else None

    @property
    def base_candidates(self) -> list[Candidate]:
        return [c for s in self.steps for c in s.candidates if c.side == "base"]

    @property
    def killed(self) -> int:
        return sum(c.killed for c in self.base_candidates)

    @property
    def helper_killed(self) -> int:
        """Helper candidates the detector killed (when it watched the helper)."""
        return sum(c.killed for s in self.steps for c in s.candidates if c.side == "helper")

    @property
    def fallbacks(self) -> int:
        """Rounds whose candidates all died, and that committed the least degenerate."""
        return sum(s.fallback for s in self.steps)

    @property
    def set_aside(self) -> int:
        """Survivors set aside for stating false arithmetic while another survivor of their round stated none."""
        return sum(s.set_aside for s in self.steps)

    @property
    def early_exit_fraction(self) -> float:
        """Killed base candidates among all base candidates."""
        base = self.base_candidates
        return self.killed / len(base) if base else 0.0

    @property
    def length_capped(self) -> bool:
        return self.stop in LENGTH_CAPS

    def steps_from(self) -> dict[str, int]:
        return {side: sum(s.source == side for s in self.steps) for side in SIDES}

    def to_json(self) -> dict:
        """The record (plus its text, step count and early exits, for people reading the file)."""
        return {"schema": SCHEMA_VERSION, "problem": self.problem, "answer": self.answer, "stop": self.stop,
                "text": self.text, "n_steps": self.n_steps, "tokens": self.tokens,
                "early_exit_fraction": self.early_exit_fraction, "base_cells": self.base_cells,
                "evictions": self.evictions, "timings": self.timings, "config": self.config, "steps": [s.to_json() for s in self.steps]}

    @classmethod
    def from_json(cls, data, where: str = "the trajectory") -> Trajectory:
        try:
            check(data, TRAJECTORY_SHAPE)
        except ShapeError as exc:
            raise _not_a_record(where, f"not a trajectory record ({exc})") from None
        schema = data.get("schema", 1)
        if schema not in (1, SCHEMA_VERSION):
            raise KVRescueError(f"{where}: trajectory schema {schema!r} is newer than this kvrescue-local reads "
                                f"({SCHEMA_VERSION}): upgrade kvrescue-local")
        return cls(data.get("problem", ""), data.get("config", {}), [Step.from_json(s) for s in data["steps"]],
                   data.get("stop") or "", data.get("answer"), data.get("tokens", {}), data.get("base_cells", []),
                   data.get("evictions") or {"evictions": 0, "fallback_evictions": 0}, data.get("timings", {}))
