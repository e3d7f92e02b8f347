"""`kvrescue-local serve`: the engine behind an OpenAI-compatible HTTP API (the `serve` extra)."""

from __future__ import annotations

import socket

import click

from ..compose import open_models, select_models
from ..errors import KVRescueError
from ..eviction import POLICY_HELP
from ..prm import PRMParams
from ..rescue import Mode
from ..rescue.limits import available_memory, check_concurrency_fits, check_kv_sizes, models_kv_memory
from ..settings import MODE, POLICY, POSITIVE, RULE
from .common import DEFAULTS, RULE_HELP, note, parse_size, preset_default, search_options
from .options import NON_NEGATIVE, PORT, check_cache_fit, comma_items

DEFAULT_PROMPT_TOKENS = 1024
API_KEY_VARIABLE = "KVRESCUE_API_KEY"


def serve_stack():
    """The serve extra's modules, or one line saying how to install them."""
    try:
        import uvicorn

        from ..serve.app import Limits, Served, create_app
        from ..serve.engine import Engine
        from ..serve.metrics import Metrics
    except ImportError as exc:
        raise KVRescueError(f"`serve` needs the serve extra ({exc.name} is missing): pip install "
                            "'kvrescue-local[serve]'") from None
    return uvicorn, Limits, Served, create_app, Engine, Metrics


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the models load and before "serving on" is printed: a port in use or a
    host that is not this machine's is one Error: line."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except OSError as exc:
        raise KVRescueError(f"--host {host} is not an address of this machine ({exc.strerror}): pass an address "
                            "such as 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own: a restart finds its port free
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise KVRescueError(f"cannot listen on {host}:{port} ({exc.strerror}): pass another --port, or stop what "
                            "listens there") from None
    return sock


def build_served(options: dict):
    """The engine (not started yet) and the app's settings from the command's parameters; models open here."""
    _, Limits, Served, _, Engine, Metrics = serve_stack()
    concurrency, prompt_tokens = options["concurrency"], options["prompt_tokens"]
    request_bytes = parse_size(options["max_request_bytes"], "--max-request-bytes")
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
    # a request's budget is at most --max-budget: beyond the base's trained context a budget never evicts (whether
    # a protected prompt fits its budget is each request's check, with its prompt)
    max_budget = options["max_budget"] or (models.base.n_ctx_train if models.base else config.kv.budget)
    if config.kv.budget > max_budget:
        raise KVRescueError(f"--budget {config.kv.budget} is over --max-budget {max_budget}, the most a request may "
                            "ask: lower --budget or raise --max-budget")
    check_kv_sizes([config.with_overrides({"kv": {"budget": max_budget}})], models.base, 0, "--max-budget")
    memory = parse_size(options["memory"], "--memory") if options["memory"] else available_memory() // 2

    def kv_need(request_config, slots: int) -> int:
        return models_kv_memory(request_config, slots, models.base, models.helper, models.prm, prompt_tokens)

    check_concurrency_fits([config], concurrency, memory, kv_need)  # the server's own settings fit
    names = {side: m.path.name for side, m in (("base", models.base), ("helper", models.helper)) if m is not None}
    engine = Engine(models, concurrency, prompt_tokens, options["max_queue"], Metrics(names), memory)
    # the served id, and what a client may call it besides: the preset (else the base model's file)
    family = selection.preset.name if selection.preset else names.get("base", "kvrescue")
    return Served(engine, config, (f"{family}-{mode}", family), [m for m in (models.base, models.helper) if m is not None],
                  has_prm=models.prm is not None, limits=Limits(max_budget, memory, request_bytes),
                  kv_bytes=lambda request_config: kv_need(request_config, concurrency),
                  api_key=options["api_key"] or None, allowed_origins=tuple(comma_items(options["allowed_origins"])))


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=PORT)
@click.option("--concurrency", "-k", default=8, show_default=True, type=POSITIVE,
              help="requests solved at once (engine slots)")
@click.option("--max-queue", default=64, show_default=True, type=NON_NEGATIVE,
              help="requests waiting for a slot beyond which the server answers 429")
@click.option("--prompt-tokens", default=DEFAULT_PROMPT_TOKENS, show_default=True, type=POSITIVE,
              help="cells reserved for a request's prompt (template included); a longer prompt gets a 400")
@click.option("--mode", type=MODE, help=f"a request's default {preset_default(DEFAULTS.mode)}")
@click.option("-n", "--n", "n", type=POSITIVE,
              help=f"candidates per model per round, the most a request may ask for {preset_default(DEFAULTS.n)}")
@click.option("--budget", type=POSITIVE, help=f"base KV budget {preset_default(DEFAULTS.kv.budget)}")
@click.option("--max-budget", type=POSITIVE,
              help="the most budget a request may ask [default: the base's trained context]")
@click.option("--policy", type=POLICY, help=f"{POLICY_HELP} {preset_default(DEFAULTS.kv.policy)}")
@click.option("--rule", type=RULE, help=f"a request's default: {RULE_HELP}")
@click.option("--memory", help="memory the KV caches may take, e.g. 4G: a request whose settings need more gets a 400 "
                               "[default: half of the available memory]")
@click.option("--max-request-bytes", default="1M", show_default=True,
              help="the largest request body; a larger one gets a 400 before it is read")
@click.option("--api-key", envvar=API_KEY_VARIABLE, show_envvar=True,
              help="answer only requests with `Authorization: Bearer KEY` (401 otherwise) [default: no key]")
@click.option("--allowed-origins", default="*", show_default=True,
              help="comma-separated origins browsers may call the API from (CORS); '' for none")
@search_options
def serve(host, port, **options) -> None:
    """Serve the engine over an OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics. A request's rescue settings (mode, n, budget, policy, rule) come as extra body fields;
    these options are their defaults."""
    uvicorn, _, _, create_app, _, _ = serve_stack()
    with listening_socket(host, port) as sock:
        served = build_served(options)
        served.engine.start()
        note(f"serving {served.model_id} on http://{host}:{port}/v1 ({options['concurrency']} at once, "
             f"{options['max_queue']} queued at most)")
        try:
            uvicorn.Server(uvicorn.Config(create_app(served), log_level="warning")).run(sockets=[sock])
        finally:
            served.engine.close()
