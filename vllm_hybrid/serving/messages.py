"""``cache_control`` marks in OpenAI chat and Anthropic ``/v1/messages`` bodies: found,
validated, stripped, and the prefix up to each one.

Serving work (stdlib only): the middleware (``serving/middleware.py``) renders each prefix
with vLLM's own chat template to get a mark's token position; the engine only ever sees
positions (``core/breakpoints.py``). The mark is Anthropic's: ``{"type": "ephemeral"}``,
optionally with ``"ttl": "5m" | "1h"``, on a message or on one of its content blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hybrid.core import MAX_BREAKPOINTS, CacheOptionError

CACHE_CONTROL = "cache_control"
CACHE_CONTROL_TYPES = ("ephemeral",)
CACHE_CONTROL_TTLS = ("5m", "1h")


@dataclass(frozen=True)
class Marker:
    """A ``cache_control`` mark: on message ``message`` (``block`` None) or on its content
    block ``block``; ``last_block`` is True when nothing of the message follows the mark."""

    message: int
    block: int | None
    last_block: bool


def check_cache_control(value: Any, where: str) -> None:
    """Accept ``{"type": "ephemeral"}`` (optionally ``"ttl": "5m" | "1h"``), as Anthropic's."""
    if not isinstance(value, Mapping):
        raise CacheOptionError(
            f'{where}: cache_control must be an object like {{"type": "ephemeral"}}, '
            f"got {type(value).__name__}"
        )
    unknown = sorted(set(value) - {"type", "ttl"})
    if unknown:
        raise CacheOptionError(f"{where}: cache_control has unknown field(s) {unknown}")
    kind = value.get("type")
    if kind not in CACHE_CONTROL_TYPES:
        raise CacheOptionError(
            f'{where}: cache_control type {kind!r} is not supported; use {{"type": "ephemeral"}}'
        )
    if "ttl" in value and value["ttl"] not in CACHE_CONTROL_TTLS:
        raise CacheOptionError(
            f"{where}: cache_control ttl {value['ttl']!r} must be one of "
            f"{', '.join(CACHE_CONTROL_TTLS)}"
        )


def chat_markers(messages: Any) -> list[Marker]:
    """Every ``cache_control`` mark in a chat request's ``messages``, validated, in order."""
    if not isinstance(messages, list):
        raise CacheOptionError(f"messages must be a list, got {type(messages).__name__}")
    found: list[Marker] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue  # vLLM's own validation answers for malformed messages
        content = message.get("content")
        blocks = content if isinstance(content, list) else []
        marked = [j for j, b in enumerate(blocks) if isinstance(b, Mapping) and CACHE_CONTROL in b]
        for j in marked:
            check_cache_control(blocks[j][CACHE_CONTROL], f"messages[{i}].content[{j}]")
            found.append(Marker(i, j, last_block=j == len(blocks) - 1))
        if CACHE_CONTROL in message:
            check_cache_control(message[CACHE_CONTROL], f"messages[{i}]")
            if not marked or marked[-1] != len(blocks) - 1:
                found.append(Marker(i, None, last_block=True))
    if len(found) > MAX_BREAKPOINTS:
        raise CacheOptionError(
            f"at most {MAX_BREAKPOINTS} cache_control marks per request, got {len(found)}"
        )
    return found


