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

from vllm_hybrid.adapters.vllm.version import check_vllm_version
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


def exact_stops(scheduler: Any) -> bool:
    """Turn on sub-block breakpoint states where vLLM can cache them; True if it did.

    vLLM 0.32 caches a Mamba state inside a block only at a prefix-match-unit (``U``)
    boundary, through ``MambaManager._cache_partial_tail_block``
    (``vllm/v1/core/single_type_kv_cache_manager.py``): at the prompt's tail, and, when the
    manager's ``shared_prefix_checkpoint`` is set, at a chunk end equal to the request's
    ``shared_prefix_boundary``. The state block is registered under the partial hash
    (``BlockPool.cache_partial_block``) and copied on write before the next chunk overwrites
    it (``MambaManager.allocate_new_blocks``). vLLM sets that flag only for EAGLE
    (``KVCacheManager.__init__``: ``mamba_shared_prefix_checkpoint``); nothing in the
    manager's path depends on EAGLE, so we set it on each Mamba manager when the scheduler
    takes sub-block hits (``Scheduler.mamba_partial_cache_hit``: align mode, ``U`` below the
    block, partial hash hits on) and no MTP re-prefill tail shifts ``cache_blocks``'s token
    count (``num_reprefillable_tokens``, vLLM's own condition). The scheduler then ends a
    chunk exactly at our stops (``HybridScheduler._mamba_block_aligned_split``); stops are
    ``U``-floored (:meth:`CacheControl.on_lookup`), so the manager always accepts them.
    A junction of vLLM's own that is not ours is still ended block-floored by vLLM, where the
    flag changes nothing (the chunk end equals the junction only on a block boundary, whose
    state vLLM keeps anyway)."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    if not check_vllm_version("sub-block breakpoint states"):
        return False
    coordinator = scheduler.kv_cache_manager.coordinator
    if not getattr(scheduler, "mamba_partial_cache_hit", False):
        return False
    if getattr(coordinator, "num_reprefillable_tokens", 0) != 0:
        return False
    managers = [m for m in coordinator.single_type_managers if isinstance(m, MambaManager)]
    if not managers or not all(hasattr(m, "shared_prefix_checkpoint") for m in managers):
        return False
    # The attention side gets its partial entries from us (CacheControl._add_kv_partials),
    # which is right only for append-only full-attention KV.
    others = [m for m in coordinator.single_type_managers if not isinstance(m, MambaManager)]
    if not others or not all(map(_is_full_attention, others)):
        return False
    for manager in managers:
        manager.shared_prefix_checkpoint = True
    return True


def _is_full_attention(manager: Any) -> bool:
    """vLLM's ``FullAttentionManager`` (by name: the append-only KV our partial entries suit)."""
    return type(manager).__name__ == "FullAttentionManager"


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
        self.history = ReuseHistory(self.block_tokens)
        #: Where breakpoint states can be cached: every ``stop_tokens`` tokens (the prefix match
        #: unit when sub-block stops are available, else the block; see :func:`exact_stops`).
        self.stop_tokens = self.hash_tokens if exact_stops(scheduler) else self.block_tokens
        self.requests: dict[str, _Request] = {}
        self._stopping: set[str] = set()  # ids of requests with breakpoint stops pending
        #: Ids of the requests whose ``shared_prefix_boundary`` is one of our sub-block stops,
        #: to be ended at exactly (``HybridScheduler._mamba_block_aligned_split``, which asks
        #: for every running request at every step): the pending set itself, or empty for good
        #: when stops are block-floored.
        self.exact_stop_ids: set[str] | frozenset[str] = (
            self._stopping if self.stop_tokens < self.block_tokens else frozenset()
        )
        self._kv_partials: list[_KVPartial] = []  # sub-block KV entries to keep registered
        self._kv_managers = list(
            filter(_is_full_attention, scheduler.kv_cache_manager.coordinator.single_type_managers)
        )
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
        unit = self.stop_tokens
        if unit < self.block_tokens:
            # Sub-block stops: the stop is the floored position itself, which the manager
            # compares exactly with the chunk end (see exact_stops); vLLM's junction is floored
            # the same way (it is where a sibling would resume, at this granularity).
            stops = {hit_position(p, unit) for p in state.applied}
            stops.add(hit_position(junction, unit))
            stops = {p for p in stops if p > hit_tokens}
        else:
            stops = {p for p in state.applied if hit_position(p, unit) > hit_tokens}
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
        if self._kv_partials:
            self._keep_kv_partials()
        if not self._stopping:
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
        }


