"""``POST /v1/hybrid/prewarm``: compute a prefix on the server and pin it (vLLM 0.32.0).

The prefix runs as a one-token completion (``POST /v1/completions``, in process) whose
``vllm_xargs`` carry ``cache_pin_ttl_s``; the engine core pins its cached blocks when it
finishes (``adapters/vllm/cache_control.py``) and answers in the completion's
``kv_transfer_params["vllm_hybrid"]``. The offline twin is ``adapters/vllm/prewarm.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_hybrid.core import (
    PIN_TTL,
    CacheOptionError,
    PrewarmRequest,
    merge_breakpoints,
    prewarm_prompt,
)
from vllm_hybrid.serving.asgi import AppClient, Scope, Upstream, error_body
from vllm_hybrid.serving.messages import chat_markers

COMPLETIONS = "/v1/completions"
#: Checks a TTL against the server's limit: (name, ttl_s, error class) -> None or raises.
CheckTTL = Callable[[str, float, type[CacheOptionError]], None]


async def prewarm(
    client: AppClient, scope: Scope, body: Any, check_ttl: CheckTTL
) -> tuple[int, Any]:
    """(status, answer) of a prewarm request ``body`` (``core/pins.py::PrewarmRequest``): a
    prompt (text or token ids) or chat ``messages`` rendered without a generation prompt."""
    try:
        request = PrewarmRequest.parse(body)
        check_ttl("prewarm: ttl_s", request.ttl_s, CacheOptionError)
        prompt: Any = request.prompt
        if request.messages is not None:
            if chat_markers(request.messages):
                raise CacheOptionError(
                    "prewarm: messages must not carry cache_control (the whole prefix is prewarmed)"
                )
            render: dict[str, Any] = {**request.chat, "messages": request.messages}
            render.update(add_generation_prompt=False)
            if request.model is not None:
                render["model"] = request.model
            prompt = await client.tokens(scope, render)
    except CacheOptionError as error:
        return 400, error_body(str(error))
    except Upstream as refused:
        return refused.status, refused.answer
    status, payload, _ = await compute_and_pin(
        client, scope, prompt, request.ttl_s, request.model, request.cache_salt
    )
    return status, payload


async def compute_and_pin(
    client: AppClient,
    scope: Scope,
    prompt: Any,
    ttl_s: float,
    model: str | None,
    cache_salt: str | None,
    breakpoints: list[int] | None = None,
) -> tuple[int, Any, str | None]:
    """Compute ``prompt`` (text or token ids) as a one-token completion that pins its cached
    prefix for ``ttl_s``, with ``breakpoints`` (the states there stay cached). The
    completion's prompt is the prefix plus one token (``core/breakpoints.py::prewarm_prompt``),
    so the pinned state is at the prefix's end. Returns (200, the pin summary, None), (400,
    error, the refusal reason) when the engine took no pin, or vLLM's own (status, answer,
    None) when it refused the request."""
    if isinstance(prompt, str):  # tokenized as /v1/completions does (special tokens on)
        try:
            render = {"prompt": prompt, **({"model": model} if model is not None else {})}
            prompt = await client.tokens(scope, render)
        except Upstream as refused:
            return refused.status, refused.answer, None
    try:
        ids = prewarm_prompt(prompt)
    except CacheOptionError as error:
        return 400, error_body(str(error)), None
    xargs: dict[str, Any] = {PIN_TTL: ttl_s, "cache_report": 1}
    if breakpoints:
        xargs = merge_breakpoints(xargs, breakpoints)
    completion: dict[str, Any] = {
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "vllm_xargs": xargs,
    }
    if model is not None:
        completion["model"] = model
    if cache_salt is not None:
        completion["cache_salt"] = cache_salt
    status, answer = await client.call(scope, COMPLETIONS, completion)
    if status != 200 or not isinstance(answer, dict):
        return status, answer, None
    return _pin_answer(answer, len(prompt), ttl_s)


def _pin_answer(answer: dict[str, Any], prompt_tokens: int, ttl_s: float) -> tuple[int, Any, Any]:
    """The prewarm's answer from the completion's (the engine's pin record, the usage)."""
    result = (answer.get("kv_transfer_params") or {}).get("vllm_hybrid") or {}
    pin = result.get("pin") or {}
    usage = answer.get("usage") or {}
    if not pin.get("pinned"):
        message = (
            pin.get("message")
            or result.get("error")
            or "the engine took no pin (is the server started with --enable-prefix-caching, "
            "on an attention + Mamba hybrid model?)"
        )
        return 400, error_body(f"prewarm: {message}"), message
    details = usage.get("prompt_tokens_details") or {}
    return (
        200,
        {
            "object": "hybrid.prewarm",
            "prompt_tokens": prompt_tokens,  # the prefix's (the completion's has one more)
            "cached_tokens": details.get("cached_tokens"),
            "pinned_tokens": pin.get("tokens"),
            "pinned_pages": pin.get("pages"),
            "ttl_s": ttl_s,
            "expires_in_s": pin.get("expires_in_s"),
            "extended": pin.get("extended", False),
            "pool_pinned_pages": pin.get("pinned_pages"),
            "pool_pin_limit_pages": pin.get("limit_pages"),
        },
        None,
    )
