"""`kvrescue-local solve`: one problem, each committed step shown as it lands."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..compose import fit_defaults, model_facts, open_models, rule_needs_judge, rule_note, select_models
from ..files import check_writable, read_utf8
from ..rescue import Mode, Rescue, Step, longest_prompt
from ..rescue.limits import available_memory, check_context_sizes, check_kv_sizes, check_problem, check_prompts_fit
from .common import DEFAULTS, FITTED_FOR_HELP, GroupedOption, SettingsCommand, note, search_options, write_json
from .options import check_cache_fit, check_prm_ctx


def one_line(text: str, width: int = 100) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def show(step: Step) -> None:
    score = "  -  " if step.score is None else f"{step.score:.3f}"
    killed = f"({step.killed} killed) " if step.killed else ""
    set_aside = f"({step.set_aside} set aside: false arithmetic) " if step.set_aside else ""
    click.echo(f"[{step.round + 1:3d}] {step.source:6s} {score} {killed}{set_aside}{one_line(step.text)}")


@click.command(cls=SettingsCommand)
@click.argument("problem", required=False)
@click.option("--file", "problem_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="read the problem from a file")
@search_options()
@click.option("--fitted-for", cls=GroupedOption, group="rule", help=FITTED_FOR_HELP)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="write the trajectory record here")
def solve(problem, problem_file, json_path, **options) -> None:
    """Solve one PROBLEM step by step, showing each committed step as it lands."""
    if problem is None and problem_file is None:
        raise click.UsageError("give the problem as an argument or with --file")
    if problem is not None and problem_file is not None:
        raise click.UsageError("give the problem as an argument or with --file, not both")
    if json_path:
        check_writable(json_path, "--json", reads=[("--file", problem_file)])
    where = "the PROBLEM argument" if problem is not None else f"--file {problem_file}"
    text = check_problem(problem if problem is not None else read_utf8(problem_file, "--file"), where)
    mode = Mode.parse(options["mode"] or DEFAULTS.mode)
    # whether a PRM is needed is the rule's to say, and the rule may be the preset's: the preset's models load once
    selection = select_models(options, mode.uses_base, mode.uses_helper, note=note,
                              needs_prm=mode.sides * (options["n"] or DEFAULTS.n) > 1 and rule_needs_judge(options))
    config = selection.config(options, options["fitted_for"])
    check_prm_ctx(config, options["prm_ctx"])
    max_candidates = config.candidates_per_round if config.needs_prm else 1
    facts = model_facts(selection, config.uses_base, config.uses_helper, max_candidates)
    config = fit_defaults(config, facts, options, note)
    check_context_sizes(config, facts, available_memory(), prm_ctx=options["prm_ctx"], problem_bytes=len(text.encode()))
    config, models = open_models(selection, config, config.uses_base, config.uses_helper, max_candidates, [text],
                                 prompt_given=options["prompt_template"] is not None, prm_ctx=options["prm_ctx"],
                                 before_prm=lambda config, models: check_prompts_fit(config, models, {where: text}))
    check_cache_fit([config], models.base, models.helper)
    if models.base is not None:
        check_kv_sizes([config], models.base, longest_prompt(config, [models.base], [text]))
    note(rule_note(selection, config.rule, options["rule"], options["fitted_for"], None))  # once all is checked
    engine = Rescue(config, models.base, models.helper, models.prm,
                    prompt_tokens_max=longest_prompt(config, [models.base, models.helper], [text]))
    try:
        trajectory = engine.solve(text, on_step=show)
    except KeyboardInterrupt:
        click.echo("\ninterrupted: stopped before the end, nothing written", err=True)
        sys.exit(130)
    sources = trajectory.steps_from()
    t = trajectory.timings
    in_llama = sum(v for k, v in t.items() if k.startswith("llama_"))
    click.echo(f"answer: {trajectory.answer if trajectory.answer is not None else '(none)'}  (stop: {trajectory.stop})")
    click.echo(f"{trajectory.n_steps} steps (base {sources['base']}, helper {sources['helper']}); tokens base "
               f"{trajectory.tokens['base']}, helper {trajectory.tokens['helper']}; early exits "
               f"{100 * trajectory.early_exit_fraction:.1f}%; {t['total']:.2f} s (llama.cpp {in_llama:.2f}, "
               f"PRM {t['prm']:.2f}, other {t['orchestration']:.2f})")
    if json_path:
        write_json(json_path, trajectory.to_json(), "--json")
        click.echo(f"trajectory written to {json_path}")
