"""Scheduler subclasses that put the core in charge of vLLM's prefix cache for hybrid models.

The plugin selects them automatically (``plugin.py::select_hybrid_scheduler``); explicitly
(vLLM 0.32.0)::

    LLM(model, enable_prefix_caching=True,
        scheduler_cls="vllm_hybrid.adapters.vllm.scheduler.HybridScheduler")
    vllm serve MODEL --enable-prefix-caching \\
        --scheduler-cls vllm_hybrid.adapters.vllm.scheduler.HybridScheduler

(``HybridAsyncScheduler`` where vLLM runs its ``AsyncScheduler``.) After ``Scheduler.__init__``
(``vllm/v1/core/sched/scheduler.py``, which builds ``KVCacheManager`` -> coordinator -> one shared
``BlockPool``) they activate only when prefix caching is on, the KV cache config has a
``MambaSpec`` group next to full-attention groups, all of one block size, the settings' policy is
not ``stock`` and vLLM is the pinned version; otherwise they are vLLM's schedulers, unchanged.
Activation (:func:`activate`):

* eviction: swaps the pool's class to
  :class:`~vllm_hybrid.adapters.vllm.block_pool.HybridBlockPool` (the policy picks victims);
* admission (only when ``snapshot_every`` is not ``engine``): sets the coordinator's snapshot
  retention interval (``KVCacheCoordinator.retention_interval``, read by
  ``MambaManager.cache_blocks`` through ``reachable_block_mask`` at every step), e.g. to the
  policy's periodic interval; prompt ends and shared-prefix junctions are always kept, at their
  hash-block positions, by vLLM's prefill checkpoint;
* learning: every request, when first scheduled, is fed to the policy (``core/feed.py``);
* lookahead: the waiting requests' block hashes (``Request.block_hashes``, known from arrival)
  are the mirror's ``lookahead``, so what a waiting request would hit goes last
  (``PoolMirror.wanted_keys``, walked once per ``schedule()``; eviction order only).

Independently of the policy (whenever prefix caching is on), per-request cache control:
explicit breakpoints, pins with a TTL and cache reports (``cache_control.py``, hooked in
``_get_local_prefix_cache_hit``, ``schedule``, ``_free_request``, ``reset_prefix_cache`` and
``make_stats``; see docs/serving.md).

Settings: ``additional_config={"vllm_hybrid": {...}}`` or environment, see ``config.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_hybrid.adapters.vllm.block_pool import HybridBlockPool, install
from vllm_hybrid.adapters.vllm.cache_control import RESULT_KEY, CacheControl, OutputStates
from vllm_hybrid.adapters.vllm.config import engine_cost_model, load_config
from vllm_hybrid.adapters.vllm.metrics import FIELD, attach_hybrid_stats, block_bytes
from vllm_hybrid.adapters.vllm.plugin import share_vllm_logging
from vllm_hybrid.adapters.vllm.version import check_vllm_version
from vllm_hybrid.core import _native
from vllm_hybrid.core.config import periodic_interval
from vllm_hybrid.core.feed import RequestFeed
from vllm_hybrid.core.policies import POLICIES
from vllm_hybrid.core.pool_mirror import PoolMirror

logger = logging.getLogger("vllm_hybrid")


def hybrid_groups(kv_cache_config: Any) -> tuple[list[int], list[int], set[int]] | None:
    """(attention group ids, Mamba group ids, block sizes), or None if another spec is used."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    kv, state, sizes = [], [], set()
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            state.append(i)
        elif isinstance(spec, FullAttentionSpec):
            kv.append(i)
        else:
            return None
        sizes.add(spec.block_size)
    return kv, state, sizes


