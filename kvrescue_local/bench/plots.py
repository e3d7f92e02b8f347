"""The paper's figures from a results JSONL file, as PNGs (matplotlib is the optional `plot` extra).

- `pass1_vs_budget[-<dataset>].png` (Figure 5): pass@1 against the base's KV budget, one line per
  evicting mode (bon, kvrescue) and N; full and helper, which do not evict, as horizontal lines.
- `step_sources[-<dataset>].png` (Figure 6): share of committed steps written by the base and by the
  helper, per budget (and N) of the kvrescue rows.
- `memory_accuracy[-<dataset>].png`: pass@1 against the evicted base's KV bytes per sequence (budget × the
  bytes of a cell of its KV cache types, as its rows record them), one line per evicting mode and weight type, its
  points the budgets and KV cache types; full KV of each weight type as a horizontal line.
- `detector_stats[-<dataset>].png` (Figure 3): histograms of the base candidates' maximum windowed
  mean entropy and minimum compression ratio, killed candidates stacked on top, with the configured
  thresholds as vertical lines.
- `regime_map[-<dataset>].png`: the share of the accuracy lost to eviction that KV-Rescue recovers against the
  helper's pass@1 as a fraction of full KV's, one line per budget (and N), the oracle pick between whole answers
  dashed beside each (rows of several helpers: bench/regime.py).
Only the figures the data supports are written (no kvrescue rows: no Figure 6, and so on).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import KVRescueError
from ..files import Reads, check_not_read, write_figure
from ..rescue import Mode
from .metrics import Summary, summaries
from .regime import RegimePoint, regime_map

COLOURS = {"full": "#333333", "helper": "#e08a1e", "bon": "#c0392b", "kvrescue": "#1f6fb2"}
PLOTS = ("pass1_vs_budget", "step_sources", "memory_accuracy", "detector_stats", "regime_map")  # each written as PLOT[-dataset].png
BASE_COLOUR, HELPER_COLOUR, KILLED_COLOUR = "#1f6fb2", "#e08a1e", "#c0392b"


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise KVRescueError("plots need matplotlib: pip install 'kvrescue-local[plot]'") from None
    return Figure


def _suffix(dataset: str, several: bool) -> str:
    if not several:
        return ""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in dataset)
    return f"-{safe or 'unnamed'}"


def pass1_vs_budget(items: list[Summary], path: Path, title: str = "") -> Path | None:
    Figure = _figure_class()
    evicting = [s for s in items if s.key.evicts and s.key.budget is not None]
    flat = [s for s in items if not s.key.evicts]
    if not evicting and not flat:
        return None
    fig = Figure(figsize=(7, 4.5), dpi=110)
    ax = fig.add_subplot()
    policies = {s.key.policy for s in evicting}
    lines: dict[tuple, list[Summary]] = {}
    for s in evicting:
        lines.setdefault((s.key.mode_label, s.key.n, s.key.policy), []).append(s)
    markers = "osD^v<>"
    ns = sorted({s.key.n for s in items})
    for (mode, n, policy), group in sorted(lines.items()):
        group.sort(key=lambda s: s.key.budget)
        label = f"{mode} N={n}" + (f" {policy}" if len(policies) > 1 else "")
        ax.plot([s.key.budget for s in group], [s.pass1 for s in group], marker=markers[ns.index(n) % len(markers)],
                color=COLOURS.get(mode), linestyle="-" if ns.index(n) == 0 else "--", label=label)
    styles = [":", "-.", (0, (1, 3)), (0, (5, 5))]
    for s in flat:
        ax.axhline(s.pass1, color=COLOURS.get(s.key.mode), linestyle=styles[ns.index(s.key.n) % len(styles)],
                   linewidth=1.5, label=f"{s.key.mode} N={s.key.n} (no eviction)")
    budgets = sorted({s.key.budget for s in evicting})
    if budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        if len(budgets) == 1:
            ax.set_xlim(budgets[0] / 1.5, budgets[0] * 1.5)
    return finish_pass1(fig, ax, path, "base KV budget (entries)", title or "pass@1 vs KV budget", legend_size=8)


def finish_pass1(fig, ax, path: Path, xlabel: str, title: str, legend_size: int) -> Path:
    """Label a pass@1 figure's axes and write it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("pass@1 (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=legend_size, loc="best")
    fig.tight_layout()
    write_figure(fig, path, "--plots")
    return path


