"""The server's implicit breakpoint at the end of a chat's system prompt
(``HybridServingMiddleware._system_breakpoint``, config ``system_breakpoint``), against a fake
app below the middleware: a toy chat template on ``/tokenize`` (one token per character) and a
chat endpoint that records the body it is given."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from vllm_hybrid.core import HybridCacheConfig
from vllm_hybrid.serving.messages import system_prompt_probe
from vllm_hybrid.serving.middleware import HybridServingMiddleware


def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


class FakeApp:
    def __init__(self, refuse_empty: bool = False) -> None:
        self.forwarded: list[dict[str, Any]] = []
        self.refuse_empty = refuse_empty

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = json.loads((await receive())["body"])
        if scope["path"] == "/tokenize":
            if self.refuse_empty and any(m["content"] == "" for m in body["messages"]):
                status, answer = 400, {"error": {"message": "empty content"}}
            else:
                text = render(body["messages"], body.get("add_generation_prompt", True))
                status, answer = 200, {"tokens": [ord(c) for c in text]}
        else:
            self.forwarded.append(body)
            status, answer = 200, {"ok": True}
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


def post(app: FakeApp, body: dict[str, Any], **settings: Any) -> dict[str, Any]:
    middleware = HybridServingMiddleware(app)
    middleware._config = HybridCacheConfig.from_sources(settings, {})
    data = json.dumps(body).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-length", str(len(data)).encode())],
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    asyncio.run(middleware(scope, receive, send))
    (forwarded,) = app.forwarded
    return forwarded


SYSTEM = {"role": "system", "content": "be brief"}


def test_the_breakpoint_ends_after_the_next_messages_role_header() -> None:
    messages = [SYSTEM, {"role": "user", "content": "hi there"}]
    got = post(FakeApp(), {"messages": messages})
    full = render(messages, True)
    want = len("<system>be brief</><user>")  # where a conversation asking otherwise diverges
    assert full[:want] == "<system>be brief</><user>"
    assert got["vllm_xargs"]["cache_breakpoints"] == [want]
    assert got["messages"] == messages


def test_no_breakpoint_without_a_system_prompt_when_off_or_under_stock() -> None:
    user = [{"role": "user", "content": "hi"}]
    assert "vllm_xargs" not in post(FakeApp(), {"messages": user})
    both = [SYSTEM, {"role": "user", "content": "hi"}]
    assert "vllm_xargs" not in post(FakeApp(), {"messages": both}, system_breakpoint=False)
    assert "vllm_xargs" not in post(FakeApp(), {"messages": both}, policy="stock")


def test_a_template_that_refuses_the_probe_leaves_the_request_as_it_came() -> None:
    body = {"messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 3}
    assert post(FakeApp(refuse_empty=True), body) == body


def test_existing_options_are_kept() -> None:
    body = {"messages": [SYSTEM, {"role": "user", "content": "x"}], "vllm_xargs": {"a": 1}}
    got = post(FakeApp(), body)
    assert got["vllm_xargs"]["a"] == 1 and got["vllm_xargs"]["cache_breakpoints"]


def test_the_probe_takes_every_leading_system_message() -> None:
    dev = {"role": "developer", "content": "d"}
    user = {"role": "user", "content": "u", "cache_control": {"type": "ephemeral"}}
    assert system_prompt_probe([SYSTEM, dev, user]) == [
        SYSTEM,
        dev,
        {"role": "user", "content": ""},
    ]
    assert system_prompt_probe([SYSTEM]) is None  # nothing after it to diverge
    assert system_prompt_probe([{"role": "user", "content": "u"}]) is None
    assert system_prompt_probe("not a list") is None
    assert system_prompt_probe([SYSTEM, {"content": "no role"}]) is None
