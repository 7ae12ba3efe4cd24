"""``HybridBlockPool``: vLLM's ``BlockPool`` with eviction victims chosen by a core policy.

Written against vLLM 0.32.0, ``vllm/v1/core/block_pool.py``. The pool is installed by class swap
(``compat.swap_pool_class``) on the one ``BlockPool`` that ``KVCacheCoordinator.__init__``
(``kv_cache_coordinator.py``) shares between all KV cache groups; :func:`install` does it right
after the scheduler is built, while the pool holds no cached block yet. Its state is one
:class:`~vllm_hybrid.adapters.vllm.state.HybridState`, ``pool.hybrid``. What is overridden and
why (vLLM's private methods only through ``compat``):

* :meth:`on_hash_inserted` / :meth:`on_hashes_removed` (``compat.HookedBlockPool``'s hooks on
  vLLM's ``_insert_block_hash`` / ``_remove_cached_block_hashes``): every change of vLLM's hash
  map goes through these two (``cache_full_blocks``, ``cache_partial_block``,
  ``move_block_hashes``, ``_maybe_evict_cached_block``, ``evict_blocks``); we mirror it into a
  :class:`~vllm_hybrid.core.PrefixIndex`. ``cache_full_blocks`` and
  ``cache_partial_block`` only remember the request (its chained hashes give the parent key).
* ``move_block_hashes`` (Mamba copy-on-write): one ``move_page`` in the mirror.
* ``touch``: prefix hits feed the policy's statistics.
* ``get_new_blocks``: when the free uncached blocks do not cover a request, the mirror picks
  the cached victims by the policy's priority (a KV block goes with the snapshots under it);
  their hashes are dropped exactly as ``_maybe_evict_cached_block`` does (vLLM's lookup stays
  consistent, ``BlockRemoved`` events are emitted), then the blocks are handed out as usual.
  A block with ``ref_cnt > 0`` is never chosen. If the policy cannot free enough (e.g. the
  only free pages are leaf states that its units keep with their KV), the rest comes from the
  head of vLLM's LRU queue as before (counted in ``fallback_pages``).
* ``reset_prefix_cache``: clears the mirror when vLLM clears its map.

With the host tier on (``host_tier_gb``, ``core/host_ledger.py``),
:meth:`HybridBlockPool.hy_promote` brings a host snapshot back before vLLM's lookup: fresh
blocks, cached under the snapshot's hash like any state, held until the step's copies are
shipped (:meth:`hy_release_promoted`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

from vllm_hybrid.adapters.vllm.compat.block_pool import (
    HookedBlockPool,
    cache_block_key,
    drop_cached_hashes,
    evict_cached_block,
    notify_reuse,
    swap_pool_class,
)
from vllm_hybrid.adapters.vllm.pool_checks import check_pool
from vllm_hybrid.adapters.vllm.state import HybridState
from vllm_hybrid.adapters.vllm.version import UnsupportedVLLMVersion
from vllm_hybrid.core import KV, SNAPSHOT, PageCounts, PrefixIndex, VictimStats

logger = logging.getLogger("vllm_hybrid")


class HybridBlockPool(HookedBlockPool):
    """Never constructed directly: :func:`install` swaps the class of vLLM's pool instance."""

    hybrid: HybridState

    # ---------------------------------------------------------------- mirroring the hash map
    def cache_full_blocks(self, request: Any, *args: Any, **kwargs: Any) -> None:
        self.hybrid.request = request
        try:
            super().cache_full_blocks(request, *args, **kwargs)
        finally:
            self.hybrid.request = None

    def cache_partial_block(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self.hybrid.request = request
        try:
            return super().cache_partial_block(request, *args, **kwargs)
        finally:
            self.hybrid.request = None

    def on_hash_inserted(
        self, key: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int | None
    ) -> None:
        state = self.hybrid
        if state.quiet:
            return
        request = state.request
        if request is None or num_tokens is None:
            raise RuntimeError("vllm-hybrid: a block hash was inserted outside a known caller")
        # get_group_id through a table of the groups' 4-byte suffixes (an unknown group falls
        # back to vLLM's decoding, and the mirror refuses it)
        group = state.group_of.get(key[-4:])
        if group is None:
            group = get_group_id(key)
        mirror = state.mirror
        b, unit = mirror.block_tokens, self.hash_block_size
        parent_end = num_tokens - b if num_tokens % b == 0 else num_tokens // b * b
        hashes = request.block_hashes
        parent = hashes[parent_end // unit - 1] if parent_end > 0 else None
        # Below the block, the request's per-unit keys inside the span, for the exact junction
        # of a later request (PrefixIndex.shared_tokens; held by reference, not copied).
        units = (hashes, parent_end // unit) if unit < b and group in mirror.kv_groups else None
        newly_cached = mirror.add(
            block.block_id,
            get_block_hash(key),
            group,
            num_tokens,
            parent,
            state.origin.get(request.request_id, -1),
            units,
        )
        if newly_cached:
            state.pages.on_cached(group)

    def hy_exact_junction(self, request: Any, kv_tokens: int) -> int:
        """Where ``request`` diverges from what the pool caches, at the match unit: vLLM's
        lookup finds the cached KV up to ``kv_tokens`` (whole blocks and registered partial
        entries), and the request may share more of a cached block's span past that
        (``PrefixIndex.shared_tokens`` over the block's per-unit keys). At most the last
        token a hit may cover (``num_tokens - 1``). ``kv_tokens`` where the unit is the block."""
        mirror, unit = self.hybrid.mirror, self.hash_block_size
        b = mirror.block_tokens
        if unit >= b:
            return kv_tokens
        start = kv_tokens // b * b
        hashes = request.block_hashes
        limit = min(len(hashes), (request.num_tokens - 1) // unit)
        parent = hashes[start // unit - 1] if start > 0 else None
        shared = mirror.shared_tokens(parent, hashes, start // unit, unit, limit)
        return max(kv_tokens, start + shared)

    def on_hashes_removed(self, block: KVCacheBlock, removed: list[BlockHashWithGroupId]) -> None:
        state = self.hybrid
        if not state.quiet:
            dropped = state.mirror.drop_page(block.block_id)
            if dropped:
                for group in {g for _, g in dropped}:
                    state.pages.on_dropped(group)

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        state = self.hybrid
        state.quiet = True
        try:
            super().move_block_hashes(src_block, dst_block)
        finally:
            state.quiet = False
        state.mirror.move_page(src_block.block_id, dst_block.block_id)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().touch(blocks)
        self.hybrid.mirror.touch_pages([b.block_id for b in blocks if not b.is_null])

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        if done:
            state = self.hybrid
            state.mirror.clear()
            state.pages.on_reset()
            if state.host is not None:
                state.host.clear()
        return done

    # ---------------------------------------------------------------- host tier
    def hy_promote(self, request: Any) -> bool:
        """Before vLLM's lookup of a waiting ``request``
        (``Scheduler._get_local_prefix_cache_hit``): if its usable prefix ends deeper on a host
        snapshot than on any device one, copy it back into fresh blocks (one per Mamba group)
        cached under its hash, so that ``MambaManager.find_longest_cache_hit`` finds it like any
        cached state. The blocks are held (``ref_cnt`` 1) until :meth:`hy_release_promoted`,
        after the step's copies are shipped; the worker fills them before the step reads or
        writes any block (``host_connector.py``)."""
        state = self.hybrid
        host = state.host
        if host is None or not request.block_hashes:
            return False
        hashes, hash_block = request.block_hashes, self.hash_block_size
        found = host.find_promotion(lambda end: hashes[end // hash_block - 1], request.num_tokens)
        if found is None:
            return False
        node, end = found
        groups = host.state_groups
        if self.free_block_queue.num_free_blocks < len(groups):
            return False
        blocks = self.get_new_blocks(len(groups))  # may evict (and demote) other states
        if host.mirror.live_node(node.key) is not node or not host.tier.holds(node):
            # the allocation evicted KV of the path (or the host dropped the state): give up
            self.free_blocks(blocks)
            host.aborted += 1
            return False
        host.promote(node, [b.block_id for b in blocks])
        state.request = request
        try:  # as cache_full_blocks caches a full block: its hash, num_tokens = its end
            for group, block in zip(groups, blocks, strict=True):
                key = make_block_hash_with_group_id(node.key, group)  # type: ignore[arg-type]
                cache_block_key(self, key, block, end)
        finally:
            state.request = None
        state.promoted.extend(blocks)
        return True

    def hy_release_promoted(self) -> None:
        """Drop our hold on this step's promoted blocks (the scheduler calls it after
        ``schedule()``: the copies are in the step's connector metadata). A block whose request
        was scheduled keeps that request's reference; the others become free cached states."""
        state = self.hybrid
        if state.promoted:
            blocks, state.promoted = state.promoted, []
            self.free_blocks(blocks)

    # ---------------------------------------------------------------- eviction
    def _hy_is_free(self, page: int) -> bool:
        return self.blocks[page].ref_cnt == 0

    # Every ref_cnt change 0 <-> 1 of a pool block goes through get_new_blocks, touch (both
    # 0 -> 1), free_blocks and unpin_blocks (-> 0); vLLM's other increments (MambaManager's
    # copy-on-write) are on blocks already in use. The mirror keeps the free cached pages and
    # the units' in-use counts from these events, so no eviction scans the pool.
    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)  # callers pass generators (reversed(...))
        super().free_blocks(blocks)
        # _hy_released, inlined (hot: vLLM frees one or two blocks per call, ~20 calls a step)
        mirror = self.hybrid.mirror
        mirror.pages_freed(
            [b.block_id for b in blocks if not b.ref_cnt and (b.pool is self or b.pool is None)]
        )
        if mirror.snapshot_budget_pages is not None and mirror.snapshot_excess():
            self._hy_enforce_snapshot_budget()

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], *args: Any, **kwargs: Any) -> Any:
        blocks = list(blocks)
        out = super().unpin_blocks(blocks, *args, **kwargs)
        self._hy_released(blocks)
        return out

    def _hy_released(self, blocks: list[KVCacheBlock]) -> None:
        # One batch per call. The null block (its ref_cnt is not maintained) is never cached,
        # and the mirror ignores an uncached page it believes free, so no is_null check here.
        mirror = self.hybrid.mirror
        mirror.pages_freed(
            [b.block_id for b in blocks if not b.ref_cnt and (b.pool is self or b.pool is None)]
        )
        if mirror.snapshot_budget_pages is not None and mirror.snapshot_excess():
            self._hy_enforce_snapshot_budget()

    def _hy_enforce_snapshot_budget(self) -> None:
        """Released pages took the free snapshots over ``max_snapshot_fraction`` of the pool:
        drop the policy's lowest units holding states at once (``PrefixIndex.
        pick_snapshot_victims``), as an eviction would, so the budget holds after every
        release; the pages become free uncached blocks at the head of the queue."""
        mirror = self.hybrid.mirror
        excess = mirror.snapshot_excess()
        pages = mirror.pick_snapshot_victims(excess, self._hy_is_free)
        self._hy_drop_victims(pages)
        self.hybrid.budget_pages += len(pages)
        logger.debug(
            "vllm-hybrid: snapshot budget: %d pages dropped for %d free state pages over %d",
            len(pages),
            excess,
            mirror.snapshot_budget_pages,
        )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """As vLLM's, but cached blocks are reused in the policy's order, not LRU order."""
        state = self.hybrid
        queue, mirror = self.free_block_queue, state.mirror
        n_free = queue.num_free_blocks
        if num_blocks > n_free:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        uncached = n_free - mirror.free_pages()
        if num_blocks > uncached:
            self._hy_evict(num_blocks - uncached)
            uncached = queue.num_free_blocks - mirror.free_pages()
        # Uncached blocks first (vLLM keeps them, and our victims, at the head of the queue),
        # cached ones in LRU order only as a fallback (counted in fallback_pages).
        take_cached = max(0, num_blocks - uncached)
        state.fallback_pages += take_cached
        ret = queue.popleft_n(num_blocks)
        ids = [block.block_id for block in ret]
        if not mirror.cached.isdisjoint(ids):
            ret = self._hy_pop_rest(ret, num_blocks, take_cached)
            ids = [block.block_id for block in ret]
        notify_reuse(self, ret)
        collector = self.metrics_collector
        by_block = self.cached_block_hashes_by_block
        for block in ret:  # as vLLM's get_new_blocks with caching on
            # vLLM's eviction of a block's hashes is a no-op on a block without any (the
            # policy's victims lost theirs in _hy_evict) unless a metrics collector wants to
            # hear of it.
            if collector or block.block_hash is not None or block.block_id in by_block:
                evict_cached_block(self, block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
            if collector:
                collector.on_block_allocated(block)
        mirror.pages_used(ids)
        return ret

    def _hy_evict(self, shortfall: int) -> None:
        """Drop the hashes of the policy's victims and move them to the head of the queue."""
        state = self.hybrid
        logging_on = logger.isEnabledFor(logging.DEBUG)
        if logging_on:  # only the debug line needs the counts from before
            stats_before = dataclasses.replace(state.mirror.stats)
            evicted_before = (state.pages.evicted[KV], state.pages.evicted[SNAPSHOT])
        victims = state.mirror.pick_victims(shortfall, self._hy_is_free)
        self._hy_drop_victims(victims)
        state.policy_pages += len(victims)
        state.evict_calls += 1
        if logging_on:
            self._hy_log_batch(shortfall, len(victims), evicted_before, stats_before)

    def _hy_drop_victims(self, pages: list[int]) -> None:
        """Drop the victims' hashes (``compat.drop_cached_hashes``: as vLLM evicts a cached
        block, minus the metrics call that ``get_new_blocks`` makes) and move them to the head
        of the free queue."""
        queue, blocks = self.free_block_queue, self.blocks
        victims = [blocks[p] for p in pages]
        for block in victims:
            drop_cached_hashes(self, block)
            queue.remove(block)
        queue.prepend_n(victims)

    def _hy_log_batch(
        self, shortfall: int, n_pages: int, evicted_before: tuple[int, int], before: VictimStats
    ) -> None:
        """One debug line per eviction batch: pages by kind and the victims' reasons."""
        now, ev = self.hybrid.mirror.stats, self.hybrid.pages.evicted
        logger.debug(
            "vllm-hybrid: eviction batch: %d pages (KV %d, snapshot %d) for a shortfall of %d; "
            "by reason: dead pages %d, duplicate pages %d, KV units %d, snapshot units %d",
            n_pages,
            ev[KV] - evicted_before[0],
            ev[SNAPSHOT] - evicted_before[1],
            shortfall,
            now.dead_pages - before.dead_pages,
            now.duplicate_pages - before.duplicate_pages,
            now.kv_units - before.kv_units,
            now.snapshot_units - before.snapshot_units,
        )

    def _hy_pop_rest(
        self, head: list[KVCacheBlock], num_blocks: int, take_cached: int
    ) -> list[KVCacheBlock]:
        """``head`` (popped from the queue) holds a cached block: take the blocks as popping
        one at a time would: uncached blocks, cached ones only for the fallback
        (``take_cached``), the cached ones passed over go back to the tail."""
        queue, holds = self.free_block_queue, self.hybrid.mirror.holds
        ret: list[KVCacheBlock] = []
        skipped: list[KVCacheBlock] = []
        batch = head
        while True:  # each batch is the shortfall, so exactly the blocks one-at-a-time pops
            for block in batch:
                if not holds(block.block_id):
                    ret.append(block)
                elif take_cached > 0:
                    take_cached -= 1
                    ret.append(block)
                else:
                    skipped.append(block)
            if len(ret) >= num_blocks:
                break
            batch = queue.popleft_n(num_blocks - len(ret))
        queue.append_n(skipped)
        return ret

    # ---------------------------------------------------------------- debug checks
    def hy_check_integrity(self) -> None:
        """The mirror's invariants, and mirror == vLLM's hash map and free queue (O(pool);
        ``pool_checks.py``)."""
        check_pool(self, self.hybrid, self._hy_is_free)


def install(pool: BlockPool, mirror: PrefixIndex) -> HybridBlockPool:
    """Swap ``pool``'s class to :class:`HybridBlockPool` and give it a fresh
    :class:`~vllm_hybrid.adapters.vllm.state.HybridState` (``pool.hybrid``); the pool must be
    vLLM's own, with prefix caching on and no cached block yet. TypeError for another pool
    class, ValueError for a used pool, UnsupportedVLLMVersion on another vLLM release."""
    if type(pool) is not BlockPool:
        raise TypeError(f"expected vLLM's BlockPool, got {type(pool).__name__}")
    if len(pool.cached_block_hash_to_block) or not pool.enable_caching:
        raise ValueError("install on a fresh pool with prefix caching enabled")
    groups = mirror.kv_groups | mirror.state_groups
    state = HybridState(
        mirror=mirror,
        pages=PageCounts(mirror.kv_groups, mirror.state_groups),
        group_of={g.to_bytes(4, "big", signed=False): g for g in groups},
    )
    if not swap_pool_class(pool, HybridBlockPool):
        raise UnsupportedVLLMVersion("the hybrid block pool runs on vLLM 0.32.0 only")
    hybrid: HybridBlockPool = pool  # type: ignore[assignment]
    hybrid.hybrid = state
    mirror.use_free_events(b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
    return hybrid
