"""The paper's Table 3 from results rows: problems per minute and peak KV bytes per configuration and
concurrency K, and the memory-capped view.

- problems/min: from wall clock at that concurrency: per run (one `bench run` of one configuration), its
  problems over the elapsed time of its last row; runs are summed (60 · Σ problems / Σ seconds). Never
  from summed per-problem times, which overlap when problems run side by side.
- peak KV: the most KV bytes the run's caches held at the end of a round (base, helper and PRM, each
  counted by the cells its sequences hold: shared cells once), the largest over the rows.
- FA: the flash-attention kernel the run decoded with (`engine.flash_attn`; "-" in rows from before it was
  recorded): on a CPU it changes the speed at K > 1 twice over, so runs of each are kept apart.
- memory-capped: at a fixed KV byte budget, how many problems each configuration fits at once (the budget
  over its KV bytes per problem, peak / K at its largest measured K) and the best problems/min measured at a
  K that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from .metrics import ConfigKey, config_key


@dataclass(frozen=True)
class Throughput:
    key: ConfigKey
    concurrency: int
    problems: int
    pass1: float  # %
    per_minute: float | None
    kv_peak: int  # bytes, every cache
    kv_parts: dict[str, int]  # bytes per cache at that peak
    flash_attn: str = "-"

    @property
    def kv_per_problem(self) -> float:
        return self.kv_peak / self.concurrency


def throughputs(rows: list[dict], pool_setups: bool = False) -> list[Throughput]:
    groups: dict[tuple[ConfigKey, int, str], list[dict]] = {}
    for row in rows:
        if isinstance(row.get("engine"), dict):
            engine = row["engine"]
            groups.setdefault((config_key(row, pool_setups), int(engine["concurrency"]), engine.get("flash_attn", "-")),
                              []).append(row)
    out = []
    for (key, k, flash_attn), group in groups.items():
        runs: dict[str, list[dict]] = {}
        for row in group:
            runs.setdefault(str(row["engine"]["run"]), []).append(row)
        seconds = sum(max(float(r["engine"]["elapsed"]) for r in run) for run in runs.values())
        peak = max(group, key=lambda r: sum(r["engine"]["kv_peak_bytes"].values()))["engine"]["kv_peak_bytes"]
        out.append(Throughput(key, k, len(group), 100.0 * sum(bool(r["correct"]) for r in group) / len(group),
                              60.0 * len(group) / seconds if seconds > 0 else None, sum(peak.values()), dict(peak),
                              flash_attn))
    return sorted(out, key=lambda t: (t.key.dataset, t.key.mode_rank, -1 if t.key.budget is None else t.key.budget,
                                      t.key.n, t.key.policy or "", t.key.setup, t.concurrency, t.flash_attn))


def same_axes(a: ConfigKey, b: ConfigKey) -> bool:
    """The same sweep axes (a bon and a kvrescue row differ in setup: kvrescue loads the helper too)."""
    return (a.dataset, a.budget, a.n, a.policy) == (b.dataset, b.budget, b.n, b.policy)
