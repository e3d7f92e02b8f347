"""`kvrescue-local toy`: held-out problems of the toy task, and the toy preset's detector calibration."""

from __future__ import annotations

import sys
from dataclasses import replace

import click

from ..compose import open_models, select_models
from ..rescue import Mode, Rescue, longest_prompt
from ..settings import POSITIVE, SEED


@click.group()
def toy() -> None:
    """The toy world: a synthetic ledger task and the trained `toy` preset (CPU-sized; its table is
    `bench run --dataset toy`)."""


@toy.command("sample")
@click.option("--seed", "-s", type=SEED, default=0, show_default=True)
@click.option("--count", type=POSITIVE, default=1, show_default=True)
def toy_sample(seed: int, count: int) -> None:
    """Print held-out toy problems (one per paragraph) with their answers: feed them to `solve --preset toy`."""
    from ..toy.task import problems

    for p in problems(seed, count):
        click.echo(f"{p.text}\n(answer {p.answer})\n")


@toy.command("calibrate")
@click.option("--problems", "count", type=POSITIVE, default=40, show_default=True, help="calibration problems (not the table's)")
def toy_calibrate(count: int) -> None:
    """Fit the detector's thresholds to the toy preset's base candidates; writes detector.json beside the models."""
    from ..detect.calibrate import save_params
    from ..toy.calibrate import CALIBRATION_BUDGET, calibrate_detector, calibration_problems, disarmed

    selection = select_models({"preset": "toy"}, True, True)
    armed = selection.config({}, mode=Mode.KVRESCUE, n=8, kv={"budget": CALIBRATION_BUDGET})
    texts = calibration_problems(count)
    config, models = open_models(selection, replace(armed, detector=disarmed(armed.detector)), True, True,
                                 armed.candidates_per_round, texts)
    engine = Rescue(config, models.base, models.helper, models.prm,
                    prompt_tokens_max=longest_prompt(config, [models.base, models.helper], texts))
    with click.progressbar(length=count, label="calibrating", file=sys.stderr) as bar:
        params, report = calibrate_detector(engine.solve, texts, armed.detector, progress=bar.update)
    for name, fit in report.items():
        click.echo(f"{name}: threshold {fit['threshold']:.3f}, separability {fit['separability']:.2f}"
                   f"{'' if fit['used'] else ' (one mode: default kept)'}")
    click.echo(f"wrote {save_params(params, selection.preset.base.parent / 'detector.json')}")
