"""Scheduler subclasses that put a core eviction policy in charge of vLLM's prefix cache.

Use them explicitly (vLLM 0.32.0)::

    LLM(model, enable_prefix_caching=True,
        scheduler_cls="vllm_hybrid.adapters.vllm.scheduler.HybridScheduler")
    vllm serve MODEL --enable-prefix-caching \\
        --scheduler-cls vllm_hybrid.adapters.vllm.scheduler.HybridScheduler

(``HybridAsyncScheduler`` where vLLM runs its ``AsyncScheduler``.) After ``Scheduler.__init__``
(``vllm/v1/core/sched/scheduler.py``, which builds ``KVCacheManager`` -> coordinator -> one shared
``BlockPool``) they activate only when prefix caching is on and the KV cache config has a
``MambaSpec`` group next to full-attention groups, all of one block size, on the pinned vLLM
version; otherwise they are vLLM's schedulers, unchanged. Activation swaps the pool's class to
:class:`~vllm_hybrid.adapters.vllm.block_pool.HybridBlockPool`.

Environment (read when the engine starts):

* ``VLLM_HYBRID_POLICY``: eviction policy, one of ``core.policies.POLICIES``
  (``vllm``, ``lru-dense``, ``sglang``, ``marconi``, ``flop``); default ``flop``.
* ``VLLM_HYBRID_SHAPE``: built-in shape name or JSON path for the policy's cost model
  (FLOPs saved per byte); default ``zamba2-2.7b``. Only the ranking depends on it.
* ``VLLM_HYBRID_DEBUG=1``: check the mirror's invariants and that it equals vLLM's hash map and
  free queue after every ``schedule()`` and ``update_from_output()`` (O(pool) per step).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_hybrid.adapters.vllm.block_pool import HybridBlockPool, install
from vllm_hybrid.adapters.vllm.version import check_vllm_version
from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.policies import POLICIES
from vllm_hybrid.core.pool_mirror import PoolMirror
from vllm_hybrid.core.shapes import load_shape

logger = logging.getLogger("vllm_hybrid")

ENV_POLICY = "VLLM_HYBRID_POLICY"
ENV_SHAPE = "VLLM_HYBRID_SHAPE"
ENV_DEBUG = "VLLM_HYBRID_DEBUG"
DEFAULT_POLICY = "flop"
DEFAULT_SHAPE = "zamba2-2.7b"


def policy_from_env(block_tokens: int) -> Any:
    """The policy object named by ``$VLLM_HYBRID_POLICY``; ValueError listing valid names."""
    name = os.environ.get(ENV_POLICY, DEFAULT_POLICY).strip()
    if name not in POLICIES:
        raise ValueError(
            f"{ENV_POLICY}={name!r} is not a policy; valid names: {', '.join(sorted(POLICIES))}"
        )
    cost = CostModel(load_shape(os.environ.get(ENV_SHAPE, DEFAULT_SHAPE)), block_tokens)
    return POLICIES[name](cost)


def _groups(kv_cache_config: Any) -> tuple[list[int], list[int], set[int]] | None:
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
    """Install the hybrid pool on ``scheduler``'s shared pool if the model and config call for
    it; returns it, or None (the scheduler stays stock)."""
    if not scheduler.cache_config.enable_prefix_caching:
        return None
    groups = _groups(scheduler.kv_cache_config)
    if groups is None or not groups[0] or not groups[1]:
        return None  # not a (full attention + Mamba) hybrid: stock path
    kv, state, sizes = groups
    pool = scheduler.kv_cache_manager.block_pool
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    if len(sizes) != 1 or any(m.block_pool is not pool for m in managers):
        logger.warning("vllm-hybrid: mixed block sizes or pools; eviction stays vLLM's LRU")
        return None
    if not check_vllm_version("the hybrid block pool"):
        return None
    block_tokens = sizes.pop()
    policy = policy_from_env(block_tokens)
    mirror = PoolMirror(block_tokens=block_tokens, kv_groups=kv, state_groups=state, policy=policy)
    logger.info(
        "vllm-hybrid: %s eviction on %d blocks of %d tokens (attention groups %s, Mamba %s)",
        policy.name,
        pool.num_gpu_blocks,
        block_tokens,
        kv,
        state,
    )
    return install(pool, mirror)


class _HybridMixin:
    """Shared by both schedulers (put first in the bases, so ``super()`` reaches vLLM's class):
    activation, the policy clock, and the debug checks after every step."""

    hybrid_pool: HybridBlockPool | None
    _hy_debug: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hybrid_pool = activate(self)
        self._hy_debug = os.environ.get(ENV_DEBUG, "0") == "1"
        self.hybrid_checks = 0

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self.hybrid_pool is not None:
            self.hybrid_pool._hy_mirror.tick()
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self._hy_after_step()
        return out

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        out = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        self._hy_after_step()
        return out

    def _hy_after_step(self) -> None:
        if self.hybrid_pool is not None and self._hy_debug:
            self.hybrid_pool.hy_check_integrity()
            self.hybrid_checks += 1


class HybridScheduler(_HybridMixin, Scheduler):
    """vLLM's ``Scheduler`` with the core's policy choosing prefix-cache victims."""


class HybridAsyncScheduler(_HybridMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with the core's policy choosing prefix-cache victims."""
