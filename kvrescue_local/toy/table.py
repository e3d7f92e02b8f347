"""The paper's Table 2 in miniature, on the toy preset: every mode, three KV budgets, N = 1 and 8.

Budgets are scaled to the task (a prompt of ~80 byte tokens, a solution of ~50-150): the base keeps
`budget` entries chosen by R-KV (the project's default policy: the 8 newest, the rest by attention
minus redundancy), evicting back to it each time `BUFFER` more arrive, so at 48 it has
lost most of the prompt before it writes its first step. The trajectory cap is MAX_TOKENS committed
tokens (twice a long solution) or MAX_STEPS steps; a trajectory is *degenerate* when it is wrong and
hit one of these caps (the paper: wrong with >= 256 committed steps, for solutions of ~27).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from ..detect import DetectorParams
from ..eviction import KVBudget
from ..rescue import Rescue, RescueConfig
from .task import TOY_PROMPT, Problem, grade, problems

BUDGETS = (48, 64, 96)
BUFFER = 16
MAX_TOKENS = 320
MAX_STEPS = 32
MAX_STEP_TOKENS = 32
EVAL_SEED = 0  # training draws its problems from other seeds
CAPS = ("max_tokens", "max_steps")
# R-KV keeps the ledger entries the base attends to but not its place in the question: the evicted
# base looks values up right for the wrong terms and runs past the last one (some to the cap).
# Sinks + recent window ("streaming") lose both: it writes wrong values, fluently, and stops.
POLICY = "rkv"


@dataclass(frozen=True)
class Row:
    mode: str
    n: int
    budget: int | None = None

    @property
    def label(self) -> str:
        name = {"full": "full KV", "bon": "evicted best-of-N", "helper": "helper alone", "kvrescue": "KV-Rescue"}[self.mode]
        return f"{name} @{self.budget}" if self.budget else name


# Windows scaled to steps of ~4-16 byte tokens (the defaults suit real models' steps of ~50-200)
TOY_DETECTOR = DetectorParams(entropy_window=8, text_window=64, check_every=4)


def detector_params(preset) -> DetectorParams:
    """The preset's calibrated thresholds (detector.json beside its models), else the toy defaults."""
    from ..detect.calibrate import load_params

    path = preset.base.parent / "detector.json"
    return load_params(path) if path.exists() else TOY_DETECTOR


def toy_config(row: Row, seed: int = 0, detector: DetectorParams = TOY_DETECTOR, policy: str = POLICY) -> RescueConfig:
    kv = KVBudget(budget=row.budget or BUDGETS[0], buffer=BUFFER, window=8, policy=policy)
    return RescueConfig(mode=row.mode, n=row.n, kv=kv, detector=detector, max_tokens=MAX_TOKENS,
                        max_steps=MAX_STEPS, max_step_tokens=MAX_STEP_TOKENS, seed=seed, prompt=TOY_PROMPT,
                        temperature=1.0, top_p=1.0)


def table_rows(ns: Iterable[int] = (1, 8), budgets: Iterable[int] = BUDGETS) -> list[Row]:
    budgets = list(budgets)
    rows = []
    for n in ns:
        rows += [Row("full", n), *(Row("bon", n, b) for b in budgets), Row("helper", n),
                 *(Row("kvrescue", n, b) for b in budgets)]
    return rows


def summarize(row: Row, probs: list[Problem], records: list[dict], seconds: float) -> dict:
    correct = [grade(p, r["answer"]) for p, r in zip(probs, records)]
    base = [c for r in records for s in r["steps"] for c in s["candidates"] if c["side"] == "base"]
    n = len(records)
    return {"setting": row.label, "mode": row.mode, "budget": row.budget, "n": row.n, "problems": n,
            "accuracy": 100 * sum(correct) / n,
            "degenerate": 100 * sum(not ok and r["stop"] in CAPS for ok, r in zip(correct, records)) / n,
            "base_tokens": sum(r["tokens"]["base"] for r in records) / n,
            "helper_tokens": sum(r["tokens"]["helper"] for r in records) / n,
            "steps": sum(r["n_steps"] for r in records) / n,
            "early_exit": 100 * sum(c["finished"] == "killed" for c in base) / max(1, len(base)),
            "per_minute": 60 * n / seconds}


