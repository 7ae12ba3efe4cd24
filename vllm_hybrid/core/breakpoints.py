"""Explicit cache breakpoints, pins and cache reports: what a request may ask, validated.

Engine-agnostic (stdlib only). A request carries its cache options in a flat mapping of extra
arguments (vLLM: ``SamplingParams.extra_args``, over HTTP the ``vllm_xargs`` field of
``/v1/completions`` and ``/v1/chat/completions``):

====================  ==========================  ===============================================
key                   value                       meaning
====================  ==========================  ===============================================
``cache_breakpoints`` int or list of ints         token positions where stable content ends
                                                  (the prompt's first ``p`` tokens are the
                                                  stable part); the engine keeps the recurrent
                                                  state there (see :func:`hit_position`)
``cache_report``      bool (``true``/``1``)       return a per-request cache report
``cache_pin_ttl_s``   number > 0                  after the request, pin its cached prefix (KV
                                                  and the state at its end) for this many
                                                  seconds (bounded, see ``core/pins.py``)
====================  ==========================  ===============================================

Other keys are left alone (they belong to other extensions), except unknown keys that start
with ``cache_``, which are refused so that a typo does not silently do nothing.

Chat requests mark breakpoints the Anthropic way: ``"cache_control": {"type": "ephemeral"}`` on
a message or on one of its content blocks; finding and validating those marks in OpenAI and
Anthropic message formats is the serving layer's work (``vllm_hybrid/serving/messages.py``),
which turns each into a token position and adds it with :func:`merge_breakpoints`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BREAKPOINTS = "cache_breakpoints"
REPORT = "cache_report"
PIN_TTL = "cache_pin_ttl_s"
OPTION_KEYS = (BREAKPOINTS, REPORT, PIN_TTL)
#: At most this many breakpoints per request (Anthropic allows 4; a few more cost nothing).
MAX_BREAKPOINTS = 8


class CacheOptionError(ValueError):
    """A cache option a request cannot carry; the message says which and why (HTTP 400)."""


@dataclass(frozen=True)
class CacheOptions:
    """A request's validated cache options (all empty: the request asked for nothing)."""

    breakpoints: tuple[int, ...] = ()
    report: bool = False
    pin_ttl_s: float | None = None

    @property
    def any(self) -> bool:
        return bool(self.breakpoints) or self.report or self.pin_ttl_s is not None

    @classmethod
    def from_extra_args(cls, extra: Mapping[str, Any] | None) -> CacheOptions:
        """Parse a request's extra arguments; CacheOptionError on a bad value."""
        if not extra:
            return NO_OPTIONS
        if not isinstance(extra, Mapping):
            raise CacheOptionError(f"extra arguments must be an object, got {_kind(extra)}")
        unknown = sorted(k for k in extra if str(k).startswith("cache_") and k not in OPTION_KEYS)
        if unknown:
            raise CacheOptionError(
                f"unknown cache option(s) {unknown}; valid: {', '.join(OPTION_KEYS)}"
            )
        if not any(k in extra for k in OPTION_KEYS):
            return NO_OPTIONS
        return cls(
            breakpoints=parse_breakpoints(extra.get(BREAKPOINTS)),
            report=parse_flag(REPORT, extra.get(REPORT, False)),
            pin_ttl_s=parse_ttl(extra[PIN_TTL]) if PIN_TTL in extra else None,
        )


NO_OPTIONS = CacheOptions()


def parse_breakpoints(value: Any) -> tuple[int, ...]:
    """``None``, one position or a list of positions -> sorted distinct positions (>= 1)."""
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    if len(items) > MAX_BREAKPOINTS:
        raise CacheOptionError(
            f"{BREAKPOINTS}: at most {MAX_BREAKPOINTS} breakpoints, got {len(items)}"
        )
    out = set()
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise CacheOptionError(
                f"{BREAKPOINTS}: {item!r} is not a token position (a positive integer); "
                f"accepted forms: N or [N, ...]"
            )
        if isinstance(item, float) and not item.is_integer():
            raise CacheOptionError(f"{BREAKPOINTS}: {item!r} is not a whole token position")
        if item < 1:
            raise CacheOptionError(f"{BREAKPOINTS}: position {item!r} must be at least 1")
        out.add(int(item))
    return tuple(sorted(out))


def parse_flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise CacheOptionError(f"{key}: {value!r} must be true or false")


def parse_ttl(value: Any, key: str = PIN_TTL) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CacheOptionError(f"{key}: {value!r} must be a number of seconds")
    if not math.isfinite(value) or value <= 0:
        raise CacheOptionError(f"{key}: {value!r} must be a positive number of seconds")
    return float(value)


def effective_breakpoints(breakpoints: Sequence[int], prompt_tokens: int) -> tuple[int, ...]:
    """The positions an engine can act on for a prompt of ``prompt_tokens``: each clamped to
    ``prompt_tokens - 1`` (the last prompt token is always recomputed to get logits, so no hit
    reaches past it, and a state after the whole prompt is advanced in place by decoding)."""
    last = prompt_tokens - 1
    return tuple(sorted({min(p, last) for p in breakpoints if last >= 1}))


def hit_position(breakpoint: int, unit_tokens: int) -> int:
    """Where a later request sharing the first ``breakpoint`` tokens hits: the largest multiple
    of ``unit_tokens`` not above the breakpoint. ``unit_tokens`` is the engine's prefix match
    unit where vLLM can cache a recurrent state inside a block (``--prefix-match-unit`` below
    the block size; 1 makes every breakpoint exact), else its state block (vLLM 0.32 "align"
    mode keeps states at block boundaries only); see docs/serving.md."""
    return breakpoint // unit_tokens * unit_tokens


def prewarm_prompt(ids: Sequence[int]) -> list[int]:
    """What a prewarm of the prefix ``ids`` computes: the prefix and one more token (a copy of
    its last). A prompt's last token is always recomputed for its logits, so a prompt of ``P``
    tokens keeps its state at ``P - 1`` at best; one token more puts the prompt's own
    snapshot at ``P`` itself (``floor(P / U) * U``), where a request extending the prefix
    diverges. (What is keyed past ``P`` is hit only by prompts that continue with that same
    token, for which it is right.)"""
    if not ids:
        raise CacheOptionError("prewarm: the prefix tokenizes to no token")
    return [*ids, ids[-1]]


def merge_breakpoints(extra: Mapping[str, Any] | None, positions: Sequence[int]) -> dict[str, Any]:
    """``extra`` (vllm_xargs) with ``positions`` added to its breakpoints (validated)."""
    out = dict(extra or {})
    merged = set(parse_breakpoints(out.get(BREAKPOINTS))) | {p for p in positions if p >= 1}
    if merged:
        out[BREAKPOINTS] = list(parse_breakpoints(sorted(merged)))
    return out


def common_prefix_tokens(a: Sequence[object], b: Sequence[object]) -> int:
    """Length of the longest common prefix of two sequences (token ids, or words for
    ``vllm-hybrid advise``)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _kind(value: Any) -> str:
    return type(value).__name__
