"""The paper's metrics, defined once: per trajectory (the results line) and per configuration.

- pass@1: the share of trajectories whose last \\boxed{} the dataset's grader accepts.
- degeneration (the paper's Table 2): a trajectory is degenerate when it is wrong and ran
  DEGENERATE_STEPS (256) committed steps, which in the paper is running to the length limit; a
  configuration whose step cap is lower (the toy world's 32) is judged at its cap. The rate is over
  ALL trajectories of the configuration (every Degen. value in the paper is a whole number of the
  500 MATH500 problems), not over the wrong ones.
- length cap: the share of trajectories stopped by max_tokens or max_steps, right or wrong (its own
  column: a trajectory can hit the token cap long before 256 steps).
- early exit: killed base candidates / all base candidates, pooled over problems.
- accuracy recovered: (acc_kvrescue - acc_bon) / (acc_full - acc_bon) at the same dataset, budget,
  N and policy (full: same dataset and N; without a full row at that N, the full row of the smallest N,
  the model's own accuracy at N = 1 when there is one, and the report names it), each accuracy on the
  problems all three ran (a sweep in progress has more rows of some configurations); the base-token ratio too.
- oracle pick (the paper's Figure 1a): on the problems that both an evicted best-of-N row and the
  helper row of the same dataset and N solved, the share where either answer is right, and the part
  of the eviction gap that this bound closes, (acc_oracle - acc_bon) / (acc_full - acc_bon), with
  bon and full measured on those same problems.
Tokens and seconds are means per problem; problems per minute = problems / summed wall time; tok/s =
tokens generated / seconds inside llama.cpp for that model (killed candidates' tokens included).
`full` and `helper` do not evict: their budget and policy are None and ignored when grouping.
A setup is what a row records beyond its axes (model files, prompt template, settings; results_file.py):
rows of one configuration with different setups (seeds aside) are never pooled unless asked (pool_setups);
they become rows of their own, and a kvrescue row is compared only with full and bon rows of its setup.

Results lines written before these definitions (with another `degenerate` field) are read the same
way: degeneration is recomputed from correct, n_steps and the configured max_steps.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..rescue import MODES, Mode, Trajectory
from ..rescue.record import LENGTH_CAPS
from ..rescue.rules import Arith, Rule, parse_rule
from .results_file import AXIS_RECORDS, SOME_CONFIGURATIONS, differences

DEGENERATE_STEPS = 256
DEFAULT_CACHE = "f16"  # the KV cache of rows that record none (bench.run.DEFAULT_CACHE)
BASE_AXES = ("weights", "kv_cache")  # what the base ran with: KV-Rescue is compared with full and bon rows of the same
RESULTS_SCHEMA = 2


def degenerate(correct: bool, n_steps: int, max_steps: int = DEGENERATE_STEPS) -> bool:
    return not correct and n_steps >= min(DEGENERATE_STEPS, max_steps)


# --- one trajectory: the results line -----------------------------------------------------------

def result_line(dataset: str, problem_id: str, gold: str, correct: bool, config_key: str, config: dict,
                trajectory: Trajectory) -> dict:
    """The results JSONL line of one problem under one configuration (`config`: flat settings)."""
    base = trajectory.base_candidates
    return {
        "schema": RESULTS_SCHEMA, "dataset": dataset, "id": problem_id, "config_key": config_key, "config": config,
        "gold": gold, "answer": trajectory.answer, "correct": correct, "stop": trajectory.stop,
        "degenerate": degenerate(correct, trajectory.n_steps, config.get("max_steps", DEGENERATE_STEPS)),
        "length_capped": trajectory.length_capped, "n_steps": trajectory.n_steps,
        "steps_from": trajectory.steps_from(), "tokens": trajectory.tokens, "base_candidates": len(base),
        "killed": trajectory.killed, "early_exit_fraction": trajectory.early_exit_fraction,
        "helper_killed": trajectory.helper_killed, "fallbacks": trajectory.fallbacks,
        "arithmetic_demoted": trajectory.set_aside,
        "detector": [c.detector for c in base if c.detector is not None], "timings": trajectory.timings,
        # the whole record (every round's candidates, killed ones included): what `bench view` shows and
        # what a PRM trains on
        "trajectory": trajectory.to_json(),
    }


# --- one configuration --------------------------------------------------------------------------

@dataclass(frozen=True)
class ConfigKey:
    dataset: str
    mode_rank: int
    budget: int | None
    n: int
    policy: str | None
    mode: str
    setup: str = ""  # setup_label of its rows; "" when setups are pooled
    choice: str = "prm"  # the rule's key name (Rule.key_name): "prm" the judge's pick, "random" its baseline, ...
    weights: str = ""  # the base's label on the sweep's base axis (its weight type): "" for a run's one base
    kv_cache: str = DEFAULT_CACHE  # the base's KV cache types, "q8_0" or "q8_0/f16" (K/V)
    helper_kv_cache: str = DEFAULT_CACHE
    check_arithmetic: bool = False  # a survivor stating false arithmetic was set aside (rules/arith.py)

    @property
    def mode_label(self) -> str:
        return (self.mode if self.choice == "prm" else f"{self.mode}/{self.choice}") + (
            "+arith" if self.check_arithmetic else "")

    @property
    def label(self) -> str:
        quantized = (f" w{self.weights}" if self.weights else "") + (
            "" if (self.kv_cache, self.helper_kv_cache) == (DEFAULT_CACHE, DEFAULT_CACHE) else f" kv {self.kv_cache}"
            + ("" if self.helper_kv_cache == self.kv_cache else f" helper kv {self.helper_kv_cache}"))
        return (f"{self.mode_label} b{self.budget if self.budget is not None else '-'} n{self.n} {self.policy or '-'}"
                + quantized)

    @property
    def known_mode(self) -> Mode | None:
        return Mode(self.mode) if self.mode in MODES else None

    @property
    def uses_base(self) -> bool:
        return self.known_mode is None or self.known_mode.uses_base

    @property
    def uses_helper(self) -> bool:
        return self.known_mode is not None and self.known_mode.uses_helper

    @property
    def evicts(self) -> bool:
        return self.known_mode is not None and self.known_mode.evicts


UNRECORDED = "unrecorded"  # rows written before setups were recorded
UNWATCHED_HELPER = ("helper_tau_entropy", "helper_tau_compression")


def setup_label(row: dict) -> str:
    """A short id of the row's setup, seeds aside (the report pools seeds)."""
    setup = row.get("setup")
    if setup is None:
        return UNRECORDED
    # a helper left unwatched (0 and 0) hashes as the rows from before its thresholds were settings
    without_seed = {**{k: v for k, v in setup.items() if k not in AXIS_RECORDS},
                    "settings": {k: v for k, v in setup["settings"].items()
                                 if k != "seed" and not (k in UNWATCHED_HELPER and v == 0.0)}}
    return hashlib.sha256(json.dumps(without_seed, sort_keys=True).encode()).hexdigest()[:6]


def settings_label(row: dict) -> str:
    """setup_label without the models and the settings only some configurations record (the rule's spec, where
    a judge scores for it): what rows of different models (base, helper) or choices must share to be compared."""
    setup = row.get("setup")
    if setup is None:
        return UNRECORDED
    shared = {k: v for k, v in setup.get("settings", {}).items() if k not in SOME_CONFIGURATIONS}
    return setup_label({"setup": {**setup, "models": {}, "settings": shared}})


@functools.cache
def rule_of(spec: str) -> Rule:
    return parse_rule(spec, "a row's rule")


def config_key(row: dict, pool_setups: bool = False) -> ConfigKey:
    cfg = row["config"]
    rule = rule_of(str(cfg.get("rule", "judge")))
    mode = str(cfg["mode"])
    evicts = mode in MODES and Mode(mode).evicts
    budget = cfg.get("budget", (cfg.get("kv") or {}).get("budget")) if evicts else None
    policy = cfg.get("policy", (cfg.get("kv") or {}).get("policy")) if evicts else None
    return ConfigKey(str(row.get("dataset", "")), MODES.index(mode) if mode in MODES else len(MODES),
                     None if budget is None else int(budget), int(cfg["n"]), None if policy is None else str(policy),
                     mode, "" if pool_setups else setup_label(row), rule.key_name,
                     str(cfg.get("weights", "")), str(cfg.get("kv_cache", DEFAULT_CACHE)),
                     str(cfg.get("helper_kv_cache", DEFAULT_CACHE)), rule.checks_arithmetic)


