"""`kvrescue-local report` (the paper's tables, figures, a trajectory's page) and `estimate`."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import KVRescueError
from ..files import check_not_read, check_writable
from .common import DEFAULTS, parse_size, setting_options


@click.command("report")
@click.argument("results", type=click.Path(path_type=Path), nargs=-1)
@click.option("--markdown", is_flag=True, help="GitHub markdown tables instead of aligned text")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False, path_type=Path),
              help="write the figures (pass@1 vs budget, step sources, detector histograms) as PNGs here")
@click.option("--html", "trajectory", type=click.Path(dir_okay=False, path_type=Path),
              help="also turn this trajectory (from `solve --json`) into a self-contained HTML page")
@click.option("--out", "html_out", type=click.Path(dir_okay=False, path_type=Path),
              help="the HTML page to write (default: the trajectory's name with .html)")
@click.option("--pool-setups", is_flag=True,
              help="pool rows of one configuration made with different models, prompts or settings")
@click.option("--kv-cap", help="Table 3's memory-capped view at this many bytes of KV caches, e.g. 64M "
                               "[default: the largest peak measured]")
def report(results: tuple[Path, ...], markdown: bool, plots_dir: Path | None, trajectory: Path | None,
           html_out: Path | None, pool_setups: bool, kv_cap: str | None) -> None:
    """Table 2 (ablation), Table 1 (decode cost) and Table 3 (throughput by concurrency) from RESULTS JSONL files
    (one sweep, e.g. run at several --concurrency values); --html alone needs no RESULTS.

    Rows of one configuration made with different model files, prompt templates or settings (seeds aside)
    are shown as separate rows, one per setup, unless --pool-setups pools them."""
    from ..bench.report import distinct_rows, load_results, render

    cap = parse_size(kv_cap, "--kv-cap") if kv_cap else None  # a bad size is refused before any file is read
    if html_out is not None and trajectory is None:
        raise KVRescueError("--out names the HTML page of --html TRAJECTORY.json: pass both")
    if not results and (trajectory is None or plots_dir is not None):
        raise KVRescueError("pass a RESULTS .jsonl file (from `bench run`) for the tables and plots; --html "
                            "TRAJECTORY.json alone needs none")
    reads = [*(("RESULTS", path) for path in results), ("--html", trajectory)]
    page = html_out or (trajectory and trajectory.with_suffix(".html"))
    if trajectory is not None:
        check_writable(page, "--out" if html_out else "--html's page", reads=reads)
    rows, repeated = distinct_rows([row for path in results for row in load_results(path)])
    if repeated:
        click.echo(f"{repeated} duplicate rows left out (the same problem, configuration and run, read twice: a "
                   "file given twice, or merged into another given too)", err=True)
    if rows:
        click.echo(render(rows, markdown=markdown, pool_setups=pool_setups,
                          kv_cap=cap), nl=False)
    if plots_dir is not None:
        from ..bench.plots import write_plots

        written = write_plots(rows, plots_dir, reads)
        click.echo(f"\n{len(written)} plots written to {plots_dir}: {', '.join(p.name for p in written) or 'none'}")
    if trajectory is not None:
        from ..bench.viewer import load_trajectory, write_html

        out = write_html(load_trajectory(trajectory), page)
        click.echo(f"trajectory page written to {out}")


@click.command("estimate")
@click.option("--base", default="7b", show_default=True, help="base model: 7b, 72b (Qwen2.5-Math) or a GGUF path")
@click.option("--helper", default="1.5b", show_default=True, help="helper model: 1.5b (Qwen2.5-Math) or a GGUF path")
@click.option("--budget", type=int, default=64, show_default=True, help="base KV budget (entries kept)")
@click.option("--buffer", type=int, default=128, show_default=True, help="entries added before each eviction")
@setting_options("cache_type_k", "cache_type_v", "helper_cache_type_k", "helper_cache_type_v")
@click.option("--contexts", default="1k,2k,4k,8k,16k,32k", show_default=True, help="context lengths (tokens)")
@click.option("--markdown", is_flag=True, help="a GitHub markdown table")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), help="also write the figure here")
def estimate_command(base: str, helper: str, budget: int, buffer: int, cache_type_k: str | None, cache_type_v: str | None,
                     cache_type_k_helper: str | None, cache_type_v_helper: str | None, contexts: str, markdown: bool,
                     plot_path: Path | None) -> None:
    """KV memory and decode FLOPs per sequence: evicted base + full-KV helper vs full-KV base."""
    from ..bench.estimate import estimate, parse_contexts, resolve_model

    if plot_path is not None:
        check_not_read(plot_path, "--plot", [("--base", base), ("--helper", helper)])
    cache = (cache_type_k or DEFAULTS.cache_type_k, cache_type_v or DEFAULTS.cache_type_v)
    helper_cache = (cache_type_k_helper or cache[0], cache_type_v_helper or cache[1])
    result = estimate(resolve_model(base, "--base"), resolve_model(helper, "--helper"), budget, buffer, cache,
                      helper_cache, parse_contexts(contexts))
    click.echo(result.table(markdown=markdown))
    if plot_path is not None:
        click.echo(f"plot written to {result.plot(plot_path)}")