def activate(scheduler: Any) -> HybridBlockPool | None:
    """Put the core in charge of ``scheduler``'s prefix cache if the model and settings call
    for it; returns the hybrid pool, or None (the scheduler stays stock). Bad settings raise
    :class:`~vllm_hybrid.core.config.ConfigError` even where the cache would stay stock."""
    share_vllm_logging()
    config = load_config(scheduler.vllm_config)
    if not scheduler.cache_config.enable_prefix_caching or not config.enabled:
        return None
    groups = hybrid_groups(scheduler.kv_cache_config)
    if groups is None or not groups[0] or not groups[1]:
        return None  # not a (full attention + Mamba) hybrid: stock path
    kv, state, sizes = groups
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    coordinator = manager.coordinator
    if len(sizes) != 1 or any(m.block_pool is not pool for m in coordinator.single_type_managers):
        logger.warning("vllm-hybrid: mixed block sizes or pools; the cache stays vLLM's")
        return None
    if not check_vllm_version("the hybrid block pool"):
        return None
    block_tokens = sizes.pop()
    cost = engine_cost_model(
        config, scheduler.vllm_config, scheduler.kv_cache_config, block_tokens, kv, state
    )
    policy = POLICIES[config.policy](cost)
    mirror = PoolMirror(
        block_tokens=block_tokens,
        kv_groups=kv,
        state_groups=state,
        policy=policy,
        kv_bytes_per_token=cost.kv_bytes_per_token,  # nodes' KV bytes, as the policy counts them
    )
    mirror.snapshot_budget_pages = config.snapshot_budget_pages(pool.num_gpu_blocks)
    too_small = config.snapshot_budget_warning(pool.num_gpu_blocks, len(state))
    if too_small:
        logger.warning("vllm-hybrid: %s", too_small)
    if config.snapshot_every != "engine":
        interval = periodic_interval(
            config.snapshot_every, getattr(policy, "interval_tokens", None), block_tokens
        )
        # None is vLLM's "dense" (a state at every block); 0 keeps prompt ends and junctions.
        retention = None if interval == block_tokens else interval
        coordinator.retention_interval = retention
        scheduler.kv_cache_config.prefix_cache_retention_interval = retention
    hybrid = install(pool, mirror)
    hybrid.hy_block_bytes = block_bytes(scheduler.kv_cache_config)
    hybrid.hy_feed = RequestFeed(policy, cost, pool.hash_block_size)
    hybrid.hy_debug = config.debug
    if config.host_tier_bytes > 0:
        from vllm_hybrid.adapters.vllm.host_connector import attach_host_tier

        attach_host_tier(scheduler, hybrid, config)
    logger.info(
        "vllm-hybrid: %s policy on %d blocks of %d tokens (attention groups %s, Mamba %s), "
        "periodic snapshots: %s; core %s%s",
        policy.name,
        pool.num_gpu_blocks,
        block_tokens,
        kv,
        state,
        coordinator.retention_interval,
        _native.MODE,  # compiled (scripts/build_core.py) or the Python sources
        f" ({_native.REASON})" if _native.REASON else "",
    )
    return hybrid


def cache_control(scheduler: Any) -> CacheControl | None:
    """Breakpoints, pins and reports for ``scheduler`` when prefix caching is on (any model:
    breakpoints only change anything where recurrent states are cached), else None."""
    if not scheduler.cache_config.enable_prefix_caching:
        return None
    if not check_vllm_version("cache breakpoints and pins"):
        return None
    return CacheControl(scheduler, load_config(scheduler.vllm_config))


