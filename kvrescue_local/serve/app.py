"""The FastAPI app: OpenAI's /v1/chat/completions, /v1/completions, /v1/models and /v1/models/{id}, plus
/health and /metrics, and llama-server's /props (the server's limits and models), /tokenize, /detokenize and /slots
(the requests in flight), each also under /v1/. A request passes the server's gates (its API key when the server has
one, the size of its body: access.py), is checked whole in a worker thread (400: its fields against the server's
limits, its prompt tokenized against the cells reserved), queued on the engine (429 when full) and answered from the
events the engine thread sends: SSE chunks as steps are committed, or one response at the end. Every error is
OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from ..errors import KVRescueError, SettingError
from ..files import check_encodable, file_hash
from ..rescue import RescueConfig
from ..rescue.limits import GIB, check_kv_sizes, check_problem, check_prompt_room
from ..runtime import Model
from ..settings import BY_FIELD, SETTINGS, config_overrides, request_name
from .access import ApiKey, BodyLimit, RequestError, error_body, unauthorized
from .engine import Engine, Job, QueueFull, ShuttingDown
from .schemas import (EXTENSION, MAX_MESSAGES, MAX_STOPS, ChatRequest, CompletionRequest, DetokenizeRequest,
                      RescueFields, TokenizeRequest)

RETRY_AFTER_SECONDS = 1
SHUTDOWN_GRACE_SECONDS = 1.0  # what an open stream has to send its last events once the server is stopping
GRACEFUL_SHUTDOWN_SECONDS = 2  # uvicorn cancels what still holds a connection after this
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before its response; nobody receives it
UNKNOWN_FIELD = ("this server does not know this field: leave it out (docs/serving.md lists the fields it reads and "
                 "those it accepts and ignores)")
ROUTES = ("/v1/chat/completions, /v1/completions, /v1/models, /props, /tokenize, /detokenize, /slots (these four "
          "and /health also under /v1/), /health and /metrics")
HEALTH_PATHS = ("/health", "/v1/health")  # a liveness probe needs no key


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, set when it starts (-n and --max-tokens are its settings',
    Served.config): the most budget, the bytes of KV cache the engine's contexts may take in a request's
    configuration, the bytes of a request body."""

    max_budget: int
    memory: int
    request_bytes: int


