"""Pins with a time-to-live, bounded to a share of the pool; and the prewarm request.

Engine-agnostic (stdlib only). A *pin* keeps a cached prefix (its KV pages and the state
snapshot at its end) out of eviction until its TTL expires. The engine holds the pages (vLLM:
one extra reference per block); :class:`PinLedger` decides whether a pin fits and when it ends.

Invariants (:meth:`PinLedger.check_integrity`):

1. ``pinned_pages == sum(len(pin.pages) for pin in pins)`` and ``<= limit_pages``.
2. Every pin has ``expires_at > created_at`` and at least one page.

Clock: the caller passes ``now`` (monotonic seconds); expiry happens when the caller asks
(:meth:`PinLedger.expire`), i.e. at the engine's next scheduler step after the TTL.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_hybrid.core.breakpoints import CacheOptionError, parse_ttl

DEFAULT_TTL_S = 300.0


@dataclass
class Pin:
    key: Hashable  # what was pinned (vLLM: the block hash of the prefix's last block)
    pages: list[Any]  # the engine's page handles, released together on expiry
    tokens: int  # the prefix length a later request hits with this pin
    created_at: float
    expires_at: float


@dataclass(frozen=True)
class PinDecision:
    ok: bool
    message: str = ""
    extended: bool = False  # the key was pinned already: its TTL was extended


@dataclass
class PinCounters:
    taken: int = 0
    refused: int = 0
    expired: int = 0
    extended: int = 0


@dataclass
class PinLedger:
    """Pins by key, at most ``limit_pages`` pages pinned at once, each for at most
    ``max_ttl_s`` seconds. A key pinned again keeps its pages and gets the later expiry."""

    limit_pages: int
    max_ttl_s: float
    pins: dict[Hashable, Pin] = field(default_factory=dict)
    pinned_pages: int = 0
    counters: PinCounters = field(default_factory=PinCounters)

    @classmethod
    def for_pool(cls, pool_pages: int, max_fraction: float, max_ttl_s: float) -> PinLedger:
        return cls(limit_pages=int(math.floor(pool_pages * max_fraction)), max_ttl_s=max_ttl_s)

    def check(self, key: Hashable, pages: int, ttl_s: float) -> PinDecision:
        """Whether a pin of ``pages`` pages for ``ttl_s`` seconds fits (changes nothing)."""
        if ttl_s > self.max_ttl_s:
            return PinDecision(
                False,
                f"pin ttl {ttl_s:g} s exceeds the limit of {self.max_ttl_s:g} s (max_pin_ttl_s)",
            )
        if key in self.pins:
            return PinDecision(True, extended=True)
        if pages <= 0:
            return PinDecision(False, "nothing to pin: no cached prefix of a full block")
        if self.pinned_pages + pages > self.limit_pages:
            return PinDecision(
                False,
                f"pin of {pages} pages refused: {self.pinned_pages} of {self.limit_pages} "
                f"pinnable pages are pinned already (max_pinned_fraction of the pool)",
            )
        return PinDecision(True)

    def add(
        self, key: Hashable, pages: Sequence[Any], tokens: int, ttl_s: float, now: float
    ) -> PinDecision:
        """Record a pin (after :meth:`check` said ok and the engine took the pages); for a key
        pinned already, only extend its expiry (the caller must not take the pages again)."""
        decision = self.check(key, len(pages), ttl_s)
        if not decision.ok:
            self.counters.refused += 1
            return decision
        if decision.extended:
            pin = self.pins[key]
            pin.expires_at = max(pin.expires_at, now + ttl_s)
            self.counters.extended += 1
            return decision
        self.pins[key] = Pin(key, list(pages), tokens, now, now + ttl_s)
        self.pinned_pages += len(pages)
        self.counters.taken += 1
        return decision

    def refuse(self) -> None:
        self.counters.refused += 1

    def expire(self, now: float) -> list[Pin]:
        """Remove and return the pins whose TTL has passed (the caller releases their pages)."""
        done = [p for p in self.pins.values() if p.expires_at <= now]
        for pin in done:
            self._drop(pin)
        self.counters.expired += len(done)
        return done

    def release_all(self) -> list[Pin]:
        """Remove and return every pin (e.g. before the engine resets its prefix cache)."""
        done = list(self.pins.values())
        for pin in done:
            self._drop(pin)
        return done

    def _drop(self, pin: Pin) -> None:
        del self.pins[pin.key]
        self.pinned_pages -= len(pin.pages)

    def totals(self, now: float) -> dict[str, float]:
        """Metric values (keys are ``core/cache_stats.py`` METRICS keys)."""
        left = [p.expires_at - now for p in self.pins.values()]
        c = self.counters
        return {
            "pins": len(self.pins),
            "pinned_pages": self.pinned_pages,
            "pin_limit_pages": self.limit_pages,
            "pin_ttl_left_seconds_max": max(left, default=0.0),
            "pin_ttl_left_seconds_min": min(left, default=0.0),
            "pins_taken": c.taken,
            "pins_extended": c.extended,
            "pins_refused": c.refused,
            "pins_expired": c.expired,
        }

    def check_integrity(self) -> None:
        total = sum(len(p.pages) for p in self.pins.values())
        assert total == self.pinned_pages <= self.limit_pages, f"inv 1: {total} {self!r}"
        for pin in self.pins.values():
            assert pin.pages and pin.expires_at > pin.created_at, f"inv 2: {pin!r}"


# --- the prewarm request ---------------------------------------------------------------------

PREWARM_KEYS = (
    "model",
    "prompt",
    "messages",
    "ttl_s",
    "cache_salt",
    "tools",
    "chat_template",
    "chat_template_kwargs",
)


@dataclass(frozen=True)
class PrewarmRequest:
    """``POST /v1/hybrid/prewarm``: exactly one of ``prompt`` (text or token ids) and
    ``messages`` (a chat prefix, rendered without a generation prompt), and ``ttl_s``."""

    ttl_s: float
    prompt: str | list[int] | None = None
    messages: list[Any] | None = None
    model: str | None = None
    cache_salt: str | None = None
    chat: Mapping[str, Any] = field(default_factory=dict)  # tools, chat_template, ...

    @classmethod
    def parse(cls, body: Any) -> PrewarmRequest:
        if not isinstance(body, Mapping):
            raise CacheOptionError("prewarm: the body must be a JSON object")
        unknown = sorted(set(body) - set(PREWARM_KEYS))
        if unknown:
            raise CacheOptionError(
                f"prewarm: unknown field(s) {unknown}; valid: {', '.join(PREWARM_KEYS)}"
            )
        if ("prompt" in body) == ("messages" in body):
            raise CacheOptionError('prewarm: give exactly one of "prompt" and "messages"')
        prompt = body.get("prompt")
        if "prompt" in body and not _is_prompt(prompt):
            raise CacheOptionError(
                "prewarm: prompt must be a non-empty string or a non-empty list of token ids"
            )
        messages = body.get("messages")
        if "messages" in body and (not isinstance(messages, list) or not messages):
            raise CacheOptionError("prewarm: messages must be a non-empty list")
        for key in ("model", "cache_salt"):
            if body.get(key) is not None and not isinstance(body[key], str):
                raise CacheOptionError(f"prewarm: {key} must be a string")
        return cls(
            ttl_s=parse_ttl(body.get("ttl_s", DEFAULT_TTL_S), "prewarm: ttl_s"),
            prompt=prompt,
            messages=messages,
            model=body.get("model"),
            cache_salt=body.get("cache_salt"),
            chat={
                k: body[k] for k in ("tools", "chat_template", "chat_template_kwargs") if k in body
            },
        )


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )
