"""The toy task: a ledger of named values, then a sum of some of them, solved one step at a time.

    a=7 b=4 c=5 d=9 e=6 f=2 g=8 h=3
    Compute 4 terms: a+d-c+g.

is solved as "\\n\\n"-separated steps, a numbered lookup then an addition per term, then the answer:

    1:a=7           total=7
    2:+d=9          total=7+9=16
    3:-c=5          total=16-5=11   ...   \\boxed{19}

Every lookup needs the ledger, stated early in the problem; which term comes next (name and sign)
and when to stop (the count) need the question. Both sit far behind a small KV window, so an
evicted model has a true information gap, while the additions only need the last two steps. The
stop is a match between the lookup number and the count, so that a model that no longer sees the
count has nothing telling it to stop: under R-KV, which keeps ledger entries but not the count, the
trained base runs past the last term, some trajectories to the length cap (with sinks + recent
window it loses the ledger as well, garbles a step and ends).
Difficulty knobs: ledger size, number of terms, value range (digits), whether subtractions occur.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field

import numpy as np

from ..gguf_export import CONTROL_TOKENS

STEP_END = "\n\n"
END = "<|im_end|>"
# byte-level ids of kvrescue_local.gguf_export.byte_vocab(): byte b is id b, then the merges, then control tokens
MERGED = {"\n\n": 256, "  ": 257}
CONTROL = {t: 258 + i for i, t in enumerate(CONTROL_TOKENS)}
N_VOCAB = 258 + len(CONTROL_TOKENS)
PAD = CONTROL["<|endoftext|>"]


@dataclass(frozen=True)
class Knobs:
    n_vars: int = 8  # ledger size (at most 26)
    min_vars: int = 0  # if set, each ledger has between min_vars and n_vars entries (a training curriculum)
    min_terms: int = 3
    max_terms: int = 7
    lo: int = 1  # value range, inclusive (10..99 makes the additions much harder to learn)
    hi: int = 9
    minus: bool = True  # allow subtractions (the running total never goes below zero)

    def __post_init__(self) -> None:
        if (not 1 <= self.min_terms <= self.max_terms <= self.n_vars <= 26 or not 0 <= self.lo <= self.hi
                or self.min_vars > self.n_vars or 0 < self.min_vars < self.min_terms):
            raise ValueError(f"bad toy task knobs: {self}")


@dataclass(frozen=True)
class Problem:
    ledger: dict[str, int]
    terms: tuple[tuple[str, str], ...]  # (sign, name), the first sign is "+"
    text: str = field(init=False)
    steps: tuple[str, ...] = field(init=False)
    answer: int = field(init=False)

    def __post_init__(self) -> None:
        ledger = " ".join(f"{k}={v}" for k, v in self.ledger.items())
        question = "".join((s if i else "") + name for i, (s, name) in enumerate(self.terms))
        steps = worked_steps(self.ledger, self.terms)
        object.__setattr__(self, "text", f"{ledger}\nCompute {len(self.terms)} terms: {question}.")
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "answer", int(steps[-1][len("\\boxed{"):-1]))

    @property
    def solution(self) -> str:
        return "".join(self.steps)

    def careless_solution(self, blind_spot: frozenset[int]) -> str:
        """The solution as a solver with a blind spot writes it: adding (subtracting) a value in
        `blind_spot` drops the carry (borrow) every time one is needed, and later steps go on from the
        wrong total. The lookups stay right."""
        return "".join(worked_steps(self.ledger, self.terms, blind_spot))


def worked_steps(ledger: dict[str, int], terms: tuple[tuple[str, str], ...],
                 blind_spot: frozenset[int] = frozenset()) -> tuple[str, ...]:
    """Lookup, running total, ..., \\boxed{answer}; carries and borrows of values in `blind_spot` dropped."""
    steps, total = [], 0
    for i, (sign, name) in enumerate(terms):
        value = ledger[name]
        new = total + value if sign == "+" else total - value
        if i and total // 10 != new // 10 and value in blind_spot:
            new += -10 if sign == "+" else 10
        steps.append(f"{i + 1}:{sign if i else ''}{name}={value}{STEP_END}")
        steps.append(f"total={value}{STEP_END}" if i == 0 else f"total={total}{sign}{value}={new}{STEP_END}")
        total = new
    steps.append(f"\\boxed{{{total}}}")
    return tuple(steps)


def make_problem(rng: np.random.Generator, knobs: Knobs = Knobs()) -> Problem:
    size = int(rng.integers(knobs.min_vars, knobs.n_vars + 1)) if knobs.min_vars else knobs.n_vars
    names = list(string.ascii_lowercase[:size])
    values = rng.integers(knobs.lo, knobs.hi + 1, size=size)
    ledger = {k: int(v) for k, v in zip(names, values)}
    n_terms = int(rng.integers(knobs.min_terms, min(knobs.max_terms, size) + 1))
    chosen = [names[i] for i in rng.choice(size, size=n_terms, replace=False)]
    terms, total = [], 0
    for i, name in enumerate(chosen):
        sign = "-" if i and knobs.minus and total >= ledger[name] and rng.random() < 0.4 else "+"
        terms.append((sign, name))
        total += ledger[name] if sign == "+" else -ledger[name]
    return Problem(ledger, tuple(terms))


def problems(seed: int, count: int, knobs: Knobs = Knobs()) -> list[Problem]:
    """`count` problems, the same for the same seed (training uses seeds >= 1000, evaluation seed 0)."""
    rng = np.random.default_rng(seed)
    return [make_problem(rng, knobs) for _ in range(count)]


EVAL_SEED = 0  # held-out problems; training draws its problems from seeds >= 1000
EVAL_PROBLEMS = 300


def held_out(count: int = EVAL_PROBLEMS) -> list[Problem]:
    """The toy dataset: the same `count` problems every time (a shorter list is a prefix of a longer one)."""
    return problems(EVAL_SEED, count)


def exact_match(gold: str, answer: str | None) -> bool:
    """The toy grader: the integer in the last \\boxed{} equals the gold one."""
    try:
        return answer is not None and int(answer.strip()) == int(gold)
    except ValueError:
        return False


def grade(problem: Problem, answer: str | None) -> bool:
    return exact_match(str(problem.answer), answer)


# The chat format of the real presets without the system turn: it would be 90 of the ~250 tokens the
# models train on, and it carries nothing here. (The PRM reads the qwen-prm format, system turn included.)
TOY_PROMPT = "<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"


def prompt(problem: Problem) -> str:
    return TOY_PROMPT.format(problem=problem.text)


def encode(text: str) -> list[int]:
    """Token ids as llama.cpp's byte vocabulary gives them for this task's texts (checked in tests):
    control tokens, "\\n\\n" and "  " merged, every other byte its own id."""
    ids, i = [], 0
    while i < len(text):
        for piece, tid in (*CONTROL.items(), *MERGED.items()):
            if text.startswith(piece, i):
                ids.append(tid)
                i += len(piece)
                break
        else:
            ids.extend(text[i].encode())
            i += 1
    return ids


# --- wrong steps, for the PRM ------------------------------------------------
def wrong_step(problem: Problem, k: int, rng: np.random.Generator) -> str:
    """A plausible but wrong step k given the correct steps before it: a wrong lookup, a wrong sum,
    a wrong or premature answer, a step after the end, or garbled text."""
    for _ in range(8):
        step = corrupted(problem, k, rng)
        if step != problem.steps[k]:
            return step
    return f"\\boxed{{{perturb(problem.answer, rng)}}}"


LOOKUP = re.compile(r"(\d+):([+-]?)([a-z])=(\d+)")


def corrupted(problem: Problem, k: int, rng: np.random.Generator) -> str:
    step = problem.steps[k]
    kind = rng.integers(6)
    if kind == 0:  # garbled: shuffled characters of the right step, or a repeat of an earlier step
        if k >= 2 and rng.random() < 0.5:
            return problem.steps[int(rng.integers(k - 1))]
        chars = list(step.rstrip())
        rng.shuffle(chars)
        return "".join(chars) + STEP_END
    if kind == 1 and k < len(problem.steps) - 1:  # premature or wrong answer
        return f"\\boxed{{{int(rng.integers(0, 400))}}}"
    if step.startswith("\\boxed"):  # one lookup too many (an evicted base's most frequent error), or a wrong number
        if rng.random() < 0.7:
            name = question_or_ledger_name(problem, None, rng)
            return f"{len(problem.terms) + 1}:{'+-'[int(rng.integers(2))]}{name}={problem.ledger[name]}{STEP_END}"
        return f"\\boxed{{{perturb(problem.answer, rng)}}}"
    lookup = LOOKUP.fullmatch(step.rstrip())
    if lookup:  # the wrong value or term (what an evicted model gets wrong most), sign or number
        number, sign, name, value = lookup.groups()
        kind = rng.choice(4, p=[0.3, 0.35, 0.2, 0.15] if sign else [0.35, 0.45, 0.2, 0.0])
        if kind == 0:  # mostly another value of the ledger: what a lookup that found the wrong entry gives
            others = sorted(set(problem.ledger.values()) - {int(value)})
            wrong = others[int(rng.integers(len(others)))] if others and rng.random() < 0.7 else perturb(int(value), rng)
            value = str(wrong)
        elif kind == 1:  # the wrong term, rightly looked up
            name = question_or_ledger_name(problem, name, rng)
            value = str(problem.ledger[name])
        elif kind == 2:  # mostly one off: an evicted base loses count of the lookups
            number = str(int(number) + 1 if int(number) == 1 or rng.random() < 0.5 else int(number) - 1)
        else:
            sign = "-" if sign == "+" else "+"
        return f"{number}:{sign}{name}={value}{STEP_END}"
    body = step[len("total="):-len(STEP_END)]  # addition: a wrong result, a wrong term, or a misread total
    head, _, result = body.rpartition("=")
    kind = rng.integers(3) if head else 0
    if kind == 0:
        return f"total={head + '=' if head else ''}{perturb(int(result), rng)}{STEP_END}"
    sign = "-" if "-" in head else "+"
    total, value = map(int, head.split(sign))
    if kind == 1:
        return f"total={total}{sign}{perturb(value, rng)}={result}{STEP_END}"
    # an evicted base that lost the previous total carries on, rightly, from a wrong one
    misread = perturb(total, rng)
    if sign == "-" and misread < value:  # the other way, so that the total stays non-negative
        misread = 2 * total - misread
    return f"total={misread}{sign}{value}={misread + value if sign == '+' else misread - value}{STEP_END}"


def question_or_ledger_name(problem: Problem, name: str | None, rng: np.random.Generator) -> str:
    """Another term than `name`: mostly one of the question, as an evicted model that kept the ledger
    but lost its place in the question picks; else any other name of the ledger."""
    terms = [n for _, n in problem.terms if n != name]
    pool = terms if terms and rng.random() < 0.6 else [n for n in problem.ledger if n != name]
    return pool[int(rng.integers(len(pool)))]


def perturb(x: int, rng: np.random.Generator) -> int:
    """A different non-negative number, near x in the ways arithmetic slips are (a digit or a carry off)."""
    delta = int(rng.choice([1, 2, 9, 10, 11, 20, 100]))
    return x + delta if rng.random() < 0.5 or x < delta else x - delta
