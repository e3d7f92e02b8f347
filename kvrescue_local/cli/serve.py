"""`kvrescue-local serve`: the engine behind an OpenAI-compatible HTTP API (the `serve` extra)."""

from __future__ import annotations

import click

from ..compose import open_models, select_models
from ..errors import KVRescueError
from ..eviction import POLICY_HELP
from ..prm import PRMParams
from ..rescue import MODES, Mode
from ..rescue.config import CHOICES
from .common import DEFAULTS, note, preset_default, search_options
from .options import check_cache_fit

DEFAULT_PROMPT_TOKENS = 1024


def serve_stack():
    """The serve extra's modules, or one line saying how to install them."""
    try:
        import uvicorn

        from ..serve.app import Served, create_app
        from ..serve.engine import Engine
        from ..serve.metrics import Metrics
    except ImportError as exc:
        raise KVRescueError(f"`serve` needs the serve extra ({exc.name} is missing): pip install "
                            "'kvrescue-local[serve]'") from None
    return uvicorn, Served, create_app, Engine, Metrics


def build_served(options: dict):
    """The engine (not started yet) and the app's settings from the command's parameters; models open here."""
    _, Served, _, Engine, Metrics = serve_stack()
    concurrency, max_queue, prompt_tokens = options["concurrency"], options["max_queue"], options["prompt_tokens"]
    if concurrency < 1 or max_queue < 0 or prompt_tokens < 1:
        raise KVRescueError("--concurrency and --prompt-tokens must be positive and --max-queue at least 0")
    mode = Mode.parse(options["mode"] or DEFAULTS.mode)
    selection = select_models(options, mode.uses_base, mode.uses_helper, needs_prm=False, note=note)
    config = selection.config(options)
    # the models the server's mode uses open (a request may ask for any mode that needs no others); the PRM, when
    # that mode has it choose, scores up to 2N (or its default) at once
    max_candidates = max(PRMParams().max_candidates, 2 * config.n) if selection.paths["prm"] and config.needs_prm else None
    config, models = open_models(selection, config, mode.uses_base, mode.uses_helper, max_candidates or 1,
                                 ["x" * prompt_tokens],
                                 prompt_given=options["prompt_template"] is not None, prm_ctx=options["prm_ctx"])
    config.check_concurrency(concurrency)
    check_cache_fit([config], models.base, models.helper)
    names = {side: m.path.name for side, m in (("base", models.base), ("helper", models.helper)) if m is not None}
    engine = Engine(models, concurrency, prompt_tokens, max_queue, Metrics(names))
    model_id = (selection.preset.name if selection.preset else names.get("base", "kvrescue")) + f"-{mode}"
    return Served(engine, config, model_id, [m for m in (models.base, models.helper) if m is not None], max_candidates)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--concurrency", "-k", default=8, show_default=True, type=int, help="requests solved at once (engine slots)")
@click.option("--max-queue", default=64, show_default=True, type=int,
              help="requests waiting for a slot beyond which the server answers 429")
@click.option("--prompt-tokens", default=DEFAULT_PROMPT_TOKENS, show_default=True, type=int,
              help="cells reserved for a request's prompt (template included); a longer prompt gets a 400")
@click.option("--mode", type=click.Choice(MODES), help=f"a request's default {preset_default(DEFAULTS.mode)}")
@click.option("-n", "--n", "n", type=int,
              help=f"candidates per model per round, the most a request may ask for {preset_default(DEFAULTS.n)}")
@click.option("--budget", type=int, help=f"base KV budget {preset_default(DEFAULTS.kv.budget)}")
@click.option("--policy", help=f"{POLICY_HELP} {preset_default(DEFAULTS.kv.policy)}")
@click.option("--choice", type=click.Choice(CHOICES), help=f"how a round's winner is chosen {preset_default(DEFAULTS.choice)}")
@search_options
def serve(host, port, **options) -> None:
    """Serve the engine over an OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics. A request's rescue settings (mode, n, budget, policy, choice) come as extra body fields;
    these options are their defaults."""
    uvicorn, _, create_app, _, _ = serve_stack()
    served = build_served(options)
    served.engine.start()
    note(f"serving {served.model_id} on http://{host}:{port}/v1 ({options['concurrency']} at once, "
         f"{options['max_queue']} queued at most)")
    try:
        uvicorn.run(create_app(served), host=host, port=port, log_level="warning")
    finally:
        served.engine.close()
