"""``HybridBlockPool``: vLLM's ``BlockPool`` with eviction victims chosen by a core policy.

Written against vLLM 0.32.0, ``vllm/v1/core/block_pool.py``. The pool is installed by class swap
on the one ``BlockPool`` that ``KVCacheCoordinator.__init__`` (``kv_cache_coordinator.py``)
shares between all KV cache groups; :func:`install` does it right after the scheduler is built,
while the pool holds no cached block yet. What is overridden and why:

* ``_insert_block_hash`` / ``_remove_cached_block_hashes``: every change of vLLM's hash map goes
  through these two (``cache_full_blocks``, ``cache_partial_block``, ``move_block_hashes``,
  ``_maybe_evict_cached_block``, ``evict_blocks``); we mirror it into a
  :class:`~vllm_hybrid.core.pool_mirror.PoolMirror`. ``cache_full_blocks`` and
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
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

from vllm_hybrid.core.cache_stats import KV, SNAPSHOT, PageCounts
from vllm_hybrid.core.feed import RequestFeed
from vllm_hybrid.core.host_ledger import HostLedger
from vllm_hybrid.core.pool_mirror import PoolMirror, VictimStats

logger = logging.getLogger("vllm_hybrid")


class HybridBlockPool(BlockPool):
    """Never constructed directly: :func:`install` swaps the class of vLLM's pool instance."""

    _hy_mirror: PoolMirror
    _hy_group_of: dict[bytes, int]  # the last 4 bytes of a BlockHashWithGroupId -> group id
    _hy_request: Any
    _hy_quiet: bool
    hy_policy_pages: int
    hy_fallback_pages: int
    hy_evict_calls: int
    hy_budget_pages: int  # pages dropped for the snapshot budget (max_snapshot_fraction)
    hy_pages: PageCounts  # pages cached / evicted by kind, for metrics.py
    hy_feed: RequestFeed | None  # set by the scheduler's activate()
    hy_debug: bool
    hy_block_bytes: int  # bytes of one block in all groups (for the byte gauges)
    hy_origin: dict[str, int]  # request id -> its index in the feed, while it runs
    hy_host: HostLedger | None  # the host tier, if on (set by the scheduler's activate())
    #: the cache control's and end-of-output states' counters for /metrics (set by the
    #: scheduler; ``metrics.hybrid_totals``), None without either
    hy_extra_totals: Callable[[], dict[str, float]] | None
    _hy_promoted: list[KVCacheBlock]  # blocks of this step's promotions, held until shipped

    # ---------------------------------------------------------------- mirroring the hash map
    def cache_full_blocks(self, request: Any, *args: Any, **kwargs: Any) -> None:
        self._hy_request = request
        try:
            super().cache_full_blocks(request, *args, **kwargs)
        finally:
            self._hy_request = None

    def cache_partial_block(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._hy_request = request
        try:
            return super().cache_partial_block(request, *args, **kwargs)
        finally:
            self._hy_request = None

    def _insert_block_hash(
        self,
        block_hash_with_group_id: BlockHashWithGroupId,
        block: KVCacheBlock,
        num_tokens: int | None,
    ) -> None:
        super()._insert_block_hash(block_hash_with_group_id, block, num_tokens)
        if self._hy_quiet:
            return
        request = self._hy_request
        if request is None or num_tokens is None:
            raise RuntimeError("vllm-hybrid: a block hash was inserted outside a known caller")
        # get_group_id through a table of the groups' 4-byte suffixes (an unknown group falls
        # back to vLLM's decoding, and the mirror refuses it)
        group = self._hy_group_of.get(block_hash_with_group_id[-4:])
        if group is None:
            group = get_group_id(block_hash_with_group_id)
        newly_cached = self._hy_mirror.add(
            block.block_id,
            get_block_hash(block_hash_with_group_id),
            group,
            num_tokens,
            self._hy_parent_key(request, num_tokens),
            self.hy_origin.get(request.request_id, -1),
        )
        if newly_cached:
            self.hy_pages.on_cached(group)

    def _hy_parent_key(self, request: Any, end: int) -> Any:
        b = self._hy_mirror.block_tokens
        parent_end = end - b if end % b == 0 else end // b * b
        if parent_end <= 0:
            return None
        return request.block_hashes[parent_end // self.hash_block_size - 1]

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        removed = super()._remove_cached_block_hashes(block)
        if not self._hy_quiet:
            dropped = self._hy_mirror.drop_page(block.block_id)
            if dropped:
                for group in {g for _, g in dropped}:
                    self.hy_pages.on_dropped(group)
        return removed

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        self._hy_quiet = True
        try:
            super().move_block_hashes(src_block, dst_block)
        finally:
            self._hy_quiet = False
        self._hy_mirror.move_page(src_block.block_id, dst_block.block_id)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().touch(blocks)
        self._hy_mirror.touch_pages([b.block_id for b in blocks if not b.is_null])

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        if done:
            self._hy_mirror.clear()
            self.hy_pages.on_reset()
            if self.hy_host is not None:
                self.hy_host.clear()
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
        host = self.hy_host
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
        self._hy_request = request
        try:  # as cache_full_blocks caches a full block: its hash, num_tokens = its end
            for group, block in zip(groups, blocks, strict=True):
                key = make_block_hash_with_group_id(node.key, group)  # type: ignore[arg-type]
                self._insert_block_hash(key, block, end)
        finally:
            self._hy_request = None
        self._hy_promoted.extend(blocks)
        return True

    def hy_release_promoted(self) -> None:
        """Drop our hold on this step's promoted blocks (the scheduler calls it after
        ``schedule()``: the copies are in the step's connector metadata). A block whose request
        was scheduled keeps that request's reference; the others become free cached states."""
        if self._hy_promoted:
            blocks, self._hy_promoted = self._hy_promoted, []
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
        mirror = self._hy_mirror
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
        mirror = self._hy_mirror
        mirror.pages_freed(
            [b.block_id for b in blocks if not b.ref_cnt and (b.pool is self or b.pool is None)]
        )
        if mirror.snapshot_budget_pages is not None and mirror.snapshot_excess():
            self._hy_enforce_snapshot_budget()

    def _hy_enforce_snapshot_budget(self) -> None:
        """Released pages took the free snapshots over ``max_snapshot_fraction`` of the pool:
        drop the policy's lowest units holding states at once (``PoolMirror.
        pick_snapshot_victims``), as an eviction would, so the budget holds after every
        release; the pages become free uncached blocks at the head of the queue."""
        mirror = self._hy_mirror
        excess = mirror.snapshot_excess()
        pages = mirror.pick_snapshot_victims(excess, self._hy_is_free)
        self._hy_drop_victims(pages)
        self.hy_budget_pages += len(pages)
        logger.debug(
            "vllm-hybrid: snapshot budget: %d pages dropped for %d free state pages over %d",
            len(pages),
            excess,
            mirror.snapshot_budget_pages,
        )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """As vLLM's, but cached blocks are reused in the policy's order, not LRU order."""
        queue, mirror = self.free_block_queue, self._hy_mirror
        n_free = queue.num_free_blocks
        if num_blocks > n_free:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        uncached = n_free - mirror.free_pages()
        if num_blocks > uncached:
            self._hy_evict(num_blocks - uncached)
            uncached = queue.num_free_blocks - mirror.free_pages()
        # Uncached blocks first (vLLM keeps them, and our victims, at the head of the queue),
        # cached ones in LRU order only as a fallback (counted in hy_fallback_pages).
        take_cached = max(0, num_blocks - uncached)
        self.hy_fallback_pages += take_cached
        ret = queue.popleft_n(num_blocks)
        ids = [block.block_id for block in ret]
        if not mirror.cached.isdisjoint(ids):
            ret = self._hy_pop_rest(ret, num_blocks, take_cached)
            ids = [block.block_id for block in ret]
        if self._reuse_watchers:
            self._notify_reuse(ret)
        collector = self.metrics_collector
        by_block = self.cached_block_hashes_by_block
        for block in ret:  # as vLLM's get_new_blocks with caching on
            # _maybe_evict_cached_block is a no-op on a block without hashes (the policy's
            # victims lost theirs in _hy_evict) unless a metrics collector wants to hear of it.
            if collector or block.block_hash is not None or block.block_id in by_block:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
            if collector:
                collector.on_block_allocated(block)
        mirror.pages_used(ids)
        return ret

    def _hy_evict(self, shortfall: int) -> None:
        """Drop the hashes of the policy's victims and move them to the head of the queue."""
        logging_on = logger.isEnabledFor(logging.DEBUG)
        if logging_on:  # only the debug line needs the counts from before
            stats_before = dataclasses.replace(self._hy_mirror.stats)
            evicted_before = (self.hy_pages.evicted[KV], self.hy_pages.evicted[SNAPSHOT])
        victims = self._hy_mirror.pick_victims(shortfall, self._hy_is_free)
        self._hy_drop_victims(victims)
        self.hy_policy_pages += len(victims)
        self.hy_evict_calls += 1
        if logging_on:
            self._hy_log_batch(shortfall, len(victims), evicted_before, stats_before)

    def _hy_drop_victims(self, pages: list[int]) -> None:
        """Drop the victims' hashes as ``_maybe_evict_cached_block`` does (minus the metrics
        call that ``get_new_blocks`` makes) and move them to the head of the free queue."""
        queue, blocks = self.free_block_queue, self.blocks
        victims = [blocks[p] for p in pages]
        events = self.enable_kv_cache_events
        for block in victims:
            removed = self._remove_cached_block_hashes(block)
            if events:
                self._emit_block_removed_events(removed)
            queue.remove(block)
        queue.prepend_n(victims)

    def _hy_log_batch(
        self, shortfall: int, n_pages: int, evicted_before: tuple[int, int], before: VictimStats
    ) -> None:
        """One debug line per eviction batch: pages by kind and the victims' reasons."""
        now, ev = self._hy_mirror.stats, self.hy_pages.evicted
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
        queue, holds = self.free_block_queue, self._hy_mirror.holds
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
        """The mirror's invariants, and mirror == vLLM's hash map and free queue (O(pool))."""
        self._hy_mirror.check_integrity(self._hy_is_free)
        n_free = 0
        for block in self.blocks:
            engine = _engine_keys(self, block)
            assert engine == self._hy_mirror.keys_of(block.block_id), (
                f"mirror out of sync at block {block.block_id}: engine {engine}, "
                f"mirror {self._hy_mirror.keys_of(block.block_id)}"
            )
            n_free += block.ref_cnt == 0 and not block.is_null
        assert n_free == self.get_num_free_blocks(), "free queue != blocks with ref_cnt 0"
        self._hy_check_page_counts()
        if self.hy_host is not None:
            self.hy_host.check_integrity()

    def _hy_check_page_counts(self) -> None:
        """``hy_pages`` (metrics) agrees with the pages the mirror holds, by kind."""
        self.hy_pages.check_integrity()
        kinds = [
            self.hy_pages.kind_of(g)
            for p in self._hy_mirror.cached_pages()
            for g in {g for _, g in self._hy_mirror.keys_of(p)}
        ]
        for kind in (KV, SNAPSHOT):
            assert kinds.count(kind) == self.hy_pages.held(kind), f"{kind}: {self.hy_pages!r}"


def _engine_keys(pool: BlockPool, block: KVCacheBlock) -> set[tuple[Any, int]]:
    keys: Iterable[BlockHashWithGroupId] = pool.cached_block_hashes_by_block.get(block.block_id, ())
    held = [*keys] + ([block.block_hash] if block.block_hash is not None else [])
    return {
        (get_block_hash(k), get_group_id(k))
        for k in held
        if pool.cached_block_hash_to_block.contain(k, block.block_id)
    }


def install(pool: BlockPool, mirror: PoolMirror) -> HybridBlockPool:
    """Swap ``pool``'s class to :class:`HybridBlockPool`; the pool must hold no cached block."""
    if type(pool) is not BlockPool:
        raise TypeError(f"expected vLLM's BlockPool, got {type(pool).__name__}")
    if len(pool.cached_block_hash_to_block) or not pool.enable_caching:
        raise ValueError("install on a fresh pool with prefix caching enabled")
    pool.__class__ = HybridBlockPool
    hybrid: HybridBlockPool = pool  # type: ignore[assignment]
    hybrid._hy_mirror = mirror
    hybrid._hy_group_of = {
        g.to_bytes(4, "big", signed=False): g for g in mirror.kv_groups | mirror.state_groups
    }
    mirror.use_free_events(b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
    hybrid._hy_request = None
    hybrid._hy_quiet = False
    hybrid.hy_policy_pages = hybrid.hy_fallback_pages = hybrid.hy_evict_calls = 0
    hybrid.hy_budget_pages = 0
    hybrid.hy_pages = PageCounts(mirror.kv_groups, mirror.state_groups)
    hybrid.hy_feed = None
    hybrid.hy_debug = False
    hybrid.hy_block_bytes = 0
    hybrid.hy_origin = {}
    hybrid.hy_host = None
    hybrid.hy_extra_totals = None
    hybrid._hy_promoted = []
    return hybrid
