"""vLLM 0.32.0's ``BlockPool`` internals (``vllm/v1/core/block_pool.py``): the two private
methods every change of the prefix-cache hash map goes through, turned into hooks; the private
helpers an eviction needs; and the class swap that installs a subclass on vLLM's pool."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    BlockHashWithGroupId,
    KVCacheBlock,
    make_block_hash_with_group_id,
)

from vllm_hybrid.adapters.vllm.version import check_vllm_version


class HookedBlockPool(BlockPool):
    """vLLM's ``BlockPool`` that announces every change of its hash map. In vLLM 0.32.0 every
    insertion goes through ``_insert_block_hash`` (from ``cache_full_blocks``,
    ``cache_partial_block``, ``move_block_hashes``) and every removal through
    ``_remove_cached_block_hashes`` (from ``_maybe_evict_cached_block``, ``evict_blocks``,
    ``move_block_hashes``); after vLLM's own work each calls a hook (defaults do nothing).
    Never constructed: :func:`swap_pool_class` installs a subclass on vLLM's pool instance."""

    def on_hash_inserted(
        self, key: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int | None
    ) -> None:
        """``key`` was offered to vLLM's map for ``block`` (``num_tokens``: the tokens it
        covers, None from ``move_block_hashes``); vLLM skips a key ``block`` already holds."""

    def on_hashes_removed(self, block: KVCacheBlock, removed: list[BlockHashWithGroupId]) -> None:
        """``block`` lost every key (``removed``: those vLLM's map held for it)."""

    def _insert_block_hash(
        self,
        block_hash_with_group_id: BlockHashWithGroupId,
        block: KVCacheBlock,
        num_tokens: int | None,
    ) -> None:
        super()._insert_block_hash(block_hash_with_group_id, block, num_tokens)
        self.on_hash_inserted(block_hash_with_group_id, block, num_tokens)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        removed = super()._remove_cached_block_hashes(block)
        self.on_hashes_removed(block, removed)
        return removed

    def cache_partial_block(
        self,
        request: Any,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> BlockHashWithGroupId | None:
        """vLLM's, minus its no-op: with a prefix match unit below the block,
        ``FullAttentionManager._cache_partial_tail_block`` re-registers the prompt tail's entry
        at every step of every running request. When ``block`` already holds the key and
        nothing is replaced, vLLM's call inserts nothing (``_insert_block_hash`` returns on a
        held key) and emits nothing (``already_cached``), so it is skipped here with the same
        return value, and the hooks do not hear of it."""
        if not replace_existing_hashes and not block.is_null:
            key = make_block_hash_with_group_id(
                request.block_hashes[num_tokens // self.hash_block_size - 1], kv_cache_group_id
            )
            if block.block_hash == key or self.cached_block_hash_to_block.contain(
                key, block.block_id
            ):
                return key
        return super().cache_partial_block(
            request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes
        )


def swap_pool_class(pool: BlockPool, cls: type[HookedBlockPool]) -> bool:
    """Make ``pool`` (vLLM's own ``BlockPool``, exactly) an instance of ``cls``, keeping every
    attribute vLLM set in ``BlockPool.__init__``. The one pool ``KVCacheCoordinator.__init__``
    shares between all groups is referenced by the ``KVCacheManager``, the coordinator and each
    ``SingleTypeKVCacheManager``, so a swap reaches all of them where a new pool would not.
    TypeError for another pool class; False (nothing swapped) on another vLLM release."""
    if type(pool) is not BlockPool:
        raise TypeError(f"expected vLLM's BlockPool, got {type(pool).__name__}")
    if not issubclass(cls, HookedBlockPool):
        raise TypeError(f"{cls.__name__} is not a HookedBlockPool")
    if not check_vllm_version("the hybrid block pool"):
        return False
    pool.__class__ = cls
    return True


def cache_block_key(
    pool: BlockPool, key: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int
) -> None:
    """Register ``block`` under ``key`` in the prefix cache, as ``cache_full_blocks`` does for
    one full block (``BlockPool._insert_block_hash``; ``num_tokens``: the tokens it covers).
    On a :class:`HookedBlockPool` the insertion hook runs as for any other."""
    pool._insert_block_hash(key, block, num_tokens)


def drop_cached_hashes(pool: BlockPool, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
    """Drop every prefix-cache key of ``block`` and emit vLLM's ``BlockRemoved`` events, as
    ``BlockPool._maybe_evict_cached_block`` does, without its metrics call (which
    ``get_new_blocks`` makes when the block is handed out). Returns the keys removed."""
    removed = pool._remove_cached_block_hashes(block)
    if removed:
        pool._emit_block_removed_events(removed)  # a no-op unless KV events are enabled
    return removed


def evict_cached_block(pool: BlockPool, block: KVCacheBlock) -> bool:
    """``BlockPool._maybe_evict_cached_block``: drop ``block``'s keys (metrics and events as
    vLLM does); True if it held any."""
    return bool(pool._maybe_evict_cached_block(block))


def notify_reuse(pool: BlockPool, blocks: Iterable[KVCacheBlock]) -> None:
    """What ``BlockPool.get_new_blocks`` does for blocks released by ``unpin_blocks``: call and
    forget the reuse watcher of each handed-out block (``_reuse_watchers``, ``_notify_reuse``)."""
    if pool._reuse_watchers:
        pool._notify_reuse(blocks)


def observe_hash_removals(
    pool: BlockPool, observe: Callable[[KVCacheBlock, list[BlockHashWithGroupId]], None]
) -> bool:
    """Wrap ``BlockPool._remove_cached_block_hashes(block)`` on one pool instance so that
    ``observe(block, keys)`` hears of every key a block loses, with the keys it held before
    (``cached_block_hashes_by_block`` and ``block_hash``), after vLLM removed them; a call that
    removes nothing is not reported. For test harnesses on a pool that is not ours
    (``testing/parity.py``: the eviction log of vLLM's own cache). False (nothing wrapped) on
    another vLLM release."""
    if not check_vllm_version("hash-removal observer"):
        return False
    remove = pool._remove_cached_block_hashes

    def removed(block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        held = list(pool.cached_block_hashes_by_block.get(block.block_id, ()))
        if block.block_hash is not None and block.block_hash not in held:
            held.append(block.block_hash)
        out = remove(block)
        if out:
            observe(block, held)
        return out

    pool._remove_cached_block_hashes = removed  # type: ignore[method-assign]
    return True
