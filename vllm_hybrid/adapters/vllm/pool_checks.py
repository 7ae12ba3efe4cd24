"""The hybrid pool's debug checks (``debug`` setting; the tests run them after every step):
the mirror's own invariants, and mirror == vLLM's hash map, free queue and page counts.
O(pool) per call. Written against vLLM 0.32.0's ``BlockPool`` public attributes
(``blocks``, ``cached_block_hashes_by_block``, ``cached_block_hash_to_block``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.core.kv_cache_utils import (
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
)

from vllm_hybrid.adapters.vllm.state import HybridState
from vllm_hybrid.core import KV, SNAPSHOT


def check_pool(pool: Any, state: HybridState, is_free: Callable[[int], bool]) -> None:
    """AssertionError naming the first disagreement between ``state`` and vLLM's ``pool``."""
    state.mirror.check_integrity(is_free)
    n_free = 0
    for block in pool.blocks:
        engine = engine_keys(pool, block)
        assert engine == state.mirror.keys_of(block.block_id), (
            f"mirror out of sync at block {block.block_id}: engine {engine}, "
            f"mirror {state.mirror.keys_of(block.block_id)}"
        )
        n_free += block.ref_cnt == 0 and not block.is_null
    assert n_free == pool.get_num_free_blocks(), "free queue != blocks with ref_cnt 0"
    check_page_counts(state)
    if state.host is not None:
        state.host.check_integrity()


def check_page_counts(state: HybridState) -> None:
    """``state.pages`` (metrics) agrees with the pages the mirror holds, by kind."""
    pages, mirror = state.pages, state.mirror
    pages.check_integrity()
    kinds = [
        pages.kind_of(g) for p in mirror.cached_pages() for g in {g for _, g in mirror.keys_of(p)}
    ]
    for kind in (KV, SNAPSHOT):
        assert kinds.count(kind) == pages.held(kind), f"{kind}: {pages!r}"


def engine_keys(pool: Any, block: KVCacheBlock) -> set[tuple[Any, int]]:
    """(block hash, group) of every key vLLM's map holds for ``block``."""
    keys: Iterable[BlockHashWithGroupId] = pool.cached_block_hashes_by_block.get(block.block_id, ())
    held = [*keys] + ([block.block_hash] if block.block_hash is not None else [])
    return {
        (get_block_hash(k), get_group_id(k))
        for k in held
        if pool.cached_block_hash_to_block.contain(k, block.block_id)
    }