@dataclass
class Served:
    """What the app serves: the engine, the server's settings (a request's defaults, and with -n and --max-tokens
    the most it may ask), the models that read prompts (their lengths are checked against the reserved prompt
    cells), whether a PRM is loaded, the limits, the KV bytes of the engine's contexts in a configuration, the names
    a request's `model` may give (the served id first), the API key (None: none asked) and the origins browsers may
    call from (CORS)."""

    engine: Engine
    config: RescueConfig
    model_names: tuple[str, ...]
    prompt_models: list[Model]
    has_prm: bool
    limits: Limits
    kv_bytes: Callable[[RescueConfig], int]
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    preset: str | None = None  # the preset the server's settings come from

    @property
    def tokenizer(self) -> tuple[str, Model]:
        """The model /tokenize and /detokenize use, and its side: the base, or the helper where the server's mode
        loads no base."""
        models = self.engine.models
        return ("base", models.base) if models.base is not None else ("helper", models.helper)

    def props(self) -> dict:
        """/props: llama-server's fields where they have a meaning here, the server's limits and models under
        `kvrescue`; called in a worker thread (a model's fingerprint reads its file's header once)."""
        config, engine, models = self.config, self.engine, self.engine.models
        side, tokenizer = self.tokenizer
        loaded = {"base": models.base, "helper": models.helper, "prm": models.prm and models.prm.model}
        return {
            "default_generation_settings": {
                "n_ctx": engine.prompt_tokens_max + config.max_tokens,  # the positions a request spans at most
                "params": {"n_predict": config.max_tokens, "seed": config.seed, "temperature": config.temperature,
                           "top_p": config.top_p, "stop": []}},
            "total_slots": engine.concurrency,
            "model_path": str(tokenizer.path),
            "model_alias": self.model_id,
            "chat_template": config.prompt,  # the prompt template, {problem} standing for the problem
            "modalities": {"vision": False, "audio": False},
            EXTENSION: {
                "max_n": config.n, "max_budget": self.limits.max_budget, "max_tokens": config.max_tokens,
                "prompt_tokens": engine.prompt_tokens_max, "concurrency": engine.concurrency,
                "max_queue": engine.max_queue, "memory_bytes": self.limits.memory,
                "max_request_bytes": self.limits.request_bytes, "max_stops": MAX_STOPS, "max_messages": MAX_MESSAGES,
                "model_names": list(self.model_names), "preset": self.preset, "tokenizer": side,
                "models": {name: {"file": m.name, "fingerprint": file_hash(m.path), "n_ctx_train": m.n_ctx_train,
                                  "n_vocab": m.n_vocab} for name, m in loaded.items() if m is not None},
                "settings": config.as_dict()}}

    def tokenize(self, body: TokenizeRequest) -> dict:
        """/tokenize; called in a worker thread. Content longer than the model's trained context is refused: no
        request could hold it, and its bytes alone say so of one too long to be worth tokenizing."""
        _, model = self.tokenizer
        try:
            check_encodable(body.content, "content", "send the text as UTF-8")
        except KVRescueError as exc:
            raise RequestError(400, str(exc), param="content") from None
        size, most = len(body.content.encode("utf-8")), model.n_ctx_train
        if size > most * model.longest_token_bytes:
            self.refuse_content(f"at least {-(-size // model.longest_token_bytes):,} tokens ({size:,} bytes, at most "
                                f"{model.longest_token_bytes} a token)", model)
        tokens = model.tokenize(body.content, special=body.parse_special, add_special=body.add_special).tolist()
        if len(tokens) > most:
            self.refuse_content(f"{len(tokens):,} tokens", model)
        if not body.with_pieces:
            return {"tokens": tokens}
        return {"tokens": [{"id": token, "piece": piece_of(model.detokenize_bytes([token]))} for token in tokens]}

    @staticmethod
    def refuse_content(count: str, model: Model) -> None:
        raise RequestError(400, f"content is {count}, over the {model.n_ctx_train:,} positions {model.name} was "
                                "trained on, which no request can hold: send a shorter text", param="content",
                           code="context_length_exceeded")

    def detokenize(self, body: DetokenizeRequest) -> dict:
        _, model = self.tokenizer
        vocabulary = model.n_vocab
        for at, token in enumerate(body.tokens):
            if not 0 <= token < vocabulary:
                raise RequestError(400, f"tokens[{at}] = {token} is no token of {model.name} (its ids are 0 to "
                                        f"{vocabulary - 1}): send ids that /tokenize gave", param="tokens")
        return {"content": model.detokenize(body.tokens)}

    @property
    def model_id(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise RequestError(404, f"The model `{name}` does not exist: this server serves {self.model_id} (its names: "
                                    f"{', '.join(self.model_names)})", param="model", code="model_not_found")

    def request_config(self, body: RescueFields) -> RescueConfig:
        # the server's limits, named as a request's message names the server's settings (request_name)
        asked = (("n", body.n, self.config.n, "n"), ("budget", body.budget, self.limits.max_budget, "max-budget"),
                 ("max_tokens", body.token_limit, self.config.max_tokens, "max-tokens"))
        for field, value, most, limit in asked:
            if value is not None and value > most:
                raise RequestError(400, f"{field}={value} is over this server's {limit} {most}, the most a request may "
                                        f"ask: ask for at most {most}, or restart the server with a larger {limit}",
                                   param=field)
        # a request's max_tokens ends its job (Job's limit) in contexts the server's max_tokens sizes
        given = {setting.param: getattr(body, setting.request) for setting in SETTINGS
                 if setting.request and setting.field != "max_tokens"}
        try:
            config = self.config.with_overrides(config_overrides(given))
        except SettingError as exc:
            raise setting_refused(exc) from None
        except KVRescueError as exc:  # settings that do not go together
            raise RequestError(400, str(exc)) from None
        loaded = {"base": self.engine.models.base, "helper": self.engine.models.helper}
        missing = [side for side in ("base", "helper") if getattr(config, f"uses_{side}") and loaded[side] is None]
        missing += ["a PRM"] if config.needs_prm and not self.has_prm else []
        if missing:
            raise RequestError(400, f"mode {config.mode} with {config.candidates_per_round} candidates per round needs "
                                    f"{' and '.join(missing)}, which this server has not loaded: ask for another mode "
                                    "(or n=1), or start the server in that mode", param="mode")
        need = self.kv_bytes(config)
        if need > self.limits.memory:
            raise RequestError(400, f"these settings' KV caches take {need / GIB:.2f} GiB for the server's "
                                    f"{self.engine.concurrency} requests at once, over the {self.limits.memory / GIB:.2f}"
                                    " GiB it may use (its memory setting): ask for a smaller budget or n, or restart the "
                                    "server with a larger memory")
        return config

    def job(self, body: ChatRequest | CompletionRequest, loop: asyncio.AbstractEventLoop, ident: str) -> Job:
        """The request's job, every field checked; called in a worker thread, as tokenizing a long prompt takes a
        while and the event loop answers others meanwhile."""
        self.check_model(body.model)
        where = "messages" if isinstance(body, ChatRequest) else "prompt"
        problem = body.problem()
        if problem is None:
            raise RequestError(400, "the messages hold no user message: the last one is the problem", param=where)
        try:
            check_problem(problem, "the prompt")
        except KVRescueError as exc:
            raise RequestError(400, str(exc), param=where) from None
        config = self.request_config(body)
        prompt = config.prompt.format(problem=problem)
        counts = [(m, len(m.tokenize(prompt))) for m in self.prompt_models]
        try:  # solve's check first: past a model's trained context no restart of the server can serve the prompt
            for model, tokens in counts:
                check_prompt_room(config, model, tokens, "the prompt is", lambda room: "shorten it")
        except SettingError as exc:
            raise RequestError(400, exc.worded(request_name), param=where, code="context_length_exceeded") from None
        prompt_tokens = max(tokens for _, tokens in counts)
        if prompt_tokens > self.engine.prompt_tokens_max:
            raise RequestError(400, f"the prompt is {prompt_tokens} tokens with the template, over the "
                                    f"{self.engine.prompt_tokens_max} this server reserves: shorten it or restart the "
                                    "server with a larger prompt-tokens", param=where, code="context_length_exceeded")
        try:  # a budget that cannot hold a protected prompt would fail in the middle of an eviction
            check_kv_sizes([config], self.engine.models.base, prompt_tokens)
        except SettingError as exc:
            raise setting_refused(exc) from None
        return Job(problem, config, body.token_limit or config.max_tokens, body.stops(), prompt_tokens, loop, ident)


def piece_of(data: bytes) -> str | list[int]:
    """A token's piece as llama-server gives it: its text, or its bytes where they are not whole UTF-8 (a byte-level
    token may hold half of a character)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def setting_refused(exc: SettingError) -> RequestError:
    """A refused setting as a 400 in a request's words: its field (`budget`, not --budget) as the param, a setting
    of the server's alone named as such."""
    param = next((BY_FIELD[field].request for field in exc.fields if field in BY_FIELD and BY_FIELD[field].request),
                 None)
    return RequestError(400, exc.worded(request_name), param=param)


class Server(uvicorn.Server):
    """uvicorn's server, which as it shuts down (SIGINT, SIGTERM) first ends every request the engine holds: an open
    stream gets an error event and [DONE], a whole response a 503, so that the connections close at once instead of
    when their trajectories end."""

    def __init__(self, served: Served, app: FastAPI) -> None:
        super().__init__(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS))
        self.served = served

    async def shutdown(self, sockets=None) -> None:
        self.served.engine.stop()
        await super().shutdown(sockets)


