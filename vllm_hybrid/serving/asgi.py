"""ASGI plumbing for the serving layer: reading and replaying request bodies, JSON answers in
vLLM's error shape, and in-process calls to the app below the middleware (vLLM's own routes:
``POST /tokenize``, ``POST /v1/completions``)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from vllm_hybrid.adapters.vllm.compat.server import server_args

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

TOKENIZE = "/tokenize"


class Upstream(Exception):
    """vLLM refused an in-process call; its status and answer go back to the client."""

    def __init__(self, status: int, answer: Any) -> None:
        super().__init__(status)
        self.status, self.answer = status, answer


class AppClient:
    """POSTs JSON to the app below the middleware, in the same process, with the headers of
    the request being served (so vLLM's authentication and model checks apply as they are)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def call(self, scope: Scope, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """(status, decoded JSON answer) of ``POST path`` with ``body``."""
        data = json.dumps(body).encode()
        sub = dict(with_length(scope, len(data)), path=path, raw_path=path.encode())
        sub["query_string"] = b""
        status, chunks = 500, []

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(sub, replay(data, None), send)
        try:
            return status, json.loads(b"".join(chunks) or b"null")
        except ValueError:
            return status, {"error": {"message": b"".join(chunks).decode(errors="replace")}}

    async def tokens(self, scope: Scope, request: dict[str, Any]) -> list[int]:
        """vLLM's tokens for a render (``POST /tokenize``); :class:`Upstream` (vLLM's own
        answer) if it refuses."""
        status, answer = await self.call(scope, TOKENIZE, request)
        if status != 200 or not isinstance(answer, dict) or "tokens" not in answer:
            raise Upstream(status if status != 200 else 500, answer)
        return list(answer["tokens"])


def error_body(message: str, status: int = 400) -> dict[str, Any]:
    """vLLM's error shape (``{"error": {"message", "type", "param", "code"}}``)."""
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay(data: bytes, receive: Receive | None) -> Receive:
    """A ``receive`` that yields ``data`` once, then waits for the client to go (the original
    ``receive``; vLLM watches it to cancel requests whose client disconnected)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        if receive is not None:
            return await receive()
        await asyncio.Event().wait()  # an in-process call never disconnects
        return {"type": "http.disconnect"}

    return replayed


def internal_scope(lifespan: Scope) -> Scope:
    """An HTTP scope for in-process calls made outside any request (at startup). With
    ``--api-key`` (or ``VLLM_API_KEY``) it carries the server's first key, which vLLM's
    ``AuthenticationMiddleware`` (``vllm/entrypoints/serve/middleware/``, below ours) checks."""
    app = lifespan.get("app")
    args = server_args(app)
    keys = [k for k in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if k]
    headers = [(b"authorization", f"Bearer {keys[0]}".encode())] if keys else []
    return {
        "type": "http",
        "asgi": lifespan.get("asgi", {"version": "3.0"}),
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/",
        "raw_path": b"/",
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "app": app,
        "state": dict(lifespan.get("state") or {}),
    }


def with_length(scope: Scope, length: int) -> Scope:
    """``scope`` with a JSON content type and ``length`` bytes of body."""
    skip = (b"content-length", b"content-type", b"transfer-encoding")
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in skip]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(length).encode())]
    return dict(scope, headers=headers)


async def send_json(send: Send, status: int, payload: Any) -> None:
    data = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})