def memory_accuracy(items: list[Summary], path: Path, title: str = "") -> Path | None:
    Figure = _figure_class()
    points = [(s, s.budget_kv_bytes) for s in items if s.key.evicts]
    points = [(s, x) for s, x in points if x is not None]
    if not points:
        return None
    fig = Figure(figsize=(7.5, 4.8), dpi=110)
    ax = fig.add_subplot()
    weights = sorted({s.key.weights for s, _ in points} | {s.key.weights for s in items if s.key.mode == Mode.FULL})
    colours = ["#1f6fb2", "#c0392b", "#2e8b57", "#8e44ad", "#e08a1e", "#333333", "#16a085", "#7f8c8d"]
    colour = {w: colours[i % len(colours)] for i, w in enumerate(weights)}
    several_n = len({s.key.n for s, _ in points}) > 1
    several_caches = len({s.key.kv_cache for s, _ in points}) > 1
    lines: dict[tuple, list[tuple[Summary, float]]] = {}
    for s, x in points:
        lines.setdefault((s.key.mode_label, s.key.weights, s.key.n), []).append((s, x))
    for (mode, weight, n), group in sorted(lines.items()):
        group.sort(key=lambda item: (item[1], item[0].key.budget))
        ax.plot([x / 1024 for _, x in group], [s.pass1 for s, _ in group], color=colour[weight],
                linestyle="-" if mode == "kvrescue" else "--", marker="o" if mode == "kvrescue" else "s",
                label=f"{mode} {weight or 'base'}" + (f" N={n}" if several_n else ""))
        for s, x in group if several_caches else []:  # which KV cache types a point ran with
            ax.annotate(f"{s.key.kv_cache} b{s.key.budget}", (x / 1024, s.pass1), fontsize=6, alpha=0.7,
                        textcoords="offset points", xytext=(3, 3))
    for s in items:
        if s.key.mode == Mode.FULL and (s.key.weights in colour):
            ax.axhline(s.pass1, color=colour[s.key.weights], linestyle=":", linewidth=1.2,
                       label=f"full KV {s.key.weights or 'base'} {s.key.kv_cache}" + (f" N={s.key.n}" if several_n else ""))
    ax.set_xscale("log", base=2)
    ticks = sorted({x / 1024 for _, x in points})
    ax.set_xticks(ticks, [f"{t:,.1f}" for t in ticks], fontsize=7)
    ax.minorticks_off()
    return finish_pass1(fig, ax, path, "base KV per sequence (KiB): budget x bytes per cell of its KV cache types",
                        title or "pass@1 vs KV memory", legend_size=7)