# ---------------------------------------------------------------------------------------------
# End-of-output states (the state a next turn resumes from)
# ---------------------------------------------------------------------------------------------


@dataclass
class _OutputMark:
    """The block-boundary state a decoding request kept last: a tentative end of its output."""

    tokens: int
    pages: list[tuple[Any, Any, Any]]  # (Mamba manager, block, its block_hash when kept)


class OutputStates:
    """Keep the recurrent state at the end of each request's output where the policy says so
    (``core/policy.py::output_state_position``), so that the next turn of a conversation
    (previous prompt + answer + new message) resumes from the end of the answer rather than
    from the previous prompt's end. Written against vLLM 0.32.0, align-mode Mamba caching.

    What vLLM keeps during decode (``vllm/v1/core/single_type_kv_cache_manager.py``): in align
    mode the running state of a request whose computed length is ``n`` lives in its Mamba block
    ``cdiv(n, B) - 1``, advanced in place by every decode step. When decode crosses a block
    boundary ``k*B``, ``MambaManager.allocate_new_blocks`` gives the request block ``k`` and
    records block ``k-1`` (``last_state_block_idx``), whose state the worker copies forward; so
    block ``k-1`` keeps exactly the state at ``k*B``, and ``MambaManager.remove_skipped_blocks``
    frees it a step later. Whether that freed block stays in the prefix cache is decided when
    the step computing token ``k*B - 1`` is scheduled (``KVCacheManager.allocate_slots`` ->
    ``KVCacheCoordinator.cache_blocks`` -> ``SingleTypeKVCacheManager.cache_blocks``): its hash
    is registered only where ``MambaManager.reachable_block_mask`` says so: every block with no
    retention interval (dense), the interval's multiples, and the ``replay_boundaries``
    (``num_prompt_tokens - 1``) and ``shared_prefix_boundary`` positions. With the default
    interval 0 no decode boundary is among them, so the state is freed unhashed: a next turn
    resumes from the previous prompt's end. Attention KV blocks are all hashed (dense).

    What this does:

    * block boundaries (every ``B``): :meth:`_cache_boundary`, behind a wrapper of the
      coordinator's ``cache_blocks`` (on the instance). At the step that completes block ``k-1``
      past the prompt, it asks the policy whether the end of the output would be kept there; if
      so it runs vLLM's ``KVCacheCoordinator.cache_blocks`` with ``k*B`` added to the replay
      boundaries, so ``reachable_block_mask`` keeps that block's state as it keeps a prompt
      end's. The boundary kept before is dropped (it is no longer the end; unless a retention
      interval keeps it or another request holds it). At finish the last one stays: the
      block-floor of the request's computed tokens.
    * with ``U`` below the block (sub-block hits on, see :func:`exact_stops`):
      :meth:`on_finished` registers the state at exactly the computed length ``E`` when ``E``
      is a multiple of ``U`` (always at ``U = 1``): the running Mamba block of each group holds
      the state at ``E`` once the last step ran, and the request is finishing, so no copy is
      needed; it gets a partial prefix-cache key at ``E`` (``BlockPool.cache_partial_block``,
      as vLLM's ``MambaManager._cache_partial_tail_block`` does for prompt tails), and so does
      the attention block holding token ``E - 1``. The block-boundary state below it is then
      dropped. Where ``E`` is not a multiple of ``U`` the state at ``floor(E / U) * U`` was
      overwritten in place by decode; the block-boundary state stays.
    """

    def __init__(self, scheduler: Any, policy: Any, sub_block: bool) -> None:
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager

        manager = scheduler.kv_cache_manager
        self.policy = policy
        self.pool = manager.block_pool
        self.coordinator = manager.coordinator
        self.block_tokens = int(scheduler.cache_config.block_size)
        self.unit_tokens = int(self.pool.hash_block_size)
        managers = self.coordinator.single_type_managers
        self.mamba = [m for m in managers if isinstance(m, MambaManager)]
        self.kv = list(filter(_is_full_attention, managers))
        self.sub_block = sub_block and self.unit_tokens < self.block_tokens
        self.marks: dict[str, _OutputMark] = {}
        self.kept_boundaries = 0  # block-boundary output states kept (tentatively)
        self.kept_exact = 0  # sub-block end states registered at finish
        self.dropped = 0  # superseded boundary states dropped
        #: (group id, manager) of the groups that cache, as ``cache_blocks`` visits them
        self._caching = [
            (group_id, manager)
            for group_id, manager in enumerate(managers)
            if manager.enable_caching
        ]
        coordinator, caching = self.coordinator, self._caching
        cacheable = coordinator.get_num_cacheable_tokens
        block, boundary = self.block_tokens, self._cache_boundary

        def cache_blocks(request: Any, num_computed_tokens: int) -> None:
            # vLLM calls this for every scheduled request at every step (256 calls a step at
            # 256 running). Except at a block boundary past the prompt (_cache_boundary) it
            # does what KVCacheCoordinator.cache_blocks does, here rather than by calling it:
            # one Python frame per call fewer. replay_boundaries is (num_prompt_tokens - 1,)
            # without EAGLE, which install() refuses (tests/adapters/test_output_states_unit).
            prompt = request.num_prompt_tokens
            if num_computed_tokens % block or num_computed_tokens <= prompt:
                boundaries = (prompt - 1,)
                interval = coordinator.retention_interval
                for group_id, manager in caching:
                    manager.cache_blocks(
                        request,
                        cacheable(num_computed_tokens, group_id),
                        retention_interval=interval,
                        replay_boundaries=boundaries,
                    )
            else:
                boundary(request, num_computed_tokens)

        coordinator.cache_blocks = cache_blocks  # instance attribute: one per engine

    @classmethod
    def install(cls, scheduler: Any, policy: Any, sub_block: bool) -> OutputStates | None:
        """Install on ``scheduler`` where vLLM's decode state layout is the one described in
        the class docstring: vLLM 0.32.0, every Mamba group in align mode, full-attention
        groups otherwise, no speculative decoding (no EAGLE groups, draft or MTP tokens)."""
        if not check_vllm_version("end-of-output states"):
            return None
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager

        coordinator = scheduler.kv_cache_manager.coordinator
        managers = coordinator.single_type_managers
        mamba = [m for m in managers if isinstance(m, MambaManager)]
        if not mamba or any(getattr(m, "mamba_cache_mode", None) != "align" for m in mamba):
            return None
        if any(not isinstance(m, MambaManager) and not _is_full_attention(m) for m in managers):
            return None
        if (
            getattr(coordinator, "eagle_group_ids", None)
            or getattr(coordinator, "num_reprefillable_tokens", 0)
            or getattr(scheduler, "num_spec_tokens", 0)
            or any(getattr(m, "num_speculative_blocks", 0) for m in mamba)
        ):
            return None
        return cls(scheduler, policy, sub_block)

    # ------------------------------------------------------------------ block boundaries
    def _cache_boundary(self, request: Any, n: int) -> None:
        """``KVCacheCoordinator.cache_blocks`` (``vllm/v1/core/kv_cache_coordinator.py``) at a
        block boundary ``n`` past the prompt (the wrapper installed in ``__init__`` sends only
        those here), with ``n`` among the reachable boundaries when the policy keeps it."""
        if request.num_computed_tokens >= n or not self._keeps(request, n):
            self._cache_blocks_with(request, n)
        else:
            self._cache_blocks_with(request, n, n)
            self._mark(request, n)

    def _keeps(self, request: Any, tokens: int) -> bool:
        from vllm_hybrid.core.policy import output_state_position

        return (
            output_state_position(
                self.policy,
                request.num_prompt_tokens,
                tokens,
                self.block_tokens,
                self.unit_tokens,
                hit_tokens=max(int(getattr(request, "num_cached_tokens", 0) or 0), 0),
            )
            == tokens
        )

    def _cache_blocks_with(self, request: Any, n: int, *extra: int) -> None:
        """vLLM 0.32.0's ``KVCacheCoordinator.cache_blocks`` with the ``extra`` boundaries (no
        EAGLE: its ``replay_boundaries`` is the prompt's last token). The wrapper installed in
        ``__init__`` repeats this loop inline for its hot path (no extra boundary)."""
        c = self.coordinator
        boundaries = (request.num_prompt_tokens - 1, *extra)
        for group_id, manager in self._caching:
            manager.cache_blocks(
                request,
                c.get_num_cacheable_tokens(n, group_id),
                retention_interval=c.retention_interval,
                replay_boundaries=boundaries,
            )

    def _mark(self, request: Any, tokens: int) -> None:
        index = tokens // self.block_tokens - 1
        pages = []
        for manager in self.mamba:
            blocks = manager.req_to_blocks.get(request.request_id) or ()
            if index < len(blocks) and not blocks[index].is_null:
                block = blocks[index]
                if block.block_hash is not None:
                    pages.append((manager, block, block.block_hash))
        if not pages:
            return
        previous = self.marks.get(request.request_id)
        self.marks[request.request_id] = _OutputMark(tokens, pages)
        self.kept_boundaries += 1
        if previous is not None:
            self._drop(request.request_id, previous)

    def _retained_anyway(self, tokens: int) -> bool:
        """Kept by vLLM's retention interval (``reachable_block_mask``): dense or a multiple."""
        interval = self.coordinator.retention_interval
        return interval is None or (interval > 0 and tokens % interval == 0)

    def _drop(self, request_id: str, mark: _OutputMark) -> None:
        """Forget a superseded end state (``BlockPool._maybe_evict_cached_block``, as vLLM's
        ``MambaManager._cache_partial_tail_block`` does for a transient checkpoint), unless
        vLLM's interval keeps it, its block was reused, or another request holds it."""
        if self._retained_anyway(mark.tokens):
            return
        dropped = False
        for manager, block, key in mark.pages:
            if block.block_hash != key:
                continue  # evicted (and maybe reused) since
            own = manager.req_to_blocks.get(request_id) or ()
            if block.ref_cnt == 0 or (block.ref_cnt == 1 and any(b is block for b in own)):
                dropped |= bool(self.pool._maybe_evict_cached_block(block))
        self.dropped += dropped

    def _key_partial(self, request: Any, manager: Any, block: Any, end: int) -> None:
        """Key ``block`` at ``end`` (``BlockPool.cache_partial_block``), keeping its shorter
        keys: vLLM drops every key of a block whose primary key is shorter than the new one
        (an attention block holding the prompt's tail or a breakpoint stop as well as the end
        of the answer), so those found among the request's own keys are registered again,
        after the longer one (as secondary keys they stay)."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        group = manager.kv_cache_group_id
        held = set(self.pool.cached_block_hashes_by_block.get(block.block_id, ()))
        if block.block_hash is not None:
            held.add(block.block_hash)
        unit, hashes = self.unit_tokens, request.block_hashes
        start = (end - 1) // self.block_tokens * self.block_tokens
        earlier = [
            t
            for t in range(start + unit, end, unit)
            if held and make_block_hash_with_group_id(hashes[t // unit - 1], group) in held
        ]
        for tokens in (end, *earlier):
            self.pool.cache_partial_block(
                request=request,
                block=block,
                num_tokens=tokens,
                kv_cache_group_id=group,
                block_size=self.block_tokens,
            )

    def totals(self) -> dict[str, float]:
        """Counters for ``/metrics`` (``core/cache_stats.py``)."""
        return {
            "output_states_kept": self.kept_boundaries + self.kept_exact,
            "output_states_dropped": self.dropped,
        }

    # ------------------------------------------------------------------ finish
    def on_finished(self, request: Any) -> None:
        """Called from ``Scheduler._free_request`` before vLLM frees the request's blocks."""
        mark = self.marks.pop(request.request_id, None)
        if not self.sub_block or int(getattr(request, "num_in_flight_tokens", 0) or 0):
            return
        end = int(request.num_computed_tokens)
        b = self.block_tokens
        if end <= request.num_prompt_tokens or end % b == 0 or end % self.unit_tokens:
            return
        if not self._keeps(request, end):
            return
        index = (end - 1) // b  # the running state block, and the KV block holding end - 1
        pages = []
        for state, groups in ((True, self.mamba), (False, self.kv)):
            for manager in groups:
                blocks = manager.req_to_blocks.get(request.request_id) or ()
                if index >= len(blocks) or blocks[index].is_null:
                    return
                if state and blocks[index].block_hash is not None:
                    return  # not an unkeyed running state block (never so in align mode)
                pages.append((manager, blocks[index]))
        if len(request.block_hashes) * self.unit_tokens < end:
            return
        for manager, block in pages:
            self._key_partial(request, manager, block, end)
        self.kept_exact += 1
        if mark is not None:
            self._drop(request.request_id, mark)
