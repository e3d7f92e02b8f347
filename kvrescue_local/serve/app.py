"""The FastAPI app: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus /health and
/metrics. A request is validated here (400), queued on the engine (429 when full) and answered from the
events the engine thread sends: SSE chunks as steps are committed, or one response at the end."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sse_starlette.sse import EventSourceResponse

from ..errors import KVRescueError
from ..eviction import make_policy
from ..rescue import RescueConfig
from ..rescue.limits import check_problem
from ..runtime import Model
from .engine import Engine, Job, QueueFull
from .schemas import EXTENSION, ChatRequest, CompletionRequest, RescueFields

RETRY_AFTER_SECONDS = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before its response; nobody receives it


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_body(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


@dataclass
class Served:
    """What the app serves: the engine, the server's settings (a request's defaults), the models that read
    prompts (their lengths are checked against the reserved prompt cells) and the most candidates per round the
    PRM scores (None: no PRM)."""

    engine: Engine
    config: RescueConfig
    model_id: str
    prompt_models: list[Model]
    max_candidates: int | None

    def request_config(self, body: RescueFields) -> RescueConfig:
        kv = {k: v for k, v in (("budget", body.budget), ("policy", body.policy)) if v is not None}
        fields = {k: v for k, v in (("mode", body.mode), ("n", body.n), ("choice", body.choice),
                                    ("temperature", body.temperature), ("top_p", body.top_p),
                                    ("seed", body.seed)) if v is not None}
        if body.max_tokens is not None and body.max_tokens > self.config.max_tokens:
            raise RequestError(400, f"max_tokens={body.max_tokens} is over the server's {self.config.max_tokens} (its "
                                    "contexts are sized for that): ask for less or restart it with a larger --max-tokens",
                               "invalid_request_error")
        try:
            config = self.config.with_overrides({**fields, **({"kv": kv} if kv else {})})
            if config.evicts:
                make_policy(config.kv.policy)
        except KVRescueError as exc:
            raise RequestError(400, str(exc), "invalid_request_error") from None
        loaded = {"base": self.engine.models.base, "helper": self.engine.models.helper}
        missing = [side for side in ("base", "helper") if getattr(config, f"uses_{side}") and loaded[side] is None]
        missing += ["a PRM"] if config.needs_prm and not self.max_candidates else []
        if missing:
            raise RequestError(400, f"mode {config.mode} with {config.candidates_per_round} candidates per round needs "
                                    f"{' and '.join(missing)}, which this server has not loaded: ask for another mode "
                                    "(or n=1), or start the server in that mode", "invalid_request_error")
        if config.needs_prm and config.candidates_per_round > self.max_candidates:
            raise RequestError(400, f"{config.candidates_per_round} candidates per round are more than the server's PRM "
                                    f"scores at once ({self.max_candidates}): lower n or restart the server with a "
                                    "larger -n", "invalid_request_error")
        return config

    def job(self, body: ChatRequest | CompletionRequest) -> Job:
        problem = body.problem()
        if problem is None:
            raise RequestError(400, "the messages hold no user message: the last one is the problem",
                               "invalid_request_error")
        try:
            check_problem(problem, "the prompt")
        except KVRescueError as exc:
            raise RequestError(400, str(exc), "invalid_request_error") from None
        config = self.request_config(body)
        prompt = config.prompt.format(problem=problem)
        prompt_tokens = max(len(m.tokenize(prompt)) for m in self.prompt_models)
        if prompt_tokens > self.engine.prompt_tokens_max:
            raise RequestError(400, f"the prompt is {prompt_tokens} tokens with the template, over the "
                                    f"{self.engine.prompt_tokens_max} this server reserves: shorten it or restart the "
                                    "server with a larger --prompt-tokens", "context_length_exceeded")
        return Job(problem, config, body.max_tokens or config.max_tokens, body.stops(), prompt_tokens,
                   asyncio.get_running_loop())


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
    app = FastAPI(title="kvrescue-local", docs_url=None, redoc_url=None)
    metrics = served.engine.metrics

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            message, where = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})", ""
        else:
            where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
            message = f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}"
        metrics.respond(request.url.path, 400)
        return JSONResponse(error_body(message, "invalid_request_error", where or None), status_code=400)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError):
        metrics.respond(request.url.path, exc.status)
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if exc.status == 429 else None
        return JSONResponse(error_body(exc.message, exc.kind), status_code=exc.status, headers=headers)

    @app.get("/health")
    async def health():
        return {"status": "ok" if served.engine.thread.is_alive() else "engine stopped"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_id, "object": "model", "created": 0,
                                            "owned_by": "kvrescue-local"}]}

    async def complete(request: Request, body, chat: bool):
        job = served.job(body)
        try:
            served.engine.submit(job)
        except QueueFull as exc:
            raise RequestError(429, str(exc), "rate_limit_exceeded") from None
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
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
                    return EventSourceResponse(stream(job, (kind, payload), head, chat, path), ping=15)
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
                if kind == "error":  # the stream has begun: the error comes as its last event
                    metrics.respond(path, payload[0])
                    yield json.dumps(error_body(payload[1], "server_error"))
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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        return await complete(request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await complete(request, body, chat=False)

    return app
