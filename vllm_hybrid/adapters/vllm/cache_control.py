"""Per-request cache control inside vLLM's engine core: breakpoints, pins, cache reports.

Written against vLLM 0.32.0. The scheduler (``scheduler.py``; the plugin picks it for
attention + Mamba hybrids only) owns one :class:`CacheControl` when prefix caching is on, and
calls it from four places (vLLM's private methods through ``compat.SchedulerHooks``):

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

Cache reports compare a prompt with the prompts seen before (``core/cache_report.py``,
``ReuseHistory``); that history exists only once a request asks for a report (the first
reported request compares with nothing before it, later ones with the prompts started since,
as far back as the history's bounds reach), so an engine whose requests never ask keeps no
prompt at all.

Pins hold one extra reference on each block through ``BlockPool.touch`` (``block_pool.py``), as
a prefix hit does, so neither vLLM's LRU nor our policy can evict them; ``free_blocks`` gives
it back. Logic and limits live in ``core/`` (``breakpoints.py``, ``pins.py``,
``cache_report.py``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_hybrid.adapters.vllm.compat.scheduler import enable_exact_stops, skip_split_hook
from vllm_hybrid.adapters.vllm.config import is_full_attention
from vllm_hybrid.core import (
    CacheOptionError,
    CacheOptions,
    HybridCacheConfig,
    PinLedger,
    ReuseHistory,
    effective_breakpoints,
    exact_junction_stop,
    hit_position,
    optional_snapshots_fit,
    prompt_end_stop,
    prompt_floor_stop,
)

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


@dataclass
class _KVPartial:
    """A sub-block stop's partial KV entry (:meth:`CacheControl._add_kv_partials`)."""

    request: Any
    manager: Any  # vLLM's FullAttentionManager of the group
    block: Any
    tokens: int
    seen: int | None  # the block's block_hash_num_tokens when last (re-)registered


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
        #: Prompts seen, for the reports: created by the first request that asks for one.
        self.history: ReuseHistory | None = None
        #: Where breakpoint states can be cached: every ``stop_tokens`` tokens (the prefix match
        #: unit when sub-block stops are available, else the block; see
        #: ``compat.enable_exact_stops``).
        self.stop_tokens = self.hash_tokens if enable_exact_stops(scheduler) else self.block_tokens
        self.requests: dict[str, _Request] = {}
        self._stopping: set[str] = set()  # ids of requests with breakpoint stops pending
        #: Whether vLLM's chunk split goes through our hook (``compat.SchedulerHooks``): only
        #: while a sub-block stop is pending, since vLLM asks for every running request at
        #: every step. The scheduler starts with vLLM's split bound (``skip_split_hook``).
        self._split_hooked = False
        #: Where the core is in charge (never under ``policy: stock``, which stays vLLM's) and
        #: hits land below the block, the scheduler sets this to the pool's
        #: ``hy_exact_junction``: requests then also end a chunk, and keep a state, at their
        #: exact junction (``core.exact_junction_stop``) and at their prompt's last block
        #: boundary (``core.prompt_floor_stop``).
        self.exact_junction: Callable[[Any, int], int] | None = None
        #: With ``sibling_wait`` on (the scheduler sets it): the stops where a request should
        #: keep a state for waiting requests that share its prompt further than its hit
        #: (``HybridScheduler._hy_sibling_stops``), given the request and its hit.
        self.sibling_stops: Callable[[Any, int], list[int]] | None = None
        #: Ids of the requests whose ``shared_prefix_boundary`` is one of our sub-block stops,
        #: to be ended at exactly (``compat.SchedulerHooks``, on vLLM's chunk split, which asks
        #: for every running request at every step): the pending set itself, or empty for good
        #: when stops are block-floored.
        self.exact_stop_ids: set[str] | frozenset[str] = (
            self._stopping if self.stop_tokens < self.block_tokens else frozenset()
        )
        self._kv_partials: list[_KVPartial] = []  # sub-block KV entries to keep registered
        self._kv_managers = list(
            filter(is_full_attention, scheduler.kv_cache_manager.coordinator.single_type_managers)
        )
        self.breakpoint_stops = 0  # breakpoints that moved a chunk end (metrics)
        self.sibling_waits = 0  # scheduler steps a waiting request waited for a sibling
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        self._state_groups = len(managers) - len(self._kv_managers)
        self._pool_pages = int(pool.num_gpu_blocks)

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
            if options.report and self.history is None:
                self.history = ReuseHistory(self.block_tokens)
        self.requests[request.request_id] = state
        return state

    def on_lookup(self, request: Any, hit_tokens: int, junction: int) -> int:
        """The ``shared_prefix_boundary`` the request runs with (vLLM's ``junction`` unless it
        has breakpoints past the hit)."""
        state = self._state(request)
        floor = exact = end = 0
        if (
            self.exact_junction is not None
            and self.stop_tokens < self.block_tokens
            and optional_snapshots_fit(
                request.num_prompt_tokens,
                self.block_tokens,
                len(self._kv_managers),
                self._state_groups,
                self._pool_pages,
            )
        ):
            floor = prompt_floor_stop(
                request.num_prompt_tokens, hit_tokens, self.block_tokens, self.stop_tokens
            )
            exact = exact_junction_stop(
                hit_tokens,
                self.exact_junction(request, max(hit_tokens, junction)),
                hit_position(junction, self.stop_tokens),
            )
            # Where the prompt's last chunk runs past vLLM's tail checkpoint to the prompt's
            # end (the scheduler's drops_prompt_tail_stop), the state is kept there instead,
            # for a next turn that shares the prompt but not the answer as generated.
            if self.scheduler.drops_prompt_tail_stop(request):
                end = prompt_end_stop(
                    request.num_prompt_tokens, hit_tokens, self.block_tokens, self.stop_tokens
                )
        siblings = self.sibling_stops(request, hit_tokens) if self.sibling_stops else []
        if state is None:
            if not floor and not exact and not end and not siblings:
                return junction
            state = self.requests[request.request_id] = _Request(CacheOptions())
        state.vllm_junction = junction
        state.applied = list(
            effective_breakpoints(state.options.breakpoints, request.num_prompt_tokens)
        )
        unit = self.stop_tokens
        if unit < self.block_tokens:
            # Sub-block stops: the stop is the floored position itself, which the manager
            # compares exactly with the chunk end (compat.enable_exact_stops); vLLM's junction
            # is floored the same way (it is where a sibling would resume, at this granularity).
            stops = {hit_position(p, unit) for p in state.applied}
            stops.add(hit_position(junction, unit))
            if floor:
                stops.add(floor)  # the prompt's last block boundary (prompt_floor_stop)
            if exact:
                stops.add(exact)  # where it diverges inside a block (exact_junction_stop)
            if end:
                stops.add(end)  # the prompt's own end (prompt_end_stop)
            stops.update(siblings)  # where a waiting sibling diverges (core.sibling_stop)
            stops = {p for p in stops if p > hit_tokens}
        else:
            stops = {p for p in state.applied if hit_position(p, unit) > hit_tokens}
            stops.update(p for p in siblings if p > hit_tokens)
            if junction > hit_tokens:
                stops.add(junction)
        state.stops = sorted(stops)
        if state.stops:
            self._stopping.add(request.request_id)
            if self.exact_stop_ids and not self._split_hooked:
                self._hook_splits(True)  # this step's split of the request comes next
        return state.stops[0] if state.stops else junction

    def add_stop(self, request: Any, stop: int) -> None:
        """End a running request's prefill chunk at ``stop`` (tokens, a multiple of
        :attr:`stop_tokens`) and keep its state there, as a breakpoint's: a waiting sibling
        resumes from it (``HybridScheduler.holds_back``). A pending junction of vLLM's stays a
        stop of its own."""
        state = self.requests.get(request.request_id)
        if state is None:
            state = self.requests[request.request_id] = _Request(CacheOptions())
            state.vllm_junction = request.shared_prefix_boundary
        pending = request.shared_prefix_boundary
        stops = set(state.stops) | {stop}
        if pending > request.num_computed_tokens:
            stops.add(pending)
        state.stops = sorted(p for p in stops if p > request.num_computed_tokens)
        request.shared_prefix_boundary = state.stops[0]
        self._stopping.add(request.request_id)
        if self.exact_stop_ids and not self._split_hooked:
            self._hook_splits(True)

    def pins_prompt_end(self, request: Any) -> bool:
        """Whether ``request`` asks for a pin (``cache_pin_ttl_s``): what it pins is its
        prompt's end state (the prewarm's prompt is the prefix plus one token,
        ``core/breakpoints.py::prewarm_prompt``), so vLLM's tail stop stays for it."""
        state = self.requests.get(request.request_id)
        return state is not None and state.options.pin_ttl_s is not None

    def _hook_splits(self, on: bool) -> None:
        skip_split_hook(self.scheduler, skip=not on)
        self._split_hooked = on

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
        if self._kv_partials:
            self._keep_kv_partials()
        if not self._stopping:
            if self._split_hooked:
                self._hook_splits(False)
            return  # the common case: no request has a breakpoint ahead (O(1) per step)
        for req_id in self._stopping.intersection(out.num_scheduled_tokens):
            state = self.requests.get(req_id)
            request = requests.get(req_id)
            if state is None or request is None or not state.stops:
                self._stopping.discard(req_id)
                continue
            done = request.num_computed_tokens  # already advanced by this step (vLLM)
            unit = self.stop_tokens
            while state.stops and hit_position(state.stops[0], unit) <= done:
                stop = state.stops.pop(0)
                if unit < self.block_tokens and stop % self.block_tokens:
                    self._add_kv_partials(request, stop)
                self.breakpoint_stops += stop in state.applied or (
                    unit < self.block_tokens
                    and any(hit_position(p, unit) == stop for p in state.applied)
                )
            if state.stops:
                request.shared_prefix_boundary = state.stops[0]
            else:
                self._stopping.discard(req_id)
        if not self._stopping:
            self._hook_splits(False)

    def _add_kv_partials(self, request: Any, stop: int) -> None:
        """Make the attention KV before a sub-block stop reachable, as vLLM does for a prompt
        tail (``FullAttentionManager._cache_partial_tail_block``): a partial prefix-cache
        entry at ``stop`` on the KV block holding it (``BlockPool.cache_partial_block``).
        Attention KV is append-only, so the producer keeps writing into that block and a
        consumer's hit takes a private copy (vLLM's partial-hit CoW). Called once the chunk
        ending at ``stop`` is scheduled (its Mamba state is registered in the same step)."""
        index = stop // self.block_tokens
        for manager in self._kv_managers:
            blocks = manager.req_to_blocks.get(request.request_id) or []
            if index < len(blocks) and not blocks[index].is_null:
                entry = _KVPartial(request, manager, blocks[index], stop, None)
                self._kv_partials.append(entry)
        self._keep_kv_partials()

    def before_lookup(self) -> None:
        """Before a waiting request's prefix lookup: the running requests were allocated first
        this step, and one that filled the block of a pending KV partial entry dropped it
        (``BlockPool.cache_full_blocks``); registered again now, a sibling that resumes there
        finds it in this step, not the next."""
        if self._kv_partials:
            self._keep_kv_partials()

    def _keep_kv_partials(self) -> None:
        """(Re-)register each pending KV partial entry whose block's hashes changed: vLLM drops
        every partial entry of a block when it registers a longer one (the prompt tail's) or
        promotes it to a full block (``BlockPool.cache_full_blocks``, ``cache_partial_block``).
        The block is the running request's own, so it holds the prefix's KV; once it is full
        the entry stays (a secondary hash) until the block is evicted."""
        keep = []
        for entry in self._kv_partials:
            request_id = entry.request.request_id
            blocks = entry.manager.req_to_blocks.get(request_id) or ()
            index = entry.tokens // self.block_tokens
            if index >= len(blocks) or blocks[index] is not entry.block:
                continue  # finished or preempted: the block may be reused; what is kept stays
            block = entry.block
            seen = block.block_hash_num_tokens
            if seen != entry.seen:
                self.pool.cache_partial_block(
                    request=entry.request,
                    block=block,
                    num_tokens=entry.tokens,
                    kv_cache_group_id=entry.manager.kv_cache_group_id,
                    block_size=self.block_tokens,
                )
                entry.seen = block.block_hash_num_tokens
            full = (entry.tokens // self.block_tokens + 1) * self.block_tokens
            if seen != full:
                keep.append(entry)
        self._kv_partials = keep

    def _started(self, request: Any, hit_tokens: int) -> None:
        history = self.history
        if history is None:
            return  # no request asked for a report yet: nothing to explain, nothing kept
        # Kept by reference (the history is lazy): vLLM never mutates Request.prompt_token_ids
        # (vllm/v1/request.py copies it into _all_token_ids for the outputs).
        tokens = request.prompt_token_ids or []
        state = self.requests.get(request.request_id)
        if state is not None and state.options.report:
            kv = max(hit_tokens, state.vllm_junction)
            state.report = history.explain(tokens, request.cache_salt, hit_tokens, kv)
        history.record(tokens, request.cache_salt)

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
                    hit_position(p, self.stop_tokens) for p in state.applied
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
            "sibling_waits": self.sibling_waits,
        }