def group_rows(rows: list[dict], pool_setups: bool = False) -> dict[ConfigKey, list[dict]]:
    groups: dict[ConfigKey, list[dict]] = {}
    for row in rows:
        groups.setdefault(config_key(row, pool_setups), []).append(row)

    def order(item):
        k = item[0]
        return (k.dataset, k.weights, k.kv_cache, k.helper_kv_cache, k.mode_rank, k.mode,
                -1 if k.budget is None else k.budget, k.n, k.policy or "", k.choice, k.check_arithmetic, k.setup)

    return dict(sorted(groups.items(), key=order))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def is_degenerate(row: dict) -> bool:
    return degenerate(bool(row["correct"]), int(row["n_steps"]), int(row["config"].get("max_steps") or DEGENERATE_STEPS))


def is_length_capped(row: dict) -> bool:
    return row.get("stop") in LENGTH_CAPS


@dataclass
class Summary:
    """One configuration's numbers (the paper's Table 2 and Table 1)."""

    key: ConfigKey
    problems: int
    pass1: float  # %
    degeneration: float  # % of all trajectories
    length_capped: float  # % of all trajectories
    base_tokens: float
    steps: float
    early_exit: float | None  # % of base candidates; None without base candidates
    helper_tokens: float
    problems_per_minute: float | None
    prm_s: float
    llama_base_s: float
    llama_helper_s: float
    orchestration_s: float
    total_s: float
    base_tok_s: float | None
    helper_tok_s: float | None
    steps_from: dict = field(default_factory=dict)  # committed steps per source, summed
    recovered: float | None = None  # %, kvrescue rows with matching full and bon rows, on the problems all ran
    recovered_full_n: int | None = None  # the N of the full row `recovered` compares with
    recovered_problems: int | None = None  # the problems kvrescue, bon and full all ran, which `recovered` counts
    base_token_ratio: float | None = None  # kvrescue rows: base tokens / the matching bon row's
    setup: dict | None = None  # its first row's setup (None: unrecorded or pooled)
    helper_kills: float | None = None  # helper candidates killed per problem, where the detector watched the helper
    fallbacks: int | None = None  # rounds whose candidates all died (committed the least degenerate), summed
    set_aside: int | None = None  # survivors set aside for false arithmetic, summed, where the rounds checked it

    @property
    def budget_kv_bytes(self) -> float | None:
        """An evicting configuration's base KV bytes per sequence: budget × the bytes of a cell of its cache types
        (None: no eviction, rows from before cells' bytes were recorded, or several setups pooled)."""
        cell = ((self.setup or {}).get("kv") or {}).get("base", {}).get("cell_bytes")
        return None if cell is None or self.key.budget is None else float(self.key.budget * cell)

    @property
    def helper_step_share(self) -> float | None:
        """%, of the committed steps, those the helper wrote (modes that run both models)."""
        total = sum(self.steps_from.values())
        if not (self.key.uses_base and self.key.uses_helper) or total == 0:
            return None
        return 100.0 * self.steps_from.get("helper", 0) / total