def run_table(preset, rows: list[Row], count: int, seed: int = 0, detector: DetectorParams = TOY_DETECTOR,
              policy: str = POLICY, progress: Callable[[int], None] = lambda k: None) -> list[dict]:
    """Solve the same `count` held-out problems under every row; one summary dict per row."""
    from ..prm import PRM, PRMParams
    from ..runtime import Model

    probs = problems(EVAL_SEED + seed, count)
    base, helper = Model(preset.base), Model(preset.helper)
    prm = PRM(preset.prm, PRMParams(n_ctx=2048, max_candidates=2 * max(r.n for r in rows), flash_attn="off"))
    results = []
    for row in rows:
        engine = Rescue(toy_config(row, seed, detector, policy), base, helper, prm)
        started, records = time.perf_counter(), []
        for p in probs:
            records.append(engine.solve(p.text).record())
            progress(1)
        results.append(summarize(row, probs, records, time.perf_counter() - started))
    return results


def calibrate_detector(preset, count: int = 40, budget: int = BUDGETS[0], n: int = 8,
                       progress: Callable[[int], None] = lambda k: None) -> tuple[DetectorParams, dict]:
    """Thresholds fitted (detect.calibrate, no labels) to the base candidates of KV-Rescue runs with the
    detector disarmed, on problems that the table never uses."""
    from ..detect import calibrate
    from ..prm import PRM, PRMParams
    from ..runtime import Model

    disarmed = dataclasses.replace(TOY_DETECTOR, tau_entropy=1e6, tau_compression=1e-6)
    engine = Rescue(toy_config(Row("kvrescue", n, budget), detector=disarmed), Model(preset.base),
                    Model(preset.helper), PRM(preset.prm, PRMParams(n_ctx=2048, max_candidates=2 * n, flash_attn="off")))
    stats = []
    for p in problems(EVAL_SEED + 10_000, count):
        record = engine.solve(p.text).record()
        stats += [c["detector"] for s in record["steps"] for c in s["candidates"] if c["side"] == "base"]
        progress(1)
    return calibrate(stats, TOY_DETECTOR)


COLUMNS = (("n", "N", 2, 0), ("accuracy", "acc %", 6, 1), ("degenerate", "degen %", 7, 1),
           ("base_tokens", "base tok", 8, 1), ("helper_tokens", "help tok", 8, 1), ("steps", "steps", 6, 1),
           ("early_exit", "exit %", 6, 1), ("per_minute", "prob/min", 8, 0))


def format_table(results: list[dict]) -> str:
    """The table, then for each N the share of the accuracy lost to eviction that KV-Rescue recovers."""
    width = max(len(r["setting"]) for r in results)
    lines = ["  ".join(["setting".ljust(width), *(h.rjust(w) for _, h, w, _ in COLUMNS)])]
    lines += ["  ".join([r["setting"].ljust(width), *(f"{r[k]:>{w}.{p}f}" for k, _, w, p in COLUMNS)])
              for r in results]
    for n in sorted({r["n"] for r in results}):
        full = next((r for r in results if r["n"] == n and r["mode"] == "full"), None)
        for rescue in (r for r in results if r["n"] == n and r["mode"] == "kvrescue"):
            bon = next((r for r in results if r["n"] == n and r["mode"] == "bon" and r["budget"] == rescue["budget"]), None)
            if full and bon and full["accuracy"] > bon["accuracy"]:
                share = (rescue["accuracy"] - bon["accuracy"]) / (full["accuracy"] - bon["accuracy"])
                lines.append(f"N={n} budget {rescue['budget']}: eviction costs {full['accuracy'] - bon['accuracy']:.1f} "
                             f"points; KV-Rescue recovers {100 * share:.0f}% of them with "
                             f"{rescue['base_tokens'] / max(bon['base_tokens'], 1e-9):.2f}x the base tokens")
    return "\n".join(lines)