def step_sources(items: list[Summary], path: Path, title: str = "") -> Path | None:
    Figure = _figure_class()
    rows = [s for s in items if s.key.mode == Mode.KVRESCUE and sum(s.steps_from.values()) > 0]
    if not rows:
        return None
    several_n = len({s.key.n for s in rows}) > 1
    several_policies = len({s.key.policy for s in rows}) > 1
    labels, base_share, helper_share = [], [], []
    for s in rows:
        label = f"{s.key.budget}"
        if several_n:
            label += f"\nN={s.key.n}"
        if several_policies:
            label += f"\n{s.key.policy}"
        total = s.steps_from.get("base", 0) + s.steps_from.get("helper", 0)
        labels.append(label)
        base_share.append(100.0 * s.steps_from.get("base", 0) / total if total else 0.0)
        helper_share.append(100.0 * s.steps_from.get("helper", 0) / total if total else 0.0)
    fig = Figure(figsize=(max(5, 1.1 * len(rows) + 2), 4.5), dpi=110)
    ax = fig.add_subplot()
    x = list(range(len(rows)))
    ax.bar(x, base_share, color=BASE_COLOUR, label="base (evicted)")
    ax.bar(x, helper_share, bottom=base_share, color=HELPER_COLOUR, label="helper (full KV)")
    for i, (b, h) in enumerate(zip(base_share, helper_share)):
        if b >= 6:
            ax.text(i, b / 2, f"{b:.0f}%", ha="center", va="center", color="white", fontsize=8)
        if h >= 6:
            ax.text(i, b + h / 2, f"{h:.0f}%", ha="center", va="center", color="black", fontsize=8)
    ax.set_xticks(x, labels)
    ax.set_xlabel("base KV budget")
    ax.set_ylabel("committed steps (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title or "kvrescue: who wrote the committed steps")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.tight_layout()
    write_figure(fig, path, "--plots")
    return path


def recovery_by_helper(points: list[RegimePoint], path: Path, title: str = "",
                       references: tuple[tuple[str, float, float], ...] = (),
                       kinds: dict[str, str] | None = None) -> Path | None:
    """The regime map's figure; `references`: measured points of other model pairs placed on the same axes (label,
    helper ratio, recovered %); `kinds`: a kind per helper file name (how it was made weak), one marker per kind:
    helpers of one ratio can recover unlike, by what they get wrong."""
    Figure = _figure_class()
    points = [p for p in points if p.ratio is not None and p.recovered is not None]
    if not points:
        return None
    fig = Figure(figsize=(7.5, 5), dpi=110)
    ax = fig.add_subplot()
    colours = ["#1f6fb2", "#2e8b57", "#c0392b", "#8e44ad", "#e08a1e", "#16a085"]
    kinds = kinds or {}
    markers = {kind: "osD^v<>"[i % 7] for i, kind in enumerate(dict.fromkeys(kinds.values()))}
    several_n = len({p.key.n for p in points}) > 1
    lines: dict[tuple[int, int], list[RegimePoint]] = {}
    for p in points:
        lines.setdefault((p.key.n, p.key.budget), []).append(p)
    for i, ((n, budget), group) in enumerate(sorted(lines.items())):
        group.sort(key=lambda p: p.ratio)
        colour = colours[i % len(colours)]
        label = f"B={budget}" + (f" N={n}" if several_n else "")
        ratios = [p.ratio for p in group]
        ax.plot(ratios, [p.recovered for p in group], color=colour, label=f"KV-Rescue {label}")
        for p in group:
            ax.scatter([p.ratio], [p.recovered], color=colour, marker=markers.get(kinds.get(p.helper), "o"), s=28,
                       zorder=3)
        ax.plot(ratios, [p.oracle_recovered for p in group], color=colour, linestyle="--", linewidth=1, alpha=0.6,
                label=f"oracle pick {label}")
    for kind, marker in markers.items():
        ax.scatter([], [], color="#555555", marker=marker, label=kind)
    for label, ratio, recovered in references:
        ax.scatter([ratio], [recovered], color="black", marker="*", s=90, zorder=3)
        right = ratio > 0.5  # labelled on the side with room
        ax.annotate(label, (ratio, recovered), fontsize=7, textcoords="offset points", xytext=(-8 if right else 8, 4),
                    ha="right" if right else "left")
    ax.axhline(0, color="#999999", linewidth=0.8)
    ax.set_xlim(0, 1.04)
    ax.set_ylim(-5, 105)
    ax.set_xlabel("helper ratio: the helper's pass@1 alone / full-KV base's")
    ax.set_ylabel("accuracy lost to eviction recovered (%)")
    ax.grid(alpha=0.3)
    ax.set_title(title or "when rescue pays: recovery by the helper's strength")
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    write_figure(fig, path, "--plots")
    return path


def hist_bins(values: list[float], n: int = 40) -> list[float]:
    """n equal bins over the values with a 2% margin; the last edge is set exactly (lo + (hi - lo) can round
    below hi, and a value beyond the last edge would silently drop out of the histogram)."""
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    pad = 0.02 * (hi - lo)
    return [lo - pad + (hi - lo + 2 * pad) * k / n for k in range(n)] + [hi + pad]


def detector_stats(rows: list[dict], path: Path, title: str = "") -> Path | None:
    Figure = _figure_class()
    stats = [d for r in rows for d in (r.get("detector") or []) if isinstance(d, dict)]
    if not stats:
        return None
    with_detector = [r for r in rows if r.get("detector")]
    taus = {"max_mean_entropy": sorted({float(r["config"]["tau_entropy"]) for r in with_detector
                                        if isinstance(r["config"].get("tau_entropy"), (int, float))}),
            "min_compression": sorted({float(r["config"]["tau_compression"]) for r in with_detector
                                       if isinstance(r["config"].get("tau_compression"), (int, float))})}
    fig = Figure(figsize=(10, 4), dpi=110)
    panels = [("max_mean_entropy", "max windowed mean entropy (nats)", "τ_ent"),
              ("min_compression", "min compression ratio (zstd; 1.0: window never full)", "τ_cmp")]
    for i, (name, xlabel, tau_name) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        kept = [float(d[name]) for d in stats if isinstance(d.get(name), (int, float)) and not d.get("killed")]
        killed = [float(d[name]) for d in stats if isinstance(d.get(name), (int, float)) and d.get("killed")]
        bins = hist_bins(kept + killed + taus[name])
        ax.hist([kept, killed], bins=bins, stacked=True, color=[BASE_COLOUR, KILLED_COLOUR],
                label=[f"kept ({len(kept)})", f"killed ({len(killed)})"])
        for tau in taus[name]:
            ax.axvline(tau, color="black", linestyle="--", linewidth=1.2, label=f"{tau_name} = {tau:g}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("base candidates")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title or "degeneration detector: base candidates")
    fig.tight_layout()
    write_figure(fig, path, "--plots")
    return path


def write_plots(rows: list[dict], out_dir: str | Path, reads: Reads = ()) -> list[Path]:
    """Every figure the rows support, one set per dataset, never over a file the command reads (`reads`); returns
    the files written."""
    _figure_class()  # fail before creating the directory
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise KVRescueError(f"{out_dir} is a file: pass a directory for the plots")
    if not out_dir.parent.is_dir():
        raise KVRescueError(f"--plots {out_dir}: the folder {out_dir.parent} does not exist: create it first or "
                            "choose a path in an existing folder")
    datasets = sorted({str(r.get("dataset", "")) for r in rows})
    paths = {dataset: {plot: out_dir / f"{plot}{_suffix(dataset, len(datasets) > 1)}.png" for plot in PLOTS}
             for dataset in datasets}
    for path in (path for named in paths.values() for path in named.values()):
        check_not_read(path, "--plots", reads)
    out_dir.mkdir(exist_ok=True)
    written = []
    for dataset in datasets:
        subset = [r for r in rows if str(r.get("dataset", "")) == dataset]
        items = summaries(subset)
        path = paths[dataset]
        name = f" ({dataset})" if dataset else ""
        for made in (pass1_vs_budget(items, path["pass1_vs_budget"], f"pass@1 vs KV budget{name}"),
                     step_sources(items, path["step_sources"], f"kvrescue: share of committed steps{name}"),
                     memory_accuracy(items, path["memory_accuracy"], f"pass@1 vs KV memory{name}"),
                     detector_stats(subset, path["detector_stats"], f"degeneration detector on base candidates{name}"),
                     recovery_by_helper(regime_map(subset), path["regime_map"], f"recovery by the helper's strength{name}")):
            if made:
                written.append(made)
    return written