def summarize(key: ConfigKey, rows: list[dict]) -> Summary:
    n = len(rows)
    timing = lambda r, k: float(r["timings"].get(k) or 0.0)  # noqa: E731
    tokens = lambda r, k: float(r["tokens"].get(k) or 0.0)  # noqa: E731
    base_candidates = sum(int(r.get("base_candidates") or 0) for r in rows)
    killed = sum(int(r.get("killed") or 0) for r in rows)
    total_time = sum(timing(r, "total") for r in rows)
    base_llama = sum(timing(r, "llama_base") for r in rows)
    helper_llama = sum(timing(r, "llama_helper") for r in rows)
    base_tokens = sum(tokens(r, "base") for r in rows)
    helper_tokens = sum(tokens(r, "helper") for r in rows)
    steps_from: dict[str, int] = {}
    watched = any(watches_helper(r) for r in rows)
    for r in rows:
        for side, count in (r.get("steps_from") or {}).items():
            steps_from[side] = steps_from.get(side, 0) + int(count or 0)
    return Summary(
        key=key, problems=n,
        pass1=100.0 * sum(bool(r["correct"]) for r in rows) / n,
        degeneration=100.0 * sum(is_degenerate(r) for r in rows) / n,
        length_capped=100.0 * sum(is_length_capped(r) for r in rows) / n,
        base_tokens=base_tokens / n, steps=_mean(float(r["n_steps"]) for r in rows),
        early_exit=100.0 * killed / base_candidates if base_candidates else None,
        helper_tokens=helper_tokens / n,
        problems_per_minute=60.0 * n / total_time if total_time > 0 else None,
        prm_s=_mean(timing(r, "prm") for r in rows),
        llama_base_s=base_llama / n, llama_helper_s=helper_llama / n,
        orchestration_s=_mean(timing(r, "orchestration") for r in rows), total_s=total_time / n,
        base_tok_s=base_tokens / base_llama if base_llama > 0 else None,
        helper_tok_s=helper_tokens / helper_llama if helper_llama > 0 else None,
        steps_from=steps_from, setup=rows[0].get("setup") if key.setup else None,
        helper_kills=_mean(int(r.get("helper_killed") or 0) for r in rows) if watched else None,
        fallbacks=sum(int(r.get("fallbacks") or 0) for r in rows) if watched else None,
        set_aside=sum(int(r.get("arithmetic_demoted") or 0) for r in rows) if key.check_arithmetic else None)


def watches_helper(row: dict) -> bool:
    """The detector watched the row's helper candidates."""
    return float(row["config"].get("helper_tau_compression") or 0.0) > 0


def accuracy_recovered(kvrescue: float, bon: float, full: float) -> float | None:
    """(acc_kvrescue - acc_bon) / (acc_full - acc_bon) in %; None when full does not beat bon."""
    if full - bon <= 0:
        return None
    return 100.0 * (kvrescue - bon) / (full - bon)


def same_setup(a: Summary, b: Summary) -> bool:
    """Comparable: pooled, or the same settings and prompt and the same file for each model both used."""
    if a.setup is None or b.setup is None:
        return a.key.setup == b.key.setup
    return not differences(a.setup, b.setup, ignore=("seed",))


def summaries(rows: list[dict], pool_setups: bool = False) -> list[Summary]:
    groups = group_rows(rows, pool_setups)
    out = [summarize(key, group) for key, group in groups.items()]

    def reference(mode: Mode, s: Summary, *axes: str) -> Summary | None:
        return next((r for r in out if r.key.mode == mode and r.key.dataset == s.key.dataset and
                     all(getattr(r.key, a) == getattr(s.key, a) for a in axes) and same_setup(r, s)), None)

    for s in out:
        if s.key.mode != Mode.KVRESCUE:
            continue
        f = reference(Mode.FULL, s, "n", *BASE_AXES) or min(
            (r for r in out if r.key.mode == Mode.FULL and r.key.dataset == s.key.dataset and same_setup(r, s)
             and all(getattr(r.key, a) == getattr(s.key, a) for a in BASE_AXES)),
            key=lambda r: r.key.n, default=None)
        b = reference(Mode.BON, s, "budget", "n", "policy", *BASE_AXES)
        if f and b:
            recover(s, groups[s.key], groups[b.key], groups[f.key])
            s.recovered_full_n = f.key.n
    return out


def recover(s: Summary, kvrescue: list[dict], bon: list[dict], full: list[dict]) -> None:
    """The accuracy recovered and the base-token ratio, on the problems all three configurations ran (a sweep
    in progress has more rows of some than of others)."""
    key = problem_keys(kvrescue, bon, full)
    correct = [correct_by_problem(rows, key) for rows in (kvrescue, bon, full)]
    common = set.intersection(*(set(c) for c in correct))
    if not common:
        return
    accuracy = [100.0 * sum(c[i] for i in common) / len(common) for c in correct]
    base_tokens = [sum(float(r["tokens"].get("base") or 0.0) for r in rows if key(r) in common)
                   for rows in (kvrescue, bon)]
    s.recovered = accuracy_recovered(*accuracy)
    s.recovered_problems = len(common)
    s.base_token_ratio = base_tokens[0] / base_tokens[1] if base_tokens[1] > 0 else None


def setup_notes(items: list[Summary]) -> list[str]:
    """Where one configuration holds several setups: per configuration, what each of its setups differs in from
    its first, values in the order the setups are named."""
    groups: dict[ConfigKey, list[Summary]] = {}
    for s in items:
        groups.setdefault(dataclasses.replace(s.key, setup=""), []).append(s)
    notes = []
    for key, group in groups.items():
        first = group[0]
        for other in group[1:]:
            if first.setup is None or other.setup is None:
                unrecorded = first if first.setup is None else other
                what = f"setup {unrecorded.key.setup} was not recorded (rows written before setups were)"
            else:
                diff = differences(first.setup, other.setup, ignore=("seed",))
                roles = sorted(set(first.setup["models"]) ^ set(other.setup["models"]))
                one_sided = [f"{k} {s.setup['settings'][k]!r} recorded by {s.key.setup} only"
                             for k in sorted(set(first.setup["settings"]) ^ set(other.setup["settings"]))
                             for s in (first, other) if k in s.setup["settings"]]
                what = "; ".join(diff + one_sided + ([f"models recorded for {', '.join(roles)}"] if roles else []))
            notes.append(f"{key.dataset + ' ' if key.dataset else ''}{key.label}: setup {first.key.setup} vs "
                         f"{other.key.setup}: {what}")
    if notes:
        notes.insert(0, "setups (model files, prompt template, settings; seeds aside) differ within a configuration:")
    return notes


@dataclass(frozen=True)
class Oracle:
    """The better of the evicted base's and the helper's answers, problem by problem (an upper bound on a
    perfect choice between the two)."""

    bon: ConfigKey
    problems: int
    bon_pass1: float  # %, on these problems
    helper_pass1: float
    oracle_pass1: float
    full_pass1: float | None  # the full row's, on these problems when it has them all
    gap_closed: float | None  # % of (full - bon) that the oracle closes


def problem_of(row: dict) -> tuple[str, str]:
    """What rows are paired by: the problem's id and, where recorded, the fingerprint of its text and gold answer
    (rows of one id that solved different text are not the same problem)."""
    return str(row["id"]), row.get("problem_sha256") or ""


def problem_keys(*row_lists: list[dict]) -> Callable[[dict], tuple[str, str]]:
    """problem_of for rows compared with each other, where a row from before fingerprints were recorded takes the
    one fingerprint the compared rows of its id hold: it pairs with them by id, as it did before, unless they
    solved texts of more than one fingerprint."""
    seen: dict[str, set[str]] = {}
    for rows in row_lists:
        for row in rows:
            if row.get("problem_sha256"):
                seen.setdefault(str(row["id"]), set()).add(row["problem_sha256"])

    def key(row: dict) -> tuple[str, str]:
        problem, fingerprint = problem_of(row)
        known = seen.get(problem, set())
        return (problem, next(iter(known))) if not fingerprint and len(known) == 1 else (problem, fingerprint)

    return key


def correct_by_problem(rows: list[dict], key: Callable[[dict], tuple[str, str]] = problem_of) -> dict[tuple[str, str], bool]:
    return {key(r): bool(r["correct"]) for r in rows}


