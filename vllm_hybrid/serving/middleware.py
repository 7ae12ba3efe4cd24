"""Cache breakpoints and prewarming on vLLM's OpenAI-compatible server (vLLM 0.32.0).

A pure ASGI middleware, loaded by vLLM's ``--middleware`` option
(``vllm/entrypoints/serve/middleware/register.py``: a class is added with
``app.add_middleware``); ``vllm-hybrid serve`` adds it by itself::

    python -m vllm.entrypoints.openai.api_server --model M --enable-prefix-caching \\
        --middleware vllm_hybrid.serving.HybridServingMiddleware

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
* ``POST /v1/hybrid/prewarm`` (``prewarm.py``) and ``/v1/hybrid/modules`` (``modules.py``).

Bad cache options get HTTP 400 in vLLM's error shape. Parsing of the marks is
``messages.py``, of options and pins ``core/breakpoints.py`` and ``core/pins.py``; the engine
side is ``adapters/vllm/cache_control.py``. What it reads of vLLM's server state goes through
``adapters/vllm/compat/server.py``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from vllm_hybrid.adapters.vllm.compat.server import (
    anthropic_merge_inline_system,
    server_vllm_config,
)
from vllm_hybrid.core import (
    IMPORT_KEY,
    PIN_TTL,
    CacheOptionError,
    CacheOptions,
    ConfigError,
    HybridCacheConfig,
    ModuleError,
    common_prefix_tokens,
    merge_breakpoints,
)
from vllm_hybrid.serving import modules, prewarm
from vllm_hybrid.serving.asgi import (
    AppClient,
    ASGIApp,
    Receive,
    Scope,
    Send,
    Upstream,
    error_body,
    internal_scope,
    read_body,
    replay,
    send_json,
    with_length,
)
from vllm_hybrid.serving.messages import (
    anthropic_markers,
    anthropic_prefix,
    chat_markers,
    prefix_messages,
    strip_anthropic_cache_control,
    strip_cache_control,
    system_prompt_probe,
)

logger = logging.getLogger("vllm_hybrid")

CHAT, MESSAGES, PREWARM = "/v1/chat/completions", "/v1/messages", "/v1/hybrid/prewarm"
COMPLETIONS, MODULES = prewarm.COMPLETIONS, modules.MODULES
#: Chat request fields that change how messages render (passed to ``/tokenize`` as they are).
RENDER_KEYS = ("tools", "chat_template", "chat_template_kwargs", "add_special_tokens")


class HybridServingMiddleware:
    """See the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.client = AppClient(app)
        self._config: HybridCacheConfig | None = None
        self._modules: modules.Modules | None = None  # the registered prompt modules

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope.get("type") == "lifespan":
            return await self.app(scope, receive, self._on_startup(scope, send))
        if scope.get("type") == "http" and path == MODULES and scope.get("method") == "GET":
            return await send_json(send, 200, modules.describe(self._modules))
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        if path not in (CHAT, COMPLETIONS, MESSAGES, PREWARM, MODULES):
            return await self.app(scope, receive, send)
        raw = await read_body(receive)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        if path == PREWARM:
            return await send_json(send, *await self._prewarm(scope, body))
        if path == MODULES:
            return await send_json(send, *await self._register(scope, body))
        try:
            if isinstance(body, dict):
                new = await self._rewrite(scope, path, body)
                if new is not None:
                    raw = json.dumps(new).encode()
        except CacheOptionError as error:
            return await send_json(send, 400, error_body(str(error)))
        except Upstream as refused:  # e.g. an unknown model: vLLM's own status and message
            return await send_json(send, refused.status, refused.answer)
        await self.app(with_length(scope, len(raw)), replay(raw, receive), send)

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
            return await modules.import_modules(self.client, scope, self._modules, body, xargs)
        if path == MESSAGES:
            return await self._rewrite_anthropic(scope, body)
        if path != CHAT or not isinstance(body.get("messages"), list):
            return None
        return await self._rewrite_chat(scope, body, xargs)

    async def _rewrite_chat(self, scope: Scope, body: dict[str, Any], xargs: Any) -> Any:
        markers = chat_markers(body["messages"])
        if not markers:
            return await self._system_breakpoint(scope, body, xargs)
        messages = strip_cache_control(body["messages"])
        render = render_args(body)
        full = await self._prompt_tokens(scope, body, messages, render)
        positions = []
        for marker in markers:
            head, cut = prefix_messages(body["messages"], marker)
            tokens = await self.client.tokens(
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

    async def _prompt_tokens(
        self, scope: Scope, body: dict[str, Any], messages: list[Any], render: dict[str, Any]
    ) -> list[int]:
        """The whole request's prompt tokens, rendered as vLLM renders the request."""
        return await self.client.tokens(
            scope,
            {
                **render,
                "messages": messages,
                "add_generation_prompt": body.get("add_generation_prompt", True),
                "continue_final_message": body.get("continue_final_message", False),
            },
        )

    async def _system_breakpoint(self, scope: Scope, body: dict[str, Any], xargs: Any) -> Any:
        """A chat request with no marks: a breakpoint where its system prompt ends (the next
        message's role header included), where another conversation with the same system
        prompt diverges, so its first prefill keeps the state there (``system_breakpoint``,
        on by default; docs/serving.md). Anything the probe's rendering refuses leaves the
        request as it came (None): a request never fails for a breakpoint it did not ask for."""
        config = self.config(scope)
        probe = system_prompt_probe(body["messages"]) if config.enabled else None
        if probe is None or not config.system_breakpoint:
            return None
        render = render_args(body)
        try:
            full = await self._prompt_tokens(scope, body, body["messages"], render)
            head = await self.client.tokens(
                scope, {**render, "messages": probe, "add_generation_prompt": False}
            )
        except Upstream:
            return None
        position = common_prefix_tokens(head, full)
        if position <= 0:
            return None
        known = xargs if isinstance(xargs, dict) else None
        return dict(body, vllm_xargs=merge_breakpoints(known, [position]))

    async def _rewrite_anthropic(self, scope: Scope, body: dict[str, Any]) -> Any:
        markers = anthropic_markers(body)
        if not markers:
            return None
        clean = strip_anthropic_cache_control(body)
        full_chat = anthropic_as_chat(scope, clean)
        if full_chat is None:
            return clean  # vLLM's own validation answers for the body
        full = await self.client.tokens(scope, {**full_chat, "add_generation_prompt": True})
        positions = []
        for marker in markers:
            head = anthropic_as_chat(scope, anthropic_prefix(clean, marker))
            if head is None:
                continue
            # Rendered closed (end-of-message tokens); the common prefix with the whole
            # request stops at the mark when the mark is inside a message.
            tokens = await self.client.tokens(scope, {**head, "add_generation_prompt": False})
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
            vllm_config = server_vllm_config(scope.get("app"))
            extra = getattr(vllm_config, "additional_config", None) or {}
            if isinstance(extra, dict) and isinstance(extra.get("vllm_hybrid"), dict):
                section = extra["vllm_hybrid"]
            try:
                self._config = HybridCacheConfig.from_sources(section, {})
            except ConfigError:
                self._config = HybridCacheConfig()  # the engine refuses it at start anyway
        return self._config

    # ------------------------------------------------------------------ prewarm and modules
    async def _prewarm(self, scope: Scope, body: Any) -> tuple[int, Any]:
        def check(name: str, ttl_s: float, error: type[CacheOptionError]) -> None:
            self._check_ttl(scope, name, ttl_s, error)

        return await prewarm.prewarm(self.client, scope, body, check)

    async def _register(self, scope: Scope, body: Any) -> tuple[int, Any]:
        """``POST /v1/hybrid/modules`` (``modules.register``); replaces what was registered."""

        def check(name: str, ttl_s: float, error: type[CacheOptionError]) -> None:
            self._check_ttl(scope, name, ttl_s, error)

        status, payload, registered = await modules.register(self.client, scope, body, check)
        if registered is not None:
            self._modules = registered
        return status, payload

    def _on_startup(self, scope: Scope, send: Send) -> Send:
        """The lifespan ``send``, registering the ``modules`` setting's schema file once vLLM's
        own startup is complete (its engine and routes are up then); a failure fails the start."""

        async def wrapped(message: Any) -> None:
            path = self.config(scope).modules
            if message.get("type") == "lifespan.startup.complete" and path:
                try:
                    with open(path, encoding="utf-8") as f:
                        body = json.load(f)
                    status, payload = await self._register(internal_scope(scope), body)
                except (OSError, ValueError) as failure:
                    status, payload = 400, error_body(str(failure))
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


def render_args(body: dict[str, Any]) -> dict[str, Any]:
    """The fields of a chat request that change how its messages render."""
    render = {k: body[k] for k in RENDER_KEYS if k in body}
    if body.get("model") is not None:
        render["model"] = body["model"]
    return render


def anthropic_as_chat(scope: Scope, body: dict[str, Any]) -> dict[str, Any] | None:
    """A ``/v1/messages`` body as ``/tokenize`` chat fields (messages, tools,
    chat_template_kwargs) through vLLM's converter; None if vLLM would refuse the body."""
    from pydantic import ValidationError
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    try:
        request = AnthropicMessagesRequest.model_validate(body)
    except ValidationError:
        return None
    chat = AnthropicServingMessages.to_chat_completion_request(
        request, merge_inline_system=anthropic_merge_inline_system(scope.get("app"))
    )
    dumped = chat.model_dump(mode="json", exclude_none=True)
    return {
        k: dumped[k] for k in ("model", "messages", "tools", "chat_template_kwargs") if k in dumped
    }
