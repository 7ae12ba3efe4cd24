"""Per-request cache control inside vLLM's engine core: breakpoints, pins, cache reports.

Written against vLLM 0.32.0. The scheduler (``scheduler.py``) owns one :class:`CacheControl`
when prefix caching is on, and calls it from four places:

* ``Scheduler._get_local_prefix_cache_hit`` (``vllm/v1/core/sched/scheduler.py``): the
  request's prefix-cache lookup returns vLLM's ``shared_prefix_boundary``, the junction where
  cached KV runs past the last cached state. :meth:`on_lookup` replaces it by the first of the
  request's breakpoints (``SamplingParams.extra_args["cache_breakpoints"]``) past the hit,
  keeping vLLM's junction among the stops. vLLM itself then does the rest, as for its own
  junctions: ``Scheduler._mamba_block_aligned_split`` ends the prefill chunk at the block-floored
  boundary (so the recurrent state there is written), and ``MambaManager.cache_blocks``
  (``reachable_block_mask``, ``vllm/v1/core/single_type_kv_cache_manager.py``) keeps the state
  block ending there in the prefix cache.
* after ``Scheduler.schedule``: :meth:`after_schedule` moves ``shared_prefix_boundary`` to the
  next breakpoint once a chunk reached the current one, and builds the report of each request
  scheduled for the first time (``SchedulerOutput.scheduled_new_reqs``).
* ``Scheduler._free_request``: :meth:`on_finished` pins the finished request's cached prefix if
  it asked (``cache_pin_ttl_s``), and returns the report and pin outcome; the scheduler puts
  them in the request's ``kv_transfer_params`` (``EngineCoreOutput``), which vLLM returns in the
  OpenAI response (``kv_transfer_params`` field) and in ``RequestOutput.kv_transfer_params``.
* every step: :meth:`expire` releases pins whose TTL passed (``BlockPool.free_blocks``).

Pins hold one extra reference on each block through ``BlockPool.touch`` (``block_pool.py``), as
a prefix hit does, so neither vLLM's LRU nor our policy can evict them; ``free_blocks`` gives
it back. Logic and limits live in ``core/`` (``breakpoints.py``, ``pins.py``,
``cache_report.py``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_hybrid.core.breakpoints import (
    CacheOptionError,
    CacheOptions,
    effective_breakpoints,
    hit_position,
)
from vllm_hybrid.core.cache_report import ReuseHistory
from vllm_hybrid.core.config import HybridCacheConfig
from vllm_hybrid.core.pins import PinLedger

logger = logging.getLogger("vllm_hybrid")

#: The key of our part of a request's ``kv_transfer_params``.
RESULT_KEY = "vllm_hybrid"


@dataclass
class _Request:
    options: CacheOptions
    error: str | None = None
    vllm_junction: int = 0  # vLLM's shared_prefix_boundary at the lookup
    stops: list[int] = field(default_factory=list)  # pending breakpoint stops (tokens)
    applied: list[int] = field(default_factory=list)  # effective breakpoints
    report: dict[str, Any] | None = None


class CacheControl:
    """Breakpoints, pins and reports of one scheduler; see the module docstring."""

    def __init__(self, scheduler: Any, config: HybridCacheConfig) -> None:
        pool = scheduler.kv_cache_manager.block_pool
        self.scheduler = scheduler
        self.pool = pool
        self.block_tokens = int(scheduler.cache_config.block_size)
        self.hash_tokens = int(pool.hash_block_size)
        self.ledger = PinLedger.for_pool(
            pool.num_gpu_blocks, config.max_pinned_fraction, config.max_pin_ttl_s
        )
        self.history = ReuseHistory(self.block_tokens)
        self.requests: dict[str, _Request] = {}
        self._stopping: set[str] = set()  # ids of requests with breakpoint stops pending
        self.breakpoint_stops = 0  # breakpoints that moved a chunk end (metrics)

    # ------------------------------------------------------------------ lookup and stops
    def _state(self, request: Any) -> _Request | None:
        state = self.requests.get(request.request_id)
        if state is not None:
            return state
        params = request.sampling_params
        extra = getattr(params, "extra_args", None) if params is not None else None
        try:
            options = CacheOptions.from_extra_args(extra)
        except CacheOptionError as error:
            logger.warning("vllm-hybrid: request %s: %s (ignored)", request.request_id, error)
            state = _Request(CacheOptions(), error=str(error))
        else:
            if not options.any:
                return None
            state = _Request(options)
        self.requests[request.request_id] = state
        return state

    def on_lookup(self, request: Any, hit_tokens: int, junction: int) -> int:
        """The ``shared_prefix_boundary`` the request runs with (vLLM's ``junction`` unless it
        has breakpoints past the hit)."""
        state = self._state(request)
        if state is None:
            return junction
        state.vllm_junction = junction
        state.applied = list(
            effective_breakpoints(state.options.breakpoints, request.num_prompt_tokens)
        )
        stops = {p for p in state.applied if hit_position(p, self.block_tokens) > hit_tokens}
        if junction > hit_tokens:
            stops.add(junction)
        state.stops = sorted(stops)
        if state.stops:
            self._stopping.add(request.request_id)
        return state.stops[0] if state.stops else junction

    def vllm_junction(self, request: Any) -> int:
        """vLLM's own junction for a request (what the policy feed reports as cached KV)."""
        state = self.requests.get(request.request_id)
        return state.vllm_junction if state is not None else request.shared_prefix_boundary

    def after_schedule(self, out: Any) -> None:
        requests = self.scheduler.requests
        for new in out.scheduled_new_reqs:
            request = requests.get(new.req_id)
            if request is not None:
                self._started(request, new.num_computed_tokens)
        if not self._stopping:
            return  # the common case: no request has a breakpoint ahead (O(1) per step)
        for req_id in self._stopping.intersection(out.num_scheduled_tokens):
            state = self.requests.get(req_id)
            request = requests.get(req_id)
            if state is None or request is None or not state.stops:
                self._stopping.discard(req_id)
                continue
            done = request.num_computed_tokens  # already advanced by this step (vLLM)
            while state.stops and hit_position(state.stops[0], self.block_tokens) <= done:
                self.breakpoint_stops += state.stops.pop(0) in state.applied
            if state.stops:
                request.shared_prefix_boundary = state.stops[0]
            else:
                self._stopping.discard(req_id)

    def _started(self, request: Any, hit_tokens: int) -> None:
        # Kept by reference (the history is lazy): vLLM never mutates Request.prompt_token_ids
        # (vllm/v1/request.py copies it into _all_token_ids for the outputs).
        tokens = request.prompt_token_ids or []
        state = self.requests.get(request.request_id)
        if state is not None and state.options.report:
            kv = max(hit_tokens, state.vllm_junction)
            state.report = self.history.explain(tokens, request.cache_salt, hit_tokens, kv)
        self.history.record(tokens, request.cache_salt)

    # ------------------------------------------------------------------ finish and pins
    def on_finished(self, request: Any) -> dict[str, Any] | None:
        """Pin if asked; the report and pin outcome for ``kv_transfer_params`` (or None)."""
        state = self.requests.pop(request.request_id, None)
        if state is None:
            return None
        self._stopping.discard(request.request_id)
        result: dict[str, Any] = {}
        if state.error:
            result["error"] = state.error
        if state.options.report and state.report is not None:
            result["cache_report"] = {
                **state.report,
                "breakpoints": state.applied,
                "breakpoint_hit_positions": [
                    hit_position(p, self.block_tokens) for p in state.applied
                ],
            }
        ttl = state.options.pin_ttl_s
        if ttl is not None:
            result["pin"] = self._pin(request, ttl)
        if result:
            logger.info("vllm-hybrid: request %s: %s", request.request_id, json.dumps(result))
        return result or None

    def _pin(self, request: Any, ttl_s: float) -> dict[str, Any]:
        if request.num_computed_tokens < request.num_prompt_tokens:
            self.ledger.refuse()
            return {"pinned": False, "message": "the request finished before its prefill did"}
        coordinator = self.scheduler.kv_cache_manager.coordinator
        # The blocks a later request extending this prompt would hit: vLLM's own lookup.
        groups, hit, _ = coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_prompt_tokens
        )
        pages = [b for blocks in groups for b in blocks if not b.is_null]
        key = request.block_hashes[hit // self.hash_tokens - 1] if hit else None
        decision = self.ledger.check(key, len(pages), ttl_s)
        if not decision.ok:
            self.ledger.refuse()
            return {
                "pinned": False,
                "tokens": hit,
                "pages": len(pages),
                "message": decision.message,
                "pinned_pages": self.ledger.pinned_pages,
                "limit_pages": self.ledger.limit_pages,
            }
        if not decision.extended:
            self.pool.touch(pages)  # one reference each: out of eviction until released
        now = time.monotonic()
        self.ledger.add(key, pages, hit, ttl_s, now)
        pin = self.ledger.pins[key]
        return {
            "pinned": True,
            "tokens": hit,
            "pages": len(pin.pages),
            "extended": decision.extended,
            "expires_in_s": round(pin.expires_at - now, 3),
            "pinned_pages": self.ledger.pinned_pages,
            "limit_pages": self.ledger.limit_pages,
        }

    def expire(self) -> None:
        for pin in self.ledger.expire(time.monotonic()):
            self.pool.free_blocks(pin.pages)

    def release_all(self) -> None:
        for pin in self.ledger.release_all():
            self.pool.free_blocks(pin.pages)

    def totals(self) -> dict[str, float]:
        return {
            **self.ledger.totals(time.monotonic()),
            "breakpoint_stops": self.breakpoint_stops,
        }