def paired(groups: dict[ConfigKey, list[dict]], a: ConfigKey, b: ConfigKey) -> tuple[dict, dict, list[tuple[str, str]]]:
    """Each configuration's correctness by problem (problem_of), and the problems both ran."""
    key = problem_keys(groups[a], groups[b])
    x, y = correct_by_problem(groups[a], key), correct_by_problem(groups[b], key)
    return x, y, sorted(set(x) & set(y))


def partners(groups: dict[ConfigKey, list[dict]], of: ConfigKey, **same) -> list[ConfigKey]:
    """The configurations with the given fields that share `of`'s dataset, N, settings and prompt (not its models:
    the helper runs other models than the base, and random choice loads no PRM), in the report's order."""
    return [k for k in groups if k.dataset == of.dataset and k.n == of.n
            and all(getattr(k, name) == value for name, value in same.items())
            and settings_label(groups[k][0]) == settings_label(groups[of][0])]


def partner(groups: dict[ConfigKey, list[dict]], of: ConfigKey, **same) -> ConfigKey | None:
    """The first of `partners`."""
    return next(iter(partners(groups, of, **same)), None)


def oracles(rows: list[dict], pool_setups: bool = False) -> list[Oracle]:
    groups = group_rows(rows, pool_setups)
    out = []
    for bon in (k for k in groups if k.mode == Mode.BON):
        helper = partner(groups, bon, mode=Mode.HELPER, helper_kv_cache=bon.kv_cache)
        full = partner(groups, bon, mode=Mode.FULL, weights=bon.weights, kv_cache=bon.kv_cache)
        if helper is None:
            continue
        b, h, common = paired(groups, bon, helper)
        if not common:
            continue
        f = correct_by_problem(groups[full], problem_keys(groups[bon], groups[helper], groups[full])) if full else {}
        pct = lambda flags: 100.0 * sum(flags) / len(common)  # noqa: E731
        oracle = pct(b[i] or h[i] for i in common)
        full_pass1 = pct(f[i] for i in common) if all(i in f for i in common) else None
        gap = accuracy_recovered(oracle, pct(b[i] for i in common), full_pass1) if full_pass1 is not None else None
        out.append(Oracle(bon, len(common), pct(b[i] for i in common), pct(h[i] for i in common), oracle,
                          full_pass1, gap))
    return out


@dataclass(frozen=True)
class PairedComparison:
    """Two configurations problem by problem: KV-Rescue by the PRM's choice against random choice (the PRM's worth
    in the loop), or two setups of one configuration."""

    a: ConfigKey
    b: ConfigKey
    problems: int  # both ran
    a_pass1: float  # %, on these problems
    b_pass1: float
    low: float  # 95% paired bootstrap interval of a_pass1 - b_pass1, in points
    high: float


def compare(groups: dict[ConfigKey, list[dict]], a: ConfigKey, b: ConfigKey, rng, draws: int) -> PairedComparison | None:
    x, y, common = paired(groups, a, b)
    if not common:
        return None
    diff = np.array([float(x[i]) - float(y[i]) for i in common])
    means = diff[rng.integers(len(diff), size=(draws, len(diff)))].mean(axis=1)
    low, high = np.percentile(100.0 * means, [2.5, 97.5])
    return PairedComparison(a, b, len(common), 100.0 * sum(x[i] for i in common) / len(common),
                            100.0 * sum(y[i] for i in common) / len(common), float(low), float(high))


def comparisons(rows: list[dict], pool_setups: bool, draws: int, seed: int,
                pairs: Callable[[dict[ConfigKey, list[dict]], ConfigKey], list[ConfigKey]]) -> list[PairedComparison]:
    """Each configuration (a) against each configuration `pairs` gives it (b), on the problems both ran."""
    groups = group_rows(rows, pool_setups)
    rng = np.random.default_rng(seed)
    return [c for a in list(groups) for b in pairs(groups, a) if (c := compare(groups, a, b, rng, draws))]


