"""Scheduler subclasses that put the core in charge of vLLM's prefix cache for hybrid models.

The plugin picks them per engine (``plugin.py`` installs :func:`choose_scheduler` through
``compat.install_scheduler_selector``): when ``EngineCore.__init__``
(``vllm/v1/engine/core.py``) builds the scheduler, with the KV cache config known, an engine
gets :class:`HybridScheduler` (:class:`HybridAsyncScheduler` where vLLM runs its
``AsyncScheduler``) only if prefix caching is on and its KV cache groups are full attention
and Mamba, nothing else; any other engine gets vLLM's own class, with none of our code in its
steps. Explicitly (vLLM 0.32.0)::

    LLM(model, enable_prefix_caching=True,
        scheduler_cls="vllm_hybrid.adapters.vllm.scheduler.HybridScheduler")
    vllm serve MODEL --enable-prefix-caching \\
        --scheduler-cls vllm_hybrid.adapters.vllm.scheduler.HybridScheduler

After ``Scheduler.__init__`` (``vllm/v1/core/sched/scheduler.py``, which builds
``KVCacheManager`` -> coordinator -> one shared ``BlockPool``) they activate only when prefix
caching is on, the KV cache config has a ``MambaSpec`` group next to full-attention groups,
all of one block size, the settings' policy is not ``stock`` and vLLM is the pinned version;
otherwise the cache stays vLLM's. Activation (:func:`activate`):

* eviction: swaps the pool's class to
  :class:`~vllm_hybrid.adapters.vllm.block_pool.HybridBlockPool` (the policy picks victims);
  its state is one :class:`~vllm_hybrid.adapters.vllm.state.HybridState` (``pool.hybrid``);
* admission (only when ``snapshot_every`` is not ``engine``): sets the coordinator's snapshot
  retention interval (``compat.set_retention_interval``), e.g. to the policy's periodic
  interval; prompt ends and shared-prefix junctions are always kept, at their hash-block
  positions, by vLLM's prefill checkpoint;
* learning: every request, when first scheduled, is fed to the policy (``core/feed.py``);
* lookahead: the waiting requests' block hashes (``Request.block_hashes``, known from arrival)
  are the mirror's ``lookahead``, so what a waiting request would hit goes last
  (``PrefixIndex.wanted_keys``, walked once per ``schedule()``; eviction order only).

Independently of the policy, per-request cache control: explicit breakpoints, pins with a TTL
and cache reports (``cache_control.py``), through the hooks of ``compat.SchedulerHooks`` (on
vLLM's ``_get_local_prefix_cache_hit``, ``_mamba_block_aligned_split`` and ``_free_request``)
and the public ``schedule``, ``reset_prefix_cache`` and ``make_stats``; see docs/serving.md.

Settings: ``additional_config={"vllm_hybrid": {...}}`` or environment, see ``config.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from vllm_hybrid.adapters.vllm.block_pool import HybridBlockPool, install
from vllm_hybrid.adapters.vllm.cache_control import RESULT_KEY, CacheControl
from vllm_hybrid.adapters.vllm.compat.scheduler import (
    SchedulerHooks,
    keep_mid_block_mamba_states_unhashed,
    set_retention_interval,
    skip_split_hook,
)
from vllm_hybrid.adapters.vllm.config import (
    engine_cost_model,
    hybrid_groups,
    is_attention_mamba_hybrid,
    load_config,
)
from vllm_hybrid.adapters.vllm.logs import share_vllm_logging
from vllm_hybrid.adapters.vllm.metrics import FIELD, attach_hybrid_stats, block_bytes
from vllm_hybrid.adapters.vllm.output_states import OutputStates
from vllm_hybrid.adapters.vllm.version import check_vllm_version
from vllm_hybrid.core import (
    POLICIES,
    CostModel,
    HybridCacheConfig,
    PrefixIndex,
    RequestFeed,
    Sibling,
    SiblingWaits,
    periodic_interval,
)

logger = logging.getLogger("vllm_hybrid")


def wants_hybrid_scheduler(vllm_config: Any, kv_cache_config: Any) -> bool:
    """Whether our scheduler can do anything for an engine: prefix caching on and KV cache
    groups of full attention and Mamba only (``config.is_attention_mamba_hybrid``)."""
    caching = bool(vllm_config.cache_config.enable_prefix_caching)
    return caching and is_attention_mamba_hybrid(kv_cache_config)


def choose_scheduler(default: type, vllm_config: Any, kv_cache_config: Any) -> type:
    """The scheduler class of one engine (``compat.install_scheduler_selector``): ours where
    :func:`wants_hybrid_scheduler`, of the kind of ``default`` (vLLM's ``Scheduler`` or
    ``AsyncScheduler``); else ``default`` itself. Bad settings raise ConfigError for any model
    (read once, here; nothing runs per step)."""
    load_config(vllm_config)
    if not wants_hybrid_scheduler(vllm_config, kv_cache_config):
        logger.info("vllm-hybrid: not an attention + Mamba hybrid with prefix caching: inactive")
        return default
    return HybridAsyncScheduler if issubclass(default, AsyncScheduler) else HybridScheduler


def activate(scheduler: Any) -> HybridBlockPool | None:
    """Put the core in charge of ``scheduler``'s prefix cache if the model and settings call
    for it; returns the hybrid pool, or None (the cache stays vLLM's). Bad settings raise
    :class:`~vllm_hybrid.core.config.ConfigError` even where the cache would stay vLLM's."""
    share_vllm_logging()
    config = load_config(scheduler.vllm_config)
    if not scheduler.cache_config.enable_prefix_caching:
        return None
    manager = getattr(scheduler, "kv_cache_manager", None)
    if manager is not None:  # a vLLM fix, for every policy: docs/reliability.md
        keep_mid_block_mamba_states_unhashed(manager.coordinator)
    if not config.enabled:
        return None
    groups = hybrid_groups(scheduler.kv_cache_config)
    if groups is None or not groups[0] or not groups[1]:
        return None  # not a (full attention + Mamba) hybrid: stock path
    kv, state, sizes = groups
    manager = scheduler.kv_cache_manager
    pool, coordinator = manager.block_pool, manager.coordinator
    if len(sizes) != 1 or any(m.block_pool is not pool for m in coordinator.single_type_managers):
        logger.warning("vllm-hybrid: mixed block sizes or pools; the cache stays vLLM's")
        return None
    if not check_vllm_version("the hybrid block pool"):
        return None
    block_tokens = sizes.pop()
    cost = engine_cost_model(
        config, scheduler.vllm_config, scheduler.kv_cache_config, block_tokens, kv, state
    )
    mirror = _mirror(config, cost, pool.num_gpu_blocks, block_tokens, kv, state)
    if config.snapshot_every != "engine":
        _periodic_snapshots(scheduler, config, mirror, block_tokens)
    hybrid = install(pool, mirror)
    hybrid.hybrid.block_bytes = block_bytes(scheduler.kv_cache_config)
    hybrid.hybrid.feed = RequestFeed(mirror.policy, cost, pool.hash_block_size)
    hybrid.hybrid.debug = config.debug
    if config.host_tier_bytes > 0:
        from vllm_hybrid.adapters.vllm.host_connector import attach_host_tier

        attach_host_tier(scheduler, hybrid, config)
    logger.info(
        "vllm-hybrid: %s policy on %d blocks of %d tokens (attention groups %s, Mamba %s), "
        "periodic snapshots: %s",
        mirror.policy.name,
        pool.num_gpu_blocks,
        block_tokens,
        kv,
        state,
        coordinator.retention_interval,
    )
    return hybrid


def _periodic_snapshots(
    scheduler: Any, config: HybridCacheConfig, mirror: PrefixIndex, block_tokens: int
) -> None:
    """The retention interval ``snapshot_every`` asks for (``auto``: the policy's)."""
    interval = periodic_interval(
        config.snapshot_every, getattr(mirror.policy, "interval_tokens", None), block_tokens
    )
    # None is vLLM's "dense" (a state at every block); 0 keeps prompt ends and junctions.
    set_retention_interval(scheduler, None if interval == block_tokens else interval)


def _mirror(
    config: HybridCacheConfig,
    cost: CostModel,
    pool_pages: int,
    block_tokens: int,
    kv: list[int],
    state: list[int],
) -> PrefixIndex:
    """The core's index of the pool, with the configured policy and snapshot budget."""
    mirror = PrefixIndex(
        block_tokens=block_tokens,
        kv_groups=kv,
        state_groups=state,
        policy=POLICIES[config.policy](cost),
        kv_bytes_per_token=cost.kv_bytes_per_token,  # nodes' KV bytes, as the policy counts them
    )
    mirror.snapshot_budget_pages = config.snapshot_budget_pages(pool_pages)
    too_small = config.snapshot_budget_warning(pool_pages, len(state))
    if too_small:
        logger.warning("vllm-hybrid: %s", too_small)
    return mirror


def cache_control(scheduler: Any) -> CacheControl | None:
    """Breakpoints, pins and reports for ``scheduler`` when prefix caching is on, else None."""
    if not scheduler.cache_config.enable_prefix_caching:
        return None
    return CacheControl(scheduler, load_config(scheduler.vllm_config))


class _HybridMixin(SchedulerHooks):
    """Shared by both schedulers (put first in the bases, so ``super()`` reaches vLLM's class):
    activation, feeding started requests to the policy, per-request cache control, stats, and
    the debug checks. vLLM's private methods are reached through the hooks of
    ``compat.SchedulerHooks`` only."""

    hybrid_pool: HybridBlockPool | None
    hy_control: CacheControl | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hybrid_pool = activate(self) if self.hooks_active else None
        self.hy_control = cache_control(self) if self.hooks_active else None
        #: End-of-output states (``output_states.OutputStates``): only with the core in charge
        #: (never under ``policy: stock``, where vLLM's cache stays untouched).
        self.hy_output: OutputStates | None = None
        control = self.hy_control
        if self.hybrid_pool is not None:
            state = self.hybrid_pool.hybrid
            state.mirror.lookahead = self._hy_waiting_paths
            sub_block = control is not None and control.stop_tokens < control.block_tokens
            self.hy_output = OutputStates.install(self, state.mirror.policy, sub_block=sub_block)
            state.extra_totals = [x.totals for x in (control, self.hy_output) if x is not None]
            if control is not None:
                control.exact_junction = self.hybrid_pool.hy_exact_junction
        #: Waiting requests that wait for a running sibling's state (core/siblings.py): only
        #: with the core in charge and ``sibling_wait`` on.
        self.hy_siblings: SiblingWaits | None = None
        if (
            control is not None
            and self.hybrid_pool is not None
            and load_config(self.vllm_config).sibling_wait  # type: ignore[attr-defined]
        ):
            self.hy_siblings = SiblingWaits(
                control.hash_tokens, control.stop_tokens, control.block_tokens
            )
            control.sibling_stops = self._hy_sibling_stops
        # With exact_prompt_end off, at a one-token match unit (auto's), a prompt whose last
        # chunk starts in its last block ends its prefill at the prompt's end, not one token
        # short of it (compat's extend_past_prompt_tail), and keeps a state there instead
        # (CacheControl.on_lookup, core.prompt_end_stop).
        self.split_hook_always = (
            self.hybrid_pool is not None
            and bool(getattr(self, "mamba_partial_cache_hit", False))
            and getattr(self, "hash_block_size", None) == 1
            and not load_config(self.vllm_config).exact_prompt_end  # type: ignore[attr-defined]
        )
        # vLLM's split itself, bound on the instance, so the hook costs nothing while no
        # sub-block stop is pending (vLLM calls it for every running request at every step;
        # ~1.5% of a 256-request step in bench_scheduler.py); the cache control puts the hook
        # back while one is (CacheControl._hook_splits).
        skip_split_hook(self)
        self.hybrid_checks = 0

    def _hy_waiting_paths(self) -> Iterator[Sequence[Any]]:
        """The mirror's lookahead: each waiting request's keys (``Request.block_hashes`` at
        full-block ends) up to the last block a hit may end on (vLLM leaves the last token to
        compute: ``find_longest_cache_hit`` looks up ``num_tokens - 1`` tokens)."""
        pool = self.hybrid_pool
        assert pool is not None
        block_tokens = pool.hybrid.mirror.block_tokens
        step = block_tokens // pool.hash_block_size
        for request in self.waiting:  # type: ignore[attr-defined]
            n = (request.num_tokens - 1) // block_tokens * step
            yield request.block_hashes[step - 1 : n : step]

    # ------------------------------------------------------------------ compat's hooks
    def before_prefix_lookup(self, request: Any) -> None:
        """The request's index (the policy's clock and ``Node.origin`` of what it caches) at
        its first lookup, before ``allocate_slots`` touches its hit and caches the blocks it
        is about to compute (``KVCacheManager.allocate_slots`` caches them at scheduling time,
        so an index given when the step's output is fed would come too late for them, as the
        simulator's request index does not). With the host tier on, promote a host snapshot
        the request can resume from."""
        pool = self.hybrid_pool
        if pool is None:
            return
        if self.hy_control is not None:
            self.hy_control.before_lookup()
        state = pool.hybrid
        if request.request_id not in state.origin:
            state.origin[request.request_id] = state.mirror.tick()
        if state.host is not None:
            if self.kv_cache_manager.prefix_cache_lookup_enabled(request):  # type: ignore[attr-defined]
                pool.hy_promote(request)

    def after_prefix_lookup(self, request: Any, hit_tokens: int, junction: int) -> int:
        """The request's breakpoints become its ``shared_prefix_boundary``. A request with
        prompt left to compute becomes a producer its waiting siblings may wait for."""
        control = self.hy_control
        if self.hy_siblings is not None and hit_tokens < request.num_prompt_tokens:
            self.hy_siblings.producers[request.request_id] = request
        return junction if control is None else control.on_lookup(request, hit_tokens, junction)

    def _hy_sibling_stops(self, request: Any, hit_tokens: int) -> list[int]:
        """``CacheControl.sibling_stops``: where ``request``, about to be scheduled with its
        hit, ends chunks for the waiting requests that can start beside it: as many as the
        running slots left after its own (``SiblingWaits.stops``; vLLM's waiting loop stops at
        ``max_num_seqs`` running, ``Scheduler.schedule``)."""
        assert self.hy_siblings is not None
        waiting = (_sibling(w) for w in self.waiting)  # type: ignore[attr-defined]
        slots = self.scheduler_config.max_num_seqs - len(self.running) - 1  # type: ignore[attr-defined]
        return self.hy_siblings.stops(_sibling(request, hit_tokens), waiting, max(slots, 0))

    def holds_back(self, request: Any) -> bool:
        """A new waiting request waits this step for a running request still computing the
        prefix they share (``SiblingWaits.wait_for``), which ends a chunk and keeps its state
        where the two diverge."""
        siblings = self.hy_siblings
        if (
            siblings is None
            or not siblings.producers
            or request.status != RequestStatus.WAITING
            or request.num_computed_tokens
        ):
            return False
        running = []
        for key, producer in list(siblings.producers.items()):
            if producer.num_computed_tokens >= producer.num_prompt_tokens:
                del siblings.producers[key]  # its prompt is computed: nothing left to wait for
            elif producer.status == RequestStatus.RUNNING:
                running.append((producer, _sibling(producer)))
        found = siblings.wait_for(_sibling(request), running)
        if found is None:
            return False
        producer, stop = found
        control = self.hy_control
        assert control is not None
        if stop:
            control.add_stop(producer, stop)
        control.sibling_waits += 1
        return True

    def ends_chunk_exactly(self, request: Any) -> bool:
        """A pending sub-block breakpoint stop (``cache_control.exact_stop_ids``)."""
        control = self.hy_control
        return control is not None and request.request_id in control.exact_stop_ids

    def drops_prompt_tail_stop(self, request: Any) -> bool:
        """With ``exact_prompt_end`` off, at a one-token match unit: no forward pass of its
        own for a prompt's last token, so no state after ``P - 1`` tokens, where an exact
        repeat, or a next turn that shares the prompt but not the generated answer, would
        resume (a next turn with the answer resumes at its end-of-output state,
        ``output_states.py``). At a larger unit a sibling that shares all but the prompt's
        last few tokens resumes there too, so vLLM's split stays; so it does for a request
        that pins its prompt's end (a prewarm)."""
        if not self.split_hook_always:
            return False
        control = self.hy_control
        return control is None or not control.pins_prompt_end(request)

    def before_free_request(self, request: Any) -> None:
        if self.hy_output is not None:
            self.hy_output.on_finished(request)  # before vLLM frees the blocks (and the origin)
        if self.hybrid_pool is not None:
            self.hybrid_pool.hybrid.origin.pop(request.request_id, None)
        if self.hy_siblings is not None:
            self.hy_siblings.forget(request.request_id)

    def after_free_request(self, request: Any, kv_params: Any) -> Any:
        if self.hy_control is not None:
            result = self.hy_control.on_finished(request)
            if result is not None:
                # Rides to the client in EngineCoreOutput.kv_transfer_params (vLLM returns it
                # in the OpenAI response and RequestOutput); no connector reads our key.
                kv_params = {**(kv_params or {}), RESULT_KEY: result}
        return kv_params

    # ------------------------------------------------------------------ vLLM's public methods
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        control, pool = self.hy_control, self.hybrid_pool
        if control is not None:
            control.expire()
        if pool is not None:
            pool.hybrid.mirror.refresh_lookahead()  # the waiting queue moved on
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if pool is not None:
            pool.hy_release_promoted()  # their copies are in out's connector meta
            self._hy_feed_started(pool, out)
        if control is not None:
            control.after_schedule(out)
        self._hy_after_step()
        return out

    def _hy_feed_started(self, pool: HybridBlockPool, out: Any) -> None:
        """Each request scheduled for the first time (``SchedulerOutput.scheduled_new_reqs``),
        with the hit it runs with (``NewRequestData.num_computed_tokens``: the tokens computed
        before this step, i.e. the prefix-cache hit) and the cached KV beyond it
        (``Request.shared_prefix_boundary``, from ``KVCacheManager.get_computed_blocks``)."""
        state = pool.hybrid
        mirror, feed, origin = state.mirror, state.feed, state.origin
        assert feed is not None
        control = self.hy_control
        for new in out.scheduled_new_reqs:
            request = self.requests.get(new.req_id)  # type: ignore[attr-defined]
            if request is None:
                continue
            hit = new.num_computed_tokens
            junction = (
                control.vllm_junction(request)
                if control is not None
                else request.shared_prefix_boundary
            )
            index = origin.get(new.req_id)
            if index is None:  # not looked up first (before_prefix_lookup)
                index = origin[new.req_id] = mirror.tick()
            feed.started(
                index,
                request.num_prompt_tokens,
                hit,
                max(hit, junction),
                request.block_hashes,
                mirror.node_of,
            )

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        if self.hy_control is not None:
            self.hy_control.release_all()  # pinned blocks would make the reset fail
        return super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        out = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        self._hy_after_step()
        return out

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        stats = super().make_stats(*args, **kwargs)  # type: ignore[misc]
        if stats is not None and self.hybrid_pool is not None:
            attach_hybrid_stats(self.hybrid_pool, stats)
        if stats is not None and self.hybrid_pool is None and self.hy_control is not None:
            setattr(stats, FIELD, self.hy_control.totals())
        return stats

    def _hy_after_step(self) -> None:
        pool = self.hybrid_pool
        if pool is not None and pool.hybrid.debug:
            pool.hy_check_integrity()
            if self.hy_control is not None:
                self.hy_control.ledger.check_integrity()
            self.hybrid_checks += 1


def _sibling(request: Any, done: int | None = None) -> Sibling:
    """A vLLM ``Request`` as ``core.siblings`` sees it (``done``: its tokens computed, or the
    hit it is about to be scheduled with)."""
    return Sibling(
        request.request_id,
        request.block_hashes,
        request.num_prompt_tokens,
        request.num_computed_tokens if done is None else done,
        request.shared_prefix_boundary,
    )


class HybridScheduler(_HybridMixin, Scheduler):
    """vLLM's ``Scheduler`` with the core deciding its prefix cache for hybrid models."""


class HybridAsyncScheduler(_HybridMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with the core deciding its prefix cache for hybrid models."""
