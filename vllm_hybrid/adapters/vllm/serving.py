"""Cache breakpoints and prewarming on vLLM's OpenAI-compatible server (vLLM 0.32.0).

A pure ASGI middleware, loaded by vLLM's ``--middleware`` option
(``vllm/entrypoints/serve/middleware/register.py``: a class is added with
``app.add_middleware``); ``vllm-hybrid serve`` adds it by itself::

    python -m vllm.entrypoints.openai.api_server --model M --enable-prefix-caching \\
        --middleware vllm_hybrid.adapters.vllm.serving.HybridServingMiddleware

What it does, per request (everything else passes through untouched):

* ``POST /v1/chat/completions``: ``"cache_control": {"type": "ephemeral"}`` marks on messages or
  content blocks become token positions: the messages up to the mark are rendered and
  tokenized by vLLM's own ``POST /tokenize`` (same chat template and tokenizer as the request),
  the position is the length of that prefix's common prefix with the whole request's tokens;
  the marks are removed and the positions added to ``vllm_xargs.cache_breakpoints``, which
  vLLM hands to the engine as ``SamplingParams.extra_args`` (``ChatCompletionRequest.
  to_sampling_params``). Cache options in ``vllm_xargs`` are validated.
* ``POST /v1/messages`` (vLLM's Anthropic endpoint): ``cache_control`` on ``system`` or message
  content blocks, the same way; the body is converted to chat messages by vLLM's own converter
  (``AnthropicServingMessages.to_chat_completion_request``) before rendering.
* ``POST /v1/completions``: cache options in ``vllm_xargs`` are validated.
* ``POST /v1/hybrid/prewarm``: computes a prefix (a completion of one token with
  ``cache_pin_ttl_s``) and answers with the pin the engine took, or HTTP 400 with the engine's
  reason when the pin does not fit.
* ``POST /v1/hybrid/modules`` (or the ``modules`` setting's file, at startup): registers
  prompt modules (``core/modules.py``): tokenizes each module, prewarms and pins every path
  with a breakpoint at each module boundary; ``GET`` lists them. ``POST /v1/completions`` with
  ``vllm_xargs: {"modules": [names]}`` gets the modules' token ids before its own prompt and
  breakpoints at their boundaries.

Bad cache options get HTTP 400 in vLLM's error shape (``{"error": {"message", "type",
"param", "code"}}``). Parsing and validation are in ``core/breakpoints.py`` and
``core/pins.py``; the engine side is ``cache_control.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from vllm_hybrid.core.breakpoints import (
    PIN_TTL,
    CacheOptionError,
    CacheOptions,
    anthropic_markers,
    anthropic_prefix,
    chat_markers,
    common_prefix_tokens,
    merge_breakpoints,
    prefix_messages,
    prewarm_prompt,
    strip_anthropic_cache_control,
    strip_cache_control,
)
from vllm_hybrid.core.config import ConfigError, HybridCacheConfig
from vllm_hybrid.core.modules import IMPORT_KEY, ModuleError, ModuleSchema, boundaries
from vllm_hybrid.core.pins import PrewarmRequest

logger = logging.getLogger("vllm_hybrid")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CHAT, COMPLETIONS, MESSAGES, PREWARM, MODULES, TOKENIZE = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/hybrid/prewarm",
    "/v1/hybrid/modules",
    "/tokenize",
)
#: Chat request fields that change how messages render (passed to ``/tokenize`` as they are).
RENDER_KEYS = ("tools", "chat_template", "chat_template_kwargs", "add_special_tokens")
MIDDLEWARE = f"{__name__}.HybridServingMiddleware"


class HybridServingMiddleware:
    """See the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._config: HybridCacheConfig | None = None
        self._modules: _Modules | None = None  # the registered prompt modules

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope.get("type") == "lifespan":
            return await self.app(scope, receive, self._on_startup(scope, send))
        if scope.get("type") == "http" and path == MODULES and scope.get("method") == "GET":
            return await self._list_modules(send)
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        if path not in (CHAT, COMPLETIONS, MESSAGES, PREWARM, MODULES):
            return await self.app(scope, receive, send)
        raw = await _read_body(receive)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        try:
            if path == PREWARM:
                return await self._prewarm(scope, body, send)
            if path == MODULES:
                return await self._register_modules(scope, body, send)
            if isinstance(body, dict):
                new = await self._rewrite(scope, path, body)
                if new is not None:
                    raw = json.dumps(new).encode()
        except CacheOptionError as error:
            return await _send_json(send, 400, _error(str(error)))
        except _Upstream as refused:  # e.g. an unknown model: vLLM's own status and message
            return await _send_json(send, refused.status, refused.answer)
        await self.app(_with_length(scope, len(raw)), _replay(raw, receive), send)

    # ------------------------------------------------------------------ rewriting
    async def _rewrite(self, scope: Scope, path: str, body: dict[str, Any]) -> Any:
        """The body to forward (None: unchanged); CacheOptionError on bad cache options."""
        xargs = body.get("vllm_xargs")
        self._check_options(scope, xargs)
        if isinstance(xargs, dict) and IMPORT_KEY in xargs:
            if path != COMPLETIONS:
                raise ModuleError(
                    f"{IMPORT_KEY}: prompt modules are imported on {COMPLETIONS} only (a chat "
                    "template would put its own tokens between modules)"
                )
            return await self._import_modules(scope, body, xargs)
        if path == MESSAGES:
            return await self._rewrite_anthropic(scope, body)
        if path != CHAT or not isinstance(body.get("messages"), list):
            return None
        markers = chat_markers(body["messages"])
        if not markers:
            return None
        messages = strip_cache_control(body["messages"])
        render = {k: body[k] for k in RENDER_KEYS if k in body}
        if body.get("model") is not None:
            render["model"] = body["model"]
        full = await self._tokens(
            scope,
            {
                **render,
                "messages": messages,
                "add_generation_prompt": body.get("add_generation_prompt", True),
                "continue_final_message": body.get("continue_final_message", False),
            },
        )
        positions = []
        for marker in markers:
            head, cut = prefix_messages(body["messages"], marker)
            tokens = await self._tokens(
                scope,
                {
                    **render,
                    "messages": head,
                    "add_generation_prompt": False,
                    "continue_final_message": cut,
                },
            )
            positions.append(common_prefix_tokens(tokens, full))
        new = dict(body, messages=messages)
        new["vllm_xargs"] = merge_breakpoints(xargs if isinstance(xargs, dict) else None, positions)
        return new

    async def _rewrite_anthropic(self, scope: Scope, body: dict[str, Any]) -> Any:
        markers = anthropic_markers(body)
        if not markers:
            return None
        clean = strip_anthropic_cache_control(body)
        full_chat = _anthropic_as_chat(scope, clean)
        if full_chat is None:
            return clean  # vLLM's own validation answers for the body
        full = await self._tokens(scope, {**full_chat, "add_generation_prompt": True})
        positions = []
        for marker in markers:
            head = _anthropic_as_chat(scope, anthropic_prefix(clean, marker))
            if head is None:
                continue
            # Rendered closed (end-of-message tokens); the common prefix with the whole
            # request stops at the mark when the mark is inside a message.
            tokens = await self._tokens(scope, {**head, "add_generation_prompt": False})
            positions.append(common_prefix_tokens(tokens, full))
        xargs = body.get("vllm_xargs")
        new = dict(clean)
        new["vllm_xargs"] = merge_breakpoints(xargs if isinstance(xargs, dict) else None, positions)
        return new

    def _check_options(self, scope: Scope, xargs: Any) -> CacheOptions:
        if xargs is not None and not isinstance(xargs, dict):
            return CacheOptions()  # vLLM's own validation answers for it
        options = CacheOptions.from_extra_args(xargs)
        if options.pin_ttl_s is not None:
            self._check_ttl(scope, PIN_TTL, options.pin_ttl_s, CacheOptionError)
        return options

    def _check_ttl(
        self, scope: Scope, name: str, ttl_s: float, error: type[CacheOptionError]
    ) -> None:
        """A pin TTL over the server's ``max_pin_ttl_s`` is a 400 (``error``) naming ``name``."""
        limit = self.config(scope).max_pin_ttl_s
        if ttl_s > limit:
            raise error(
                f"{name}: {ttl_s:g} s exceeds the server's limit of {limit:g} s (max_pin_ttl_s)"
            )

    def config(self, scope: Scope) -> HybridCacheConfig:
        """The server's hybrid settings (``additional_config["vllm_hybrid"]``), read once."""
        if self._config is None:
            section = None
            app = scope.get("app")
            vllm_config = getattr(getattr(app, "state", None), "vllm_config", None)
            extra = getattr(vllm_config, "additional_config", None) or {}
            if isinstance(extra, dict) and isinstance(extra.get("vllm_hybrid"), dict):
                section = extra["vllm_hybrid"]
            try:
                self._config = HybridCacheConfig.from_sources(section, {})
            except ConfigError:
                self._config = HybridCacheConfig()  # the engine refuses it at start anyway
        return self._config

    async def _tokens(self, scope: Scope, request: dict[str, Any]) -> list[int]:
        """vLLM's tokens for a chat render; ``_Upstream`` (vLLM's own answer) if it refuses."""
        status, answer = await self._call(scope, TOKENIZE, request)
        if status != 200 or not isinstance(answer, dict) or "tokens" not in answer:
            raise _Upstream(status if status != 200 else 500, answer)
        return list(answer["tokens"])

    # ------------------------------------------------------------------ prewarm
    async def _prewarm(self, scope: Scope, body: Any, send: Send) -> None:
        try:
            request = PrewarmRequest.parse(body)
            self._check_ttl(scope, "prewarm: ttl_s", request.ttl_s, CacheOptionError)
            prompt: Any = request.prompt
            if request.messages is not None:
                if chat_markers(request.messages):
                    raise CacheOptionError(
                        "prewarm: messages must not carry cache_control (the whole prefix is "
                        "prewarmed)"
                    )
                render: dict[str, Any] = {**request.chat, "messages": request.messages}
                render.update(add_generation_prompt=False)
                if request.model is not None:
                    render["model"] = request.model
                prompt = await self._tokens(scope, render)
        except CacheOptionError as error:
            return await _send_json(send, 400, _error(str(error)))
        except _Upstream as refused:
            return await _send_json(send, refused.status, refused.answer)
        status, payload, _ = await self._compute_and_pin(
            scope, prompt, request.ttl_s, request.model, request.cache_salt
        )
        await _send_json(send, status, payload)

    async def _compute_and_pin(
        self,
        scope: Scope,
        prompt: Any,
        ttl_s: float,
        model: str | None,
        cache_salt: str | None,
        breakpoints: list[int] | None = None,
    ) -> tuple[int, Any, str | None]:
        """Compute ``prompt`` (text or token ids) as a one-token completion that pins its
        cached prefix for ``ttl_s`` (``cache_pin_ttl_s``, taken by the engine core when the
        request finishes: ``cache_control.py``), with ``breakpoints`` (the states there stay
        cached). The completion's prompt is the prefix plus one token
        (``core/breakpoints.py::prewarm_prompt``), so the pinned state is at the prefix's end.
        Returns (200, the pin summary, None), (400, error, the refusal reason) when the
        engine took no pin, or vLLM's own (status, answer, None) when it refused the request."""
        if isinstance(prompt, str):  # tokenized as /v1/completions does (special tokens on)
            try:
                render = {"prompt": prompt, **({"model": model} if model is not None else {})}
                prompt = await self._tokens(scope, render)
            except _Upstream as refused:
                return refused.status, refused.answer, None
        try:
            ids = prewarm_prompt(prompt)
        except CacheOptionError as error:
            return 400, _error(str(error)), None
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
        status, answer = await self._call(scope, COMPLETIONS, completion)
        if status != 200 or not isinstance(answer, dict):
            return status, answer, None
        result = (answer.get("kv_transfer_params") or {}).get("vllm_hybrid") or {}
        pin = result.get("pin") or {}
        usage = answer.get("usage") or {}
        if not pin.get("pinned"):
            message = (
                pin.get("message")
                or result.get("error")
                or "the engine took no pin (is the server started with --enable-prefix-caching?)"
            )
            return 400, _error(f"prewarm: {message}"), message
        details = usage.get("prompt_tokens_details") or {}
        return (
            200,
            {
                "object": "hybrid.prewarm",
                "prompt_tokens": len(prompt),  # the prefix's (the completion's has one more)
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

    # ------------------------------------------------------------------ prompt modules
    async def _register_modules(self, scope: Scope, body: Any, send: Send) -> None:
        """``POST /v1/hybrid/modules``: see :meth:`_register`."""
        status, payload = await self._register(scope, body)
        await _send_json(send, status, payload)

    def _on_startup(self, scope: Scope, send: Send) -> Send:
        """The lifespan ``send``, registering the ``modules`` setting's schema file once vLLM's
        own startup is complete (its engine and routes are up then); a failure fails the start."""

        async def wrapped(message: Message) -> None:
            path = self.config(scope).modules
            if message.get("type") == "lifespan.startup.complete" and path:
                try:
                    with open(path, encoding="utf-8") as f:
                        body = json.load(f)
                    status, payload = await self._register(_internal_scope(scope), body)
                except (OSError, ValueError) as failure:
                    status, payload = 400, _error(str(failure))
                if status != 200:
                    error = payload.get("error") if isinstance(payload, dict) else None
                    reason = error.get("message") if isinstance(error, dict) else payload
                    message = {
                        "type": "lifespan.startup.failed",
                        "message": f"vllm-hybrid: modules file {path!r}: {reason}",
                    }
                    logger.error("%s", message["message"])
                else:
                    logger.info("vllm-hybrid: modules file %s registered", path)
            await send(message)

        return wrapped

    async def _register(self, scope: Scope, body: Any) -> tuple[int, Any]:
        """Validate a schema (``core/modules.py``), tokenize each module, prewarm and pin every
        path (breakpoints at its module boundaries); replaces what was registered. (400, error)
        on a bad schema; vLLM's own (status, answer) if it refuses a call; else (200, the
        registration)."""
        try:
            schema = ModuleSchema.parse(body)
            self._check_ttl(scope, "ttl_s", schema.ttl_s, ModuleError)
            model = {"model": schema.model} if schema.model is not None else {}
            # The special tokens the tokenizer puts before a prompt (none on many models).
            lead = await self._tokens(scope, {**model, "prompt": "", "add_special_tokens": True})
            ids = {}
            for name, text in schema.modules.items():
                ids[name] = await self._tokens(
                    scope, {**model, "prompt": text, "add_special_tokens": False}
                )
                if not ids[name]:
                    raise ModuleError(f"modules.{name} tokenizes to no token")
        except CacheOptionError as error:
            return 400, _error(str(error))
        except _Upstream as upstream:
            return upstream.status, upstream.answer
        registered = _Modules(schema, lead, ids)
        prewarmed = []
        # One at a time, in order: a prefix shared by several paths is computed by the first
        # (its boundary state kept by the breakpoint there) and hit by the others.
        for path in schema.prewarm_paths():
            prompt, bounds = registered.prompt(path)
            status, payload, refused = await self._compute_and_pin(
                scope, prompt, schema.ttl_s, schema.model, schema.cache_salt, bounds
            )
            if status != 200 and refused is None:
                return status, payload  # nothing registered
            entry: dict[str, Any] = {"path": list(path), "boundaries": bounds}
            if refused is None:
                entry.update(
                    pinned=True,
                    **{k: payload[k] for k in ("prompt_tokens", "cached_tokens", "pinned_tokens")},
                    pinned_pages=payload["pinned_pages"],
                )
            else:  # computed and cached, not pinned (e.g. over max_pinned_fraction)
                entry.update(pinned=False, prompt_tokens=len(prompt), message=refused)
            prewarmed.append(entry)
        registered.prewarmed = prewarmed
        self._modules = registered
        logger.info(
            "vllm-hybrid: registered %d prompt modules, %d paths",
            len(schema.modules),
            len(schema.paths),
        )
        return 200, registered.describe()

    async def _list_modules(self, send: Send) -> None:
        """``GET /v1/hybrid/modules``: what is registered (``modules`` empty if nothing)."""
        if self._modules is None:
            return await _send_json(send, 200, {"object": "hybrid.modules", "modules": {}})
        await _send_json(send, 200, self._modules.describe())

    async def _import_modules(
        self, scope: Scope, body: dict[str, Any], xargs: dict[str, Any]
    ) -> dict[str, Any]:
        """A completion importing modules: the prompt becomes the modules' token ids (as
        registered, so the boundaries fall where the prewarm put them) followed by the
        request's own prompt (tokenized without special tokens), with a breakpoint at every
        module boundary. ``vllm_xargs["modules"]`` is removed."""
        registered = self._modules
        if registered is None:
            raise ModuleError(
                f"{IMPORT_KEY}: no prompt modules are registered (POST {MODULES} first)"
            )
        names = registered.schema.parse_import(xargs[IMPORT_KEY])
        prompt = body.get("prompt", "")
        if isinstance(prompt, str):
            render = {"prompt": prompt, "add_special_tokens": False}
            if body.get("model") is not None:
                render["model"] = body["model"]
            rest = await self._tokens(scope, render) if prompt else []
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            rest = list(prompt)
        else:
            raise ModuleError(
                f"{IMPORT_KEY}: a request importing modules takes one prompt (text or token ids)"
            )
        ids, bounds = registered.prompt(names)
        others = {k: v for k, v in xargs.items() if k != IMPORT_KEY}
        return dict(body, prompt=ids + rest, vllm_xargs=merge_breakpoints(others, bounds))

    # ------------------------------------------------------------------ in-process calls
    async def _call(self, scope: Scope, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """POST ``body`` to ``path`` of the app below us (same process, same headers)."""
        data = json.dumps(body).encode()
        sub = dict(_with_length(scope, len(data)), path=path, raw_path=path.encode())
        sub["query_string"] = b""
        status, chunks = 500, []

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(sub, _replay(data, None), send)
        try:
            return status, json.loads(b"".join(chunks) or b"null")
        except ValueError:
            return status, {"error": {"message": b"".join(chunks).decode(errors="replace")}}


class _Modules:
    """Registered prompt modules: the schema, each module's token ids, the lead tokens."""

    def __init__(self, schema: ModuleSchema, lead: list[int], ids: dict[str, list[int]]):
        self.schema, self.lead, self.ids = schema, lead, ids
        self.prewarmed: list[dict[str, Any]] = []

    def prompt(self, names: Any) -> tuple[list[int], list[int]]:
        """The token ids of ``names`` in order (after the lead) and each module's end."""
        ids = list(self.lead)
        for name in names:
            ids += self.ids[name]
        return ids, boundaries([len(self.ids[n]) for n in names], len(self.lead))

    def describe(self) -> dict[str, Any]:
        out = {"object": "hybrid.modules", **self.schema.describe()}
        for name, entry in out["modules"].items():
            entry["tokens"] = len(self.ids[name])
        out["lead_tokens"] = len(self.lead)
        out["prewarmed"] = self.prewarmed
        return out


def _anthropic_as_chat(scope: Scope, body: dict[str, Any]) -> dict[str, Any] | None:
    """A ``/v1/messages`` body as ``/tokenize`` chat fields (messages, tools,
    chat_template_kwargs) through vLLM's converter; None if vLLM would refuse the body."""
    from pydantic import ValidationError
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    try:
        request = AnthropicMessagesRequest.model_validate(body)
    except ValidationError:
        return None
    serving = getattr(getattr(scope.get("app"), "state", None), "anthropic_serving_messages", None)
    chat = AnthropicServingMessages.to_chat_completion_request(
        request, merge_inline_system=bool(getattr(serving, "_merge_inline_system", False))
    )
    dumped = chat.model_dump(mode="json", exclude_none=True)
    return {
        k: dumped[k] for k in ("model", "messages", "tools", "chat_template_kwargs") if k in dumped
    }


class _Upstream(Exception):
    """vLLM refused an in-process call; its status and answer go back to the client."""

    def __init__(self, status: int, answer: Any) -> None:
        super().__init__(status)
        self.status, self.answer = status, answer


def _error(message: str, status: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(data: bytes, receive: Receive | None) -> Receive:
    """A ``receive`` that yields ``data`` once, then waits for the client to go (the original
    ``receive``; vLLM watches it to cancel requests whose client disconnected)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        if receive is not None:
            return await receive()
        await asyncio.Event().wait()  # an in-process call never disconnects
        return {"type": "http.disconnect"}

    return replay


def _internal_scope(lifespan: Scope) -> Scope:
    """An HTTP scope for in-process calls made outside any request (at startup). With
    ``--api-key`` (or ``VLLM_API_KEY``) it carries the server's first key, which vLLM's
    ``AuthenticationMiddleware`` (``vllm/entrypoints/serve/middleware/``, below ours) checks."""
    app = lifespan.get("app")
    args = getattr(getattr(app, "state", None), "args", None)
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


def _with_length(scope: Scope, length: int) -> Scope:
    skip = (b"content-length", b"content-type", b"transfer-encoding")
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in skip]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(length).encode())]
    return dict(scope, headers=headers)


async def _send_json(send: Send, status: int, payload: Any) -> None:
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
