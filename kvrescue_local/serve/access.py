"""How the server refuses a request (RequestError, in OpenAI's error shape) and what every request passes before
its body is parsed: the size of that body, refused from its Content-Length or as it arrives (nothing reads a body
past --max-request-bytes), and before it the API key, when the server has one (--api-key, or KVRESCUE_API_KEY;
none by default, as llama-server). Both end in the app's handlers, so their answers are OpenAI's error shape too."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send


class RequestError(Exception):
    """A request refused: its HTTP status and OpenAI's error fields (type, the request field at fault, code)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class BodyTooLarge(HTTPException):  # an HTTPException: FastAPI hands it to the app's handler as it reads the body
    def __init__(self, limit: int) -> None:
        super().__init__(400, f"the request body is over the {limit:,} bytes this server takes: send a shorter one, "
                              "or restart the server with a larger --max-request-bytes")


class BodyLimit:
    """ASGI middleware: the app's first read of a body declared longer than `limit` bytes fails, and so does the
    read that takes a body without a Content-Length past it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        received = 0

        async def limited_receive():
            nonlocal received
            if declared.isdigit() and int(declared) > self.limit:
                raise BodyTooLarge(self.limit)
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited_receive, send)


class ApiKey:
    """ASGI middleware: with a key, every request but those to `open_paths` (the health probes) needs
    `Authorization: Bearer <api_key>`; the others are answered by `refuse` (a 401, as OpenAI's invalid_api_key).
    It runs before anything reads the body, so a request without the key is a 401 whatever its body holds."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...], refuse: ASGIApp) -> None:
        self.app, self.api_key, self.open_paths, self.refuse = app, api_key, open_paths, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            await self.app(scope, receive, send)
        else:
            await self.refuse(scope, receive, send)


def unauthorized() -> RequestError:
    return RequestError(401, "the API key is missing or wrong: send the server's key (its --api-key or "
                             "KVRESCUE_API_KEY) as `Authorization: Bearer KEY`, as OpenAI clients do with api_key",
                        code="invalid_api_key")
