"""The budget of the rule by budget (rescue/rules/by_budget.py), fitted per dataset on rows of training problems.

Where the evicted base solves fewer training problems than the helper alone, its view is too broken for its own
steps to come first, and the judge's pick, which lets the helper's steps in, is the rule; where it solves more, the
base's step comes first (base-first), so the loop cannot make the base worse than its own trajectory. The fitted
budget is the largest measured budget B such that at every measured budget up to B, evicted best-of-N at N = 1
solved fewer of the problems than the helper alone, on the problems both ran; 0 where the smallest measured budget
already favours the base. It is fitted per dataset: the regime belongs to the pair and the task, not to the budget
alone (the training problems of GSM8K and MATH500 put the crossing at different budgets: docs/prm.md).

Where the base is the weaker writer, the rule is the judge's pick calibrated per source on a dataset whose training
steps the judge was trained on (its rows are given: the judge's ranking of that dataset's steps was cross-validated
there) and whose KV-Rescue training rows fitted a calibration, and the helper's step first elsewhere. A judge not
known to rank a dataset's steps would pick between the writers on a guess; one that ranks them, uncalibrated, still
compares one writer's rewards with the other's on one scale, and on MATH500 it scored the weaker writer's steps the
higher on average (docs/prm.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..bench.metrics import problem_keys
from ..errors import KVRescueError
from ..rescue.rules import Arith, ByBudget, Calibrated, Lead, Rule
from .examples import check_split

# the pick's margin of each side's favourite in the fitted rules: above the layout noise of the judge's rewards, so
# that the pick of near-equal steps does not depend on what shared their decodes (docs/prm.md)
PICK_MARGIN = 0.005


def regime_rule(judge_max_budget: int = 0, weak_base_choice: str = "helper-first", calibration=None,
                helper_margin: float = 1.0, check_arithmetic: bool = False) -> Rule:
    """The fitted rule: up to judge_max_budget the calibrated pick ("calibrated") or the helper's step first
    ("helper-first"), the base's step first above it (with the helper's step let in where it is rewarded more than
    helper_margin above), all inside the arithmetic check where it was fitted on."""
    fit = None if calibration is None else tuple(float(x) for x in calibration)
    weak = (Calibrated(fit) if weak_base_choice == "calibrated"
            else Lead("helper", 1.0, PICK_MARGIN))
    rule = ByBudget(int(judge_max_budget), weak, Lead("base", float(helper_margin), PICK_MARGIN))
    return Arith(rule) if check_arithmetic else rule


def rule_parameters(rule: Rule) -> dict:
    """What regime_rule builds a rule from, read back from one it built (a stored commit.json's)."""
    out: dict = {"check_arithmetic": isinstance(rule, Arith)}
    inner = rule.rule if isinstance(rule, Arith) else rule
    if isinstance(inner, ByBudget):
        out["judge_max_budget"] = inner.budget
        out["weak_base_choice"] = "calibrated" if isinstance(inner.up_to, Calibrated) else "helper-first"
        if isinstance(inner.up_to, Calibrated) and inner.up_to.fit is not None:
            out["calibration"] = list(inner.up_to.fit)
        if isinstance(inner.above, Lead):
            out["helper_margin"] = inner.above.margin
    return out


@dataclass(frozen=True)
class BudgetScore:
    budget: int
    problems: int  # the training problems evicted best-of-N at this budget and the helper alone both ran
    evicted: int  # of them, solved by evicted best-of-N
    helper: int  # solved by the helper alone

    @property
    def base_weaker(self) -> bool:
        return self.evicted < self.helper


@dataclass(frozen=True)
class RegimeFit:
    dataset: str
    scores: tuple[BudgetScore, ...]  # by budget, ascending
    judge_max_budget: int
    # "calibrated" where the judge was trained on the dataset's steps and calibrated on its rows, else "helper-first"
    weak_base_choice: str

    def rule(self) -> dict:
        """Its part of regime_rule's parameters."""
        return {"judge_max_budget": self.judge_max_budget, "weak_base_choice": self.weak_base_choice}


def one_candidate(rows: list[dict], mode: str) -> list[dict]:
    """The finished rows of `mode` at N = 1."""
    return [r for r in rows if not r.get("error") and (r.get("config") or {}).get("mode") == mode
            and (r.get("config") or {}).get("n") == 1]


def fit_regime(rows: list[dict], where: str, judged: Iterable[str] = (), calibrated: Iterable[str] = ()) -> list[RegimeFit]:
    """Per dataset, the regime budget from evicted best-of-N (N = 1, one eviction policy) and helper-alone rows of
    its training problems (any evaluation row is refused). The weak base's rule is the judge's calibrated pick on the
    datasets both in `judged` (their training steps trained the judge) and in `calibrated` (a calibration fitted on
    their KV-Rescue training rows: commit.py), the helper's step first on the others."""
    judged, calibrated = set(judged), set(calibrated)
    check_split(rows, "train", where)
    fits = []
    for dataset in sorted({str(r.get("dataset")) for r in rows}):
        mine = [r for r in rows if str(r.get("dataset")) == dataset]
        evicted, helper = one_candidate(mine, "bon"), one_candidate(mine, "helper")
        policies = {r["config"].get("policy") for r in evicted}
        if len(policies) > 1:
            raise KVRescueError(f"{where}: {dataset}'s best-of-N rows evict by {len(policies)} policies "
                                f"({', '.join(sorted(map(str, policies)))}): fit on rows of the preset's one")
        if not evicted or not helper:
            continue
        key = problem_keys(evicted, helper)
        helper_right = {key(r): bool(r.get("correct")) for r in helper}
        scores = []
        for budget in sorted({int(r["config"]["budget"]) for r in evicted}):
            paired = {key(r): bool(r.get("correct")) for r in evicted
                      if int(r["config"]["budget"]) == budget and key(r) in helper_right}
            if paired:
                scores.append(BudgetScore(budget, len(paired), sum(paired.values()),
                                          sum(helper_right[k] for k in paired)))
        judge_max_budget = 0
        for score in scores:
            if not score.base_weaker:
                break
            judge_max_budget = score.budget
        if scores:
            fits.append(RegimeFit(dataset, tuple(scores), judge_max_budget,
                                  "calibrated" if dataset in judged & calibrated else "helper-first"))
    if not fits:
        raise KVRescueError(f"{where}: no dataset has both evicted best-of-N and helper-alone rows at N = 1 on the same "
                            "training problems: run `bench run --split train --modes bon,helper --ns 1 --budgets ...`")
    return fits


def default_rule(rules: Iterable[dict]) -> dict:
    """The rule's parameters for problems of no known dataset (solve, serve), from the datasets' (RegimeFit.rule):
    the smallest fitted budget, where the base was the weaker writer on every dataset measured, and there the
    helper's step first: no calibration was fitted on the problem's dataset."""
    return {"judge_max_budget": min(r["judge_max_budget"] for r in rules), "weak_base_choice": "helper-first"}
