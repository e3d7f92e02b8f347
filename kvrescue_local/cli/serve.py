"""`kvrescue-local serve`: the engine behind an OpenAI-compatible HTTP API (the `serve` extra)."""

from __future__ import annotations

import os
import socket

import click

from .. import interrupts
from ..compose import model_facts, open_models, select_models
from ..errors import KVRescueError, SettingError
from ..prm import PRMParams
from ..rescue import Mode, RescueConfig
from ..rescue.limits import (RunModels, available_memory, check_concurrency_fits, check_context_sizes, check_kv_sizes,
                             check_prompt_room, models_kv_memory, prompt_room)
from ..settings import NON_NEGATIVE, POSITIVE, command_line_name
from .common import DEFAULTS, SettingsCommand, note, parse_size, search_options
from .options import PORT, check_cache_fit, check_prm_ctx, comma_items

DEFAULT_PROMPT_TOKENS = 1024
API_KEY_VARIABLE = "KVRESCUE_API_KEY"
ENGINE_STOP_SECONDS = 1.5  # how long a stopping server waits for the engine's round to end


def serve_stack():
    """The serve extra's modules, or one line saying how to install them."""
    try:
        from ..serve.app import Limits, Served, Server, create_app
        from ..serve.engine import Engine
        from ..serve.metrics import Metrics
    except ImportError as exc:
        raise KVRescueError(f"`serve` needs the serve extra ({exc.name} is missing): pip install "
                            "'kvrescue-local[serve]'") from None
    return Server, Limits, Served, create_app, Engine, Metrics


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


def start_sizes(options: dict, config: RescueConfig, facts: RunModels, memory: int) -> int:
    """The server's sizes, checked as `solve` checks its own before any model loads (from the GGUF headers, so
    before llama.cpp allocates anything), each refusal naming the option given: --max-tokens, --max-step-tokens,
    --budget and the KV caches of one problem (check_context_sizes), and the prompt cells, which with one step
    must fit in each model's trained context (check_prompt_room). Returns the prompt cells to reserve: those
    given, else DEFAULT_PROMPT_TOKENS, lowered to what the models hold (with a note)."""
    check_prm_ctx(config, options["prm_ctx"])
    memory_option = "--memory" if options["memory"] else "half of the available memory (--memory)"
    opened = [m for m in (facts.base, facts.helper) if m is not None]
    given = options["prompt_tokens"]
    prompt_tokens = given or max(1, min([DEFAULT_PROMPT_TOKENS, *(prompt_room(config, m) for m in opened)]))
    for model in opened:  # first: the PRM's context below is sized from the prompt cells
        check_prompt_room(config, model, prompt_tokens, "--prompt-tokens reserves" if given else "a prompt takes at least",
                          lambda room: f"lower --prompt-tokens to at most {room:,}" if room > 0 else
                          f"lower {{max_step_tokens}} to below {model.n_ctx_train:,}")
    check_context_sizes(config, facts, memory, memory_option, prm_ctx=options["prm_ctx"], problem_bytes=prompt_tokens)
    if given is None and prompt_tokens < DEFAULT_PROMPT_TOKENS:
        note(f"--prompt-tokens {prompt_tokens}: the most the models' trained contexts hold beside one step")
    return prompt_tokens


def build_served(options: dict):
    """The engine (not started yet) and the app's settings from the command's parameters; models open here."""
    _, Limits, Served, _, Engine, Metrics = serve_stack()
    if options["api_key"] is not None and not options["api_key"].strip():  # it would let every request in
        raise KVRescueError(f"--api-key (or {API_KEY_VARIABLE}) is blank, which would leave the server open to any "
                            "request: give a key, or leave the option out for a server without one")
    concurrency = options["concurrency"]
    request_bytes = parse_size(options["max_request_bytes"], "--max-request-bytes")
    memory = parse_size(options["memory"], "--memory") if options["memory"] else available_memory() // 2
    mode = Mode.parse(options["mode"] or DEFAULTS.mode)
    selection = select_models(options, mode.uses_base, mode.uses_helper, needs_prm=False, note=note)
    config = selection.config(options)
    # the models the server's mode uses open (a request may ask for any mode that needs no others); the PRM, when
    # that mode has it choose, scores up to 2N (or its default) at once
    max_candidates = max(PRMParams().max_candidates, 2 * config.n) if selection.paths["prm"] and config.needs_prm else None
    prompt_tokens = start_sizes(options, config, model_facts(selection, mode.uses_base, mode.uses_helper,
                                                             max_candidates or 1), memory)
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
    try:  # the largest budget a request may ask must fit the base as the server's own does
        check_kv_sizes([config.with_overrides({"kv": {"budget": max_budget}})], models.base, 0)
    except SettingError as exc:
        raise KVRescueError(exc.worded(lambda field: "--max-budget" if field == "kv.budget" else
                                       command_line_name(field))) from None

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
                  api_key=options["api_key"], allowed_origins=tuple(comma_items(options["allowed_origins"])),
                  preset=selection.preset.name if selection.preset else None)


@click.command(cls=SettingsCommand)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=PORT)
@click.option("--concurrency", "-k", default=8, show_default=True, type=POSITIVE,
              help="requests solved at once (engine slots)")
@click.option("--max-queue", default=64, show_default=True, type=NON_NEGATIVE,
              help="requests waiting for a slot beyond which the server answers 429")
@click.option("--prompt-tokens", type=POSITIVE,
              help="cells reserved for a request's prompt (template included); a longer prompt gets a 400 [default: "
                   f"{DEFAULT_PROMPT_TOKENS}, or what the models' trained contexts hold beside one step if less]")
@click.option("--max-budget", type=POSITIVE,
              help="the most budget a request may ask [default: the base's trained context]")
@click.option("--memory", help="memory the KV caches may take, e.g. 4G: a request whose settings need more gets a 400 "
                               "[default: half of the available memory]")
@click.option("--max-request-bytes", default="1M", show_default=True,
              help="the largest request body; a larger one gets a 400 before it is read")
@click.option("--api-key", envvar=API_KEY_VARIABLE, show_envvar=True,
              help="answer only requests with `Authorization: Bearer KEY` (401 otherwise) [default: no key]")
@click.option("--allowed-origins", default="*", show_default=True,
              help="comma-separated origins browsers may call the API from (CORS); '' for none")
@search_options()
def serve(host, port, **options) -> None:
    """Serve the engine over an OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics, and llama-server's /props, /tokenize, /detokenize, /slots. A request's rescue settings
    (mode, n, budget, policy, rule) come as extra body fields; these options are their defaults."""
    Server, _, _, create_app, _, _ = serve_stack()
    with listening_socket(host, port) as sock:
        served = build_served(options)
        served.engine.start()
        note(f"serving {served.model_id} on http://{host}:{port}/v1 ({options['concurrency']} at once, "
             f"{options['max_queue']} queued at most)")
        try:
            Server(served, create_app(served)).run(sockets=[sock])
        finally:  # SIGINT (SIGTERM ends the process as uvicorn returns): the requests are ended by now
            if not served.engine.close(wait=ENGINE_STOP_SECONDS):
                # the engine thread is inside a decode that nothing interrupts; freeing its models under it as
                # Python exits could crash, so the process ends here, with Ctrl-C's status
                note(f"the engine was still in a round after {ENGINE_STOP_SECONDS} s: stopped without waiting for it")
                os._exit(interrupts.INTERRUPTED)
