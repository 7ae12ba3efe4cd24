"""The worker's copy of copy-on-write KV blocks, through every KV cache view (every platform).

A partial prefix hit (a hit inside a block) makes the scheduler copy that attention block into
a private one before the request appends to it (``KVCacheBlockCopy`` pairs). vLLM 0.32.0's
worker applies them with ``copy_kv_cache_blocks_inplace`` (vllm/v1/worker/utils.py), called
from ``GPUModelRunner._update_states`` (vllm/v1/worker/gpu_model_runner.py; the CPU runner
inherits it) and from the v2 runner (vllm/v1/worker/gpu/model_runner.py). It visits each view
once per ``data_ptr``. Both runners get their views from the same device-agnostic allocator
(``allocate_kv_cache``, vllm/v1/worker/utils.py): one backing buffer, one logical
``[blocks, H, N, C]`` view per layer, KV cache groups overlaid from byte 0, so layer ``i`` of
every group starts at the same address. With a layer-outermost layout (``LB*``, the default
on CPU and with FlashAttention/FlashInfer on GPU) the backing buffer is larger than
``num_blocks`` pages, so vLLM copies through the views; on Nemotron-H (layer 0 is Mamba) the
first view at an address is a Mamba state view (only ``MambaSpec.real_page_size_bytes`` of
each page) and the attention view behind it is skipped: the copied attention block stays
mostly zeros and greedy outputs differ from caching off. With a block-outermost layout
(``BL*``/``BH*``) the buffer is exactly ``num_blocks`` packed blocks and vLLM copies whole
blocks of it, which is correct.

``copy_kv_cache_blocks_every_view`` does what vLLM's function does, with one difference: a
view is skipped only when it is the very same view (device, address, dtype, shape and strides)
as one already copied. ``patch_kv_cache_block_copies`` installs it on the pinned vLLM release,
on every platform (``plugin.register``). It has run on CPU only; see docs/serving.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from vllm_hybrid.adapters.vllm.compat.patches import replace_kv_block_copy

logger = logging.getLogger("vllm_hybrid")

_PATCHED = False
#: vLLM's own ``copy_kv_cache_blocks_inplace``, kept once replaced (tests check it still errs).
VLLM_KV_CACHE_BLOCK_COPY: Any = None


def copy_kv_cache_blocks_every_view(
    kv_caches: Iterable[torch.Tensor], num_blocks: int, kv_cache_block_copies: Sequence[Any]
) -> None:
    """Copy scheduler blocks ``src -> dst`` in every distinct KV cache view; drop-in for
    ``copy_kv_cache_blocks_inplace`` (vllm/v1/worker/utils.py, vLLM 0.32.0), same signature.

    As in vLLM: dim 0 of a view counts kernel blocks, a whole number per scheduler block (the
    runners' views are ``allocate_kv_cache``'s logical ``[B, H, N, C]`` views, blocks first on
    every layout and backend); a view whose backing storage is exactly ``num_blocks`` of its
    scheduler blocks is copied as whole storage rows, once per storage. Unlike vLLM, any other
    view is copied unless the very same view was (so a Mamba view no longer hides the
    attention view at its address). And the pairs are applied **in order**: vLLM's batched
    ``blocks[dst] = blocks[src]`` reads every source before it writes any destination, but the
    scheduler's list is a sequence. Two requests that partially hit the same prefix in one step
    give a chain: the first one's CoW fills a fresh block ``x`` (``a -> x``), the full block it
    then computes is cached under its hash, and the second request's partial hit on ``x`` is
    copied from it (``x -> y``), so ``y`` must receive ``a``'s contents, not the stale bytes
    ``x`` held before this step (a request resuming in the same step as its own extension, which
    the scheduler ran first, answered wrongly: tests/engine/test_partial_hits.py). The list is
    cut into runs in which no block is both read and written (``_hazard_free_runs``); each
    run is copied through every view before the next, so within a run a view's writes touch
    no byte another view reads.
    """
    if not kv_cache_block_copies:
        return
    pairs = [(int(copy[0]), int(copy[1])) for copy in kv_cache_block_copies]
    seen: set[tuple[Any, ...]] = set()
    views = []
    for cache in kv_caches:
        if not isinstance(cache, torch.Tensor) or cache.numel() == 0:
            continue
        blocks = _scheduler_blocks(cache, num_blocks, seen)
        if blocks is not None:
            views.append(blocks)
    for run in _hazard_free_runs(pairs):
        index_cpu = torch.tensor(run, dtype=torch.long)
        index_on: dict[torch.device, torch.Tensor] = {}
        for blocks in views:
            index = index_on.get(blocks.device)
            if index is None:
                index = index_on[blocks.device] = _index_on(index_cpu, blocks.device)
            blocks[index[:, 1]] = blocks[index[:, 0]]


def _hazard_free_runs(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``pairs`` cut, in order, into runs in which no block is written twice or both read and
    written, so one batched copy of a run equals copying its pairs one by one (a self-copy is
    dropped). Scheduler CoW destinations are fresh blocks, so a step usually gives one run."""
    runs: list[list[tuple[int, int]]] = []
    run: list[tuple[int, int]] = []
    reads: set[int] = set()
    writes: set[int] = set()
    for src, dst in pairs:
        if src == dst:
            continue
        if src in writes or dst in reads or dst in writes:
            runs.append(run)
            run, reads, writes = [], set(), set()
        run.append((src, dst))
        reads.add(src)
        writes.add(dst)
    if run:
        runs.append(run)
    return runs