async def client_gone(request: Request) -> None:
    """Returns when the client has closed its connection. The body is read by then, so the server's next
    message for this request is its disconnect (sse-starlette watches a stream's the same way)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def events_while_connected(request: Request, job: Job):
    """The job's events as the engine sends them, until the client goes away: then the job is cancelled (its slot
    goes at the next round) and the events end, so a whole response no longer waits on a problem nobody reads."""
    gone = asyncio.ensure_future(client_gone(request))
    try:
        while True:
            event = asyncio.ensure_future(job.events.get())
            await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                job.cancelled = True
                return
            yield event.result()
    finally:
        gone.cancel()


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="kvrescue-local", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = served.engine.metrics
    api = APIRouter()

    def refusal(request: Request, status: int, message: str, kind: str = "invalid_request_error",
                param: str | None = None, code: str | None = None, headers: dict | None = None) -> JSONResponse:
        # counted by the route's path: a model's name or a scanned URL makes no label of its own
        metrics.respond(getattr(request.scope.get("route"), "path", "unmatched"), status)
        return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            message, where = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})", ""
        else:
            where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
            reason = (UNKNOWN_FIELD if first.get("type") == "extra_forbidden" else
                      first.get("msg", "invalid request").removeprefix("Value error, "))
            message = f"{where + ': ' if where else ''}{reason}"
        return refusal(request, 400, message, param=where or None)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError):
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if exc.status == 429 else None
        return refusal(request, exc.status, exc.message, exc.kind, exc.param, exc.code, headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        where = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({where}): this server answers {ROUTES}",
                   405: f"{where} is not allowed: use {(exc.headers or {}).get('Allow', 'another method')}"}
        return refusal(request, exc.status_code, message.get(exc.status_code, str(exc.detail)),
                       headers=exc.headers)

    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/v1/health", methods=["GET", "HEAD"])  # where a client given the base URL .../v1 looks
    async def health():
        return {"status": "ok" if served.engine.thread.is_alive() else "engine stopped"}

    @api.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": served.model_id, "object": "model", "created": 0, "owned_by": "kvrescue-local"}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @api.get("/v1/models/{name:path}")
    async def model(name: str):
        served.check_model(name)
        return model_card()

    @api.get("/props")
    @api.get("/v1/props")
    async def props():
        return await asyncio.to_thread(served.props)

    @api.get("/slots")
    @api.get("/v1/slots")
    async def slots():
        return served.engine.slots()

    @api.post("/tokenize")
    @api.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await asyncio.to_thread(served.tokenize, body)

    @api.post("/detokenize")
    @api.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await asyncio.to_thread(served.detokenize, body)

    async def complete(request: Request, body, chat: bool):
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        job = await asyncio.to_thread(served.job, body, asyncio.get_running_loop(), ident)
        try:
            served.engine.submit(job)
        except QueueFull as exc:
            raise RequestError(429, str(exc), "rate_limit_exceeded") from None
        except ShuttingDown as exc:
            raise RequestError(503, str(exc), "server_error") from None
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": served.model_id}
        path = request.url.path
        events = events_while_connected(request, job)
        steps = []
        try:
            async for kind, payload in events:
                if kind == "error":  # an engine refusal before a stream's first step is still an HTTP error
                    raise RequestError(payload[0], payload[1], "server_error")
                if body.stream:  # the stream sends this first event and watches its client itself from here on
                    # at shutdown sse-starlette would cancel the stream at once: the grace lets its last events
                    # (the engine's 503, then [DONE]) out first
                    return EventSourceResponse(stream(job, (kind, payload), head, chat, path), ping=15,
                                               shutdown_grace_period=SHUTDOWN_GRACE_SECONDS)
                if kind == "done":
                    break
                steps.append(payload)
            else:  # the client went away: nobody reads an answer (kvrescue_requests_cancelled_total counts it)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            await events.aclose()
        metrics.respond(path, 200)
        text = "".join(s["text"] for s in steps)
        extension = {"steps": [{k: s[k] for k in ("source", "score", "round")} for s in steps],
                     "answer": payload["answer"], "stop": payload["stop"]}
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat else
                  {"index": 0, "text": text, "logprobs": None})
        return {**head, "object": "chat.completion" if chat else "text_completion",
                "choices": [{**choice, "finish_reason": payload["finish_reason"], EXTENSION: extension}],
                "usage": payload["usage"]}

    async def stream(job: Job, first, head: dict, chat: bool, path: str):
        chunk_object = "chat.completion.chunk" if chat else "text_completion"
        event = first
        sent_role = False
        try:
            while True:
                kind, payload = event
                if kind == "error":  # the stream has begun: the error comes as its last event, before [DONE]
                    metrics.respond(path, payload[0])
                    yield json.dumps(error_body(payload[1], "server_error"))
                    yield "[DONE]"
                    return
                if kind == "step":
                    extension = {k: payload[k] for k in ("source", "score", "round")}
                    if chat:
                        delta = {"content": payload["text"], **({} if sent_role else {"role": "assistant"})}
                        sent_role = True
                        choice = {"index": 0, "delta": delta, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": payload["text"], "logprobs": None, "finish_reason": None}
                    yield json.dumps({**head, "object": chunk_object, "choices": [{**choice, EXTENSION: extension}]})
                else:
                    choice = ({"index": 0, "delta": {}, "finish_reason": payload["finish_reason"]} if chat else
                              {"index": 0, "text": "", "logprobs": None, "finish_reason": payload["finish_reason"]})
                    extension = {"answer": payload["answer"], "stop": payload["stop"]}
                    yield json.dumps({**head, "object": chunk_object, "choices": [{**choice, EXTENSION: extension}],
                                      "usage": payload["usage"]})
                    yield "[DONE]"
                    metrics.respond(path, 200)
                    return
                event = await job.events.get()
        finally:  # a client gone mid-stream (the generator is cancelled): its slot goes at the next round
            job.cancelled = True

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        return await complete(request, body, chat=True)

    @api.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await complete(request, body, chat=False)

    app.include_router(api)
    app.add_middleware(BodyLimit, limit=served.limits.request_bytes)
    if served.api_key is not None:
        async def refuse_key(scope: Scope, receive: Receive, send: Send) -> None:
            # counted by the route the request would have reached, as the app's own refusals are
            scope["route"] = next((r for r in api.routes if r.matches(scope)[0] != Match.NONE), None)
            request = Request(scope, receive)
            error = unauthorized()
            await refusal(request, error.status, error.message, error.kind, error.param, error.code)(scope, receive,
                                                                                                       send)

        app.add_middleware(ApiKey, api_key=served.api_key, open_paths=HEALTH_PATHS, refuse=refuse_key)
    if served.allowed_origins:  # outermost: a browser's preflight is answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(served.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app