def choice_comparisons(rows: list[dict], pool_setups: bool = False, draws: int = 2000,
                       seed: int = 0) -> list[PairedComparison]:
    """Each configuration where the PRM chooses (a) against its random-choice partner (b)."""
    def random_partner(groups, a):
        if a.mode != Mode.KVRESCUE or a.choice != "prm":
            return []
        return partners(groups, a, mode=Mode.KVRESCUE, choice="random", budget=a.budget, policy=a.policy,
                        weights=a.weights, kv_cache=a.kv_cache, helper_kv_cache=a.helper_kv_cache)[:1]
    return comparisons(rows, pool_setups, draws, seed, random_partner)


def rule_comparisons(rows: list[dict], pool_setups: bool = False, draws: int = 2000,
                     seed: int = 0) -> list[PairedComparison]:
    """Each KV-Rescue configuration committing by a rule, the PRM's favourite included, not by a random draw (a)
    against evicted best-of-N (b) at its budget, N and policy."""
    def best_of_n(groups, a):
        if a.mode != Mode.KVRESCUE or a.choice == "random":
            return []
        return partners(groups, a, mode=Mode.BON, budget=a.budget, policy=a.policy, weights=a.weights,
                        kv_cache=a.kv_cache)[:1]
    return comparisons(rows, pool_setups, draws, seed, best_of_n)


def judge_comparisons(rows: list[dict], pool_setups: bool = False, draws: int = 2000,
                      seed: int = 0) -> list[PairedComparison]:
    """Each KV-Rescue configuration committing by another rule than the PRM's favourite or a random draw (a) against
    every setup of the PRM's favourite (b) at its budget, N and policy: what the rule changes over the judge."""
    def judged(groups, a):
        if a.mode != Mode.KVRESCUE or a.choice in ("prm", "random"):
            return []
        return partners(groups, a, mode=Mode.KVRESCUE, choice="prm", budget=a.budget, policy=a.policy,
                        weights=a.weights, kv_cache=a.kv_cache, helper_kv_cache=a.helper_kv_cache)
    return comparisons(rows, pool_setups, draws, seed, judged)


def check_comparisons(rows: list[dict], pool_setups: bool = False, draws: int = 2000,
                      seed: int = 0) -> list[PairedComparison]:
    """Each configuration whose rounds set aside false arithmetic (a) against the same configuration without the
    check (b), of the same setup but for the check (the same rule's parameters too): what the check alone changes."""
    def unchecked(groups, a):
        if not a.check_arithmetic:
            return []
        found = partners(groups, a, mode=a.mode, choice=a.choice, budget=a.budget, policy=a.policy, weights=a.weights,
                         kv_cache=a.kv_cache, helper_kv_cache=a.helper_kv_cache, check_arithmetic=False)
        wanted = setup_label(without_check(groups[a][0]))
        return [b for b in found if not a.setup or b.setup == wanted]
    return comparisons(rows, pool_setups, draws, seed, unchecked)


def without_check(row: dict) -> dict:
    """The row with its rule's arithmetic check taken off where its setup records the rule: the setup of the same
    configuration unchecked."""
    settings = (row.get("setup") or {}).get("settings") or {}
    rule = rule_of(str(settings.get("rule", "judge")))
    if not isinstance(rule, Arith) or "rule" not in settings:
        return row
    return {**row, "setup": {**row["setup"], "settings": {**settings, "rule": rule.rule.spec}}}



def setup_comparisons(rows: list[dict], draws: int = 2000, seed: int = 0) -> list[PairedComparison]:
    """Each further setup of a configuration (a) against its first in the report's order (b)."""
    groups = group_rows(rows)
    rng = np.random.default_rng(seed)
    firsts: dict[ConfigKey, ConfigKey] = {}
    out = []
    for key in groups:
        first = firsts.setdefault(dataclasses.replace(key, setup=""), key)
        if first != key and (c := compare(groups, key, first, rng, draws)):
            out.append(c)
    return out