class _HybridMixin:
    """Shared by both schedulers (put first in the bases, so ``super()`` reaches vLLM's class):
    activation, feeding started requests to the policy, per-request cache control, stats, and
    the debug checks."""

    hybrid_pool: HybridBlockPool | None
    hy_control: CacheControl | None
    mamba_shared_prefix_checkpoint: bool  # vLLM's Scheduler attribute

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hybrid_pool = activate(self)
        self.hy_control = cache_control(self)
        #: End-of-output states (``cache_control.OutputStates``): only with the core in charge
        #: (never under ``policy: stock``, where vLLM's cache stays untouched).
        self.hy_output: OutputStates | None = None
        if self.hybrid_pool is not None:
            self.hybrid_pool._hy_mirror.lookahead = self._hy_waiting_paths
            control = self.hy_control
            self.hy_output = OutputStates.install(
                self,
                self.hybrid_pool._hy_mirror.policy,
                sub_block=control is not None and control.stop_tokens < control.block_tokens,
            )
            extras = [x.totals for x in (self.hy_control, self.hy_output) if x is not None]
            if extras:  # metrics.hybrid_totals
                self.hybrid_pool.hy_extra_totals = lambda: {
                    key: value for totals in extras for key, value in totals().items()
                }
        control = self.hy_control
        if control is None or control.stop_tokens >= control.block_tokens:
            # No sub-block stops can ever be pending: vLLM's split itself, bound on the
            # instance, so the override below costs nothing (vLLM calls it for every running
            # request at every step; ~1.5% of a 256-request step in bench_scheduler.py).
            self._mamba_block_aligned_split = super()._mamba_block_aligned_split  # type: ignore[method-assign,misc]
        self.hybrid_checks = 0

    def _hy_waiting_paths(self) -> Iterator[Sequence[Any]]:
        """The mirror's lookahead: each waiting request's keys (``Request.block_hashes`` at
        full-block ends) up to the last block a hit may end on (vLLM leaves the last token to
        compute: ``find_longest_cache_hit`` looks up ``num_tokens - 1`` tokens)."""
        pool = self.hybrid_pool
        assert pool is not None
        block_tokens = pool._hy_mirror.block_tokens
        step = block_tokens // pool.hash_block_size
        for request in self.waiting:  # type: ignore[attr-defined]
            n = (request.num_tokens - 1) // block_tokens * step
            yield request.block_hashes[step - 1 : n : step]

    def _get_local_prefix_cache_hit(self, request: Any) -> Any:
        """vLLM's lookup (``Scheduler._get_local_prefix_cache_hit``); the request's breakpoints
        become its ``shared_prefix_boundary`` (see ``cache_control.py``). With the host tier on,
        a host snapshot the request can resume from is promoted first (``hy_promote``)."""
        pool = self.hybrid_pool
        if pool is not None and pool.hy_host is not None:
            if self.kv_cache_manager.prefix_cache_lookup_enabled(request):  # type: ignore[attr-defined]
                pool.hy_promote(request)
        blocks, hit, junction, diverged = super()._get_local_prefix_cache_hit(request)  # type: ignore[misc]
        if self.hy_control is not None:
            junction = self.hy_control.on_lookup(request, hit, junction)
        return blocks, hit, junction, diverged

    def _mamba_block_aligned_split(self, request: Any, *args: Any, **kwargs: Any) -> int:
        """vLLM's chunk split (``Scheduler._mamba_block_aligned_split``), ending the chunk
        exactly at a pending sub-block breakpoint stop rather than block-floored: vLLM's own
        branch for shared-prefix checkpoints (``mamba_shared_prefix_checkpoint``, EAGLE-only
        there), on for this call only (see ``cache_control.exact_stops``)."""
        split = super()._mamba_block_aligned_split  # type: ignore[misc]
        control = self.hy_control
        if control is None or request.request_id not in control.exact_stop_ids:
            return int(split(request, *args, **kwargs))
        saved = self.mamba_shared_prefix_checkpoint
        self.mamba_shared_prefix_checkpoint = True
        try:
            return int(split(request, *args, **kwargs))
        finally:
            self.mamba_shared_prefix_checkpoint = saved

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self.hy_control is not None:
            self.hy_control.expire()
        if self.hybrid_pool is not None:
            self.hybrid_pool._hy_mirror.refresh_lookahead()  # the waiting queue moved on
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if self.hybrid_pool is not None:
            self.hybrid_pool.hy_release_promoted()  # their copies are in out's connector meta
            self._hy_feed_started(out)
        if self.hy_control is not None:
            self.hy_control.after_schedule(out)
        self._hy_after_step()
        return out

    def _hy_feed_started(self, out: Any) -> None:
        """Each request scheduled for the first time (``SchedulerOutput.scheduled_new_reqs``),
        with the hit it runs with (``NewRequestData.num_computed_tokens``: the tokens computed
        before this step, i.e. the prefix-cache hit) and the cached KV beyond it
        (``Request.shared_prefix_boundary``, from ``KVCacheManager.get_computed_blocks``)."""
        pool = self.hybrid_pool
        assert pool is not None and pool.hy_feed is not None
        mirror, feed = pool._hy_mirror, pool.hy_feed
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
            index = pool.hy_origin[new.req_id] = mirror.tick()
            feed.started(
                index,
                request.num_prompt_tokens,
                hit,
                max(hit, junction),
                request.block_hashes,
                mirror.node_of,
            )

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if self.hy_output is not None:
            self.hy_output.on_finished(request)  # before vLLM frees the blocks (and the origin)
        if self.hybrid_pool is not None:
            self.hybrid_pool.hy_origin.pop(request.request_id, None)
        kv_params, ec_params = super()._free_request(request, *args, **kwargs)  # type: ignore[misc]
        if self.hy_control is not None:
            result = self.hy_control.on_finished(request)
            if result is not None:
                # Rides to the client in EngineCoreOutput.kv_transfer_params (vLLM returns it
                # in the OpenAI response and RequestOutput); no connector reads our key.
                kv_params = {**(kv_params or {}), RESULT_KEY: result}
        return kv_params, ec_params

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
        if self.hybrid_pool is not None and self.hybrid_pool.hy_debug:
            self.hybrid_pool.hy_check_integrity()
            if self.hy_control is not None:
                self.hy_control.ledger.check_integrity()
            self.hybrid_checks += 1


class HybridScheduler(_HybridMixin, Scheduler):
    """vLLM's ``Scheduler`` with the core deciding its prefix cache for hybrid models."""


class HybridAsyncScheduler(_HybridMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with the core deciding its prefix cache for hybrid models."""