def _index_on(index_cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The copy pairs on ``device``: on an accelerator through a pinned buffer without
    blocking the host (vLLM's ``async_tensor_h2d``, vllm/utils/torch_utils.py, as vLLM's own
    copy does; the copy kernels that use it follow on the same stream); on CPU as they are."""
    if device.type == "cpu":
        return index_cpu
    from vllm.utils import torch_utils  # looked up at call time (the CPU worker patches it)

    return torch_utils.async_tensor_h2d(index_cpu, device=device)


def _scheduler_blocks(
    cache: torch.Tensor, num_blocks: int, seen: set[tuple[Any, ...]]
) -> torch.Tensor | None:
    """``cache`` with dim 0 counting scheduler blocks, or None when its bytes were already
    taken (the same storage copied whole, or the same view)."""
    per_block, rest = divmod(cache.shape[0], num_blocks)
    if rest:
        raise ValueError(
            f"a KV cache view of {cache.shape[0]} kernel blocks does not divide into "
            f"{num_blocks} scheduler blocks"
        )
    storage = cache.untyped_storage()
    block_bytes = cache.stride(0) * cache.element_size() * per_block
    if storage.nbytes() == num_blocks * block_bytes:  # vLLM's whole-storage branch
        key: tuple[Any, ...] = ("storage", cache.device, storage.data_ptr())
        if key in seen:
            return None
        seen.add(key)
        rows = torch.empty(0, dtype=torch.uint8, device=cache.device)
        rows.set_(storage)
        return rows.view(num_blocks, -1)
    key = ("view", cache.device, cache.data_ptr(), cache.dtype, cache.shape, cache.stride())
    if key in seen:
        return None
    seen.add(key)
    return cache.view(num_blocks, per_block, *cache.shape[1:])  # splits dim 0 only


def patch_kv_cache_block_copies() -> bool:
    """Make the worker copy partial-hit CoW blocks through every KV cache view; idempotent.

    Replaces ``copy_kv_cache_blocks_inplace`` in ``vllm.v1.worker.utils`` (runner modules
    imported later bind ours) and in any runner module already imported
    (``compat.replace_kv_block_copy``). Only on the pinned vLLM release; True when active.
    Device-agnostic: installed on every platform.
    """
    global _PATCHED, VLLM_KV_CACHE_BLOCK_COPY
    if _PATCHED:
        return True
    original = replace_kv_block_copy(copy_kv_cache_blocks_every_view)
    if original is None:
        return False
    VLLM_KV_CACHE_BLOCK_COPY = original
    _PATCHED = True
    logger.info(
        "vllm-hybrid: partial prefix hits copy their copy-on-write blocks through every KV "
        "cache view (vLLM 0.32.0's copy skips an attention view aliased by a Mamba one)"
    )
    return True