def strip_cache_control(messages: list[Any]) -> list[Any]:
    """A copy of ``messages`` without any ``cache_control`` field (vLLM does not know it)."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            out.append(message)
            continue
        message = {k: v for k, v in message.items() if k != CACHE_CONTROL}
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [
                {k: v for k, v in b.items() if k != CACHE_CONTROL} if isinstance(b, Mapping) else b
                for b in content
            ]
        out.append(message)
    return out


def prefix_messages(messages: list[Any], marker: Marker) -> tuple[list[Any], bool]:
    """The messages up to and including the mark, and whether the last one is cut inside
    (then render it with ``continue_final_message``: no end-of-message tokens)."""
    head = strip_cache_control(messages[: marker.message + 1])
    if marker.block is None or marker.last_block:
        return head, False
    last = dict(head[-1])
    last["content"] = last["content"][: marker.block + 1]
    return [*head[:-1], last], True


#: Roles of the messages that make a system prompt (OpenAI's ``developer`` is its new name).
SYSTEM_ROLES = ("system", "developer")


def system_prompt_probe(messages: Any) -> list[Any] | None:
    """Messages to render for the end of a chat's system prompt: its leading system messages
    and the next message's role with empty content; the rendered tokens' common prefix with
    the whole request's ends after that role's header, where another conversation with the
    same system prompt diverges. None when there is no system prompt or nothing after it."""
    if not isinstance(messages, list):
        return None
    k = 0
    while k < len(messages) and _role(messages[k]) in SYSTEM_ROLES:
        k += 1
    if k == 0 or k == len(messages) or _role(messages[k]) is None:
        return None
    return [*strip_cache_control(messages[:k]), {"role": _role(messages[k]), "content": ""}]


def _role(message: Any) -> str | None:
    role = message.get("role") if isinstance(message, Mapping) else None
    return role if isinstance(role, str) else None


# --- Anthropic /v1/messages ---------------------------------------------------------------


@dataclass(frozen=True)
class AnthropicMarker:
    """A ``cache_control`` mark on block ``block`` of the ``system`` list (``message`` None)
    or of ``messages[message].content``."""

    message: int | None
    block: int


def anthropic_markers(body: Mapping[str, Any]) -> list[AnthropicMarker]:
    """Every ``cache_control`` mark on a ``/v1/messages`` body's system or message content
    blocks, validated, in order. (Marks on ``tools`` are dropped by
    :func:`strip_anthropic_cache_control` and not used: tools render in the template's own
    place, not at a prefix boundary.)"""
    found: list[AnthropicMarker] = []
    system = body.get("system")
    for j, block in enumerate(system if isinstance(system, list) else []):
        if isinstance(block, Mapping) and CACHE_CONTROL in block:
            check_cache_control(block[CACHE_CONTROL], f"system[{j}]")
            found.append(AnthropicMarker(None, j))
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, Mapping) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            if isinstance(block, Mapping) and CACHE_CONTROL in block:
                check_cache_control(block[CACHE_CONTROL], f"messages[{i}].content[{j}]")
                found.append(AnthropicMarker(i, j))
    if len(found) > MAX_BREAKPOINTS:
        raise CacheOptionError(
            f"at most {MAX_BREAKPOINTS} cache_control marks per request, got {len(found)}"
        )
    return found


def _strip_blocks(blocks: Any) -> Any:
    if not isinstance(blocks, list):
        return blocks
    return [
        {k: v for k, v in b.items() if k != CACHE_CONTROL} if isinstance(b, Mapping) else b
        for b in blocks
    ]


def strip_anthropic_cache_control(body: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a ``/v1/messages`` body without ``cache_control`` on system, message content
    and tool entries."""
    out = dict(body)
    for key in ("system", "tools"):
        if key in out:
            out[key] = _strip_blocks(out[key])
    if isinstance(out.get("messages"), list):
        out["messages"] = [
            dict(m, content=_strip_blocks(m.get("content"))) if isinstance(m, Mapping) else m
            for m in out["messages"]
        ]
    return out


def anthropic_prefix(body: Mapping[str, Any], marker: AnthropicMarker) -> dict[str, Any]:
    """``body`` cut right after the marked block (system blocks, messages and content blocks
    that follow it removed)."""
    out = dict(body)
    if marker.message is None:
        out["system"] = list(body["system"][: marker.block + 1])
        out["messages"] = []
        return out
    messages = list(body["messages"][: marker.message + 1])
    last = dict(messages[-1])
    last["content"] = list(last["content"][: marker.block + 1])
    out["messages"] = [*messages[:-1], last]
    return out
