"""Reading the hybrid cache's settings, costs and KV cache layout out of vLLM's configuration
(vLLM 0.32.0).

Settings travel in ``VllmConfig.additional_config["vllm_hybrid"]``, vLLM's field for settings of
out-of-tree code (``vllm/config/vllm.py``); it reaches the engine core with the rest of the
config and enters vLLM's config hash. From the command line and Python::

    vllm serve MODEL --enable-prefix-caching \\
        --additional-config '{"vllm_hybrid": {"policy": "flop", "debug": false}}'
    LLM(MODEL, enable_prefix_caching=True,
        additional_config={"vllm_hybrid": {"policy": "flop"}})

The keys, their environment variables and defaults are in ``core/config.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from vllm_hybrid.core import (
    ConfigError,
    CostModel,
    HybridCacheConfig,
    load_shape,
    shape_name_for_model_type,
)

logger = logging.getLogger("vllm_hybrid")

SECTION = "vllm_hybrid"


def load_config(vllm_config: Any) -> HybridCacheConfig:
    """The validated settings of this engine; ConfigError (a ValueError) on a bad value."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    section = extra.get(SECTION) if isinstance(extra, dict) else None
    if section is not None and not isinstance(section, dict):
        raise ConfigError(
            f'additional_config["{SECTION}"] must be an object, got {type(section).__name__}'
        )
    return HybridCacheConfig.from_sources(section, os.environ)


def hybrid_groups(kv_cache_config: Any) -> tuple[list[int], list[int], set[int]] | None:
    """(full-attention group ids, Mamba group ids, block sizes) of a ``KVCacheConfig``
    (``vllm/v1/kv_cache_interface.py``), or None if a group has any other spec (sliding
    window, chunked local attention, cross attention, ...)."""
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


def pool_layout(scheduler: Any, hf_config: Any) -> dict[str, Any] | None:
    """An engine's KV pool as the simulator needs it (``bench/predict.py::PoolLayout``'s
    fields): blocks, block tokens, page bytes, group counts, model type; None unless it is one
    shared pool of full-attention and Mamba groups of one block size. ``scheduler``: vLLM's
    ``Scheduler`` (``kv_cache_config`` and ``kv_cache_manager.block_pool``)."""
    groups = hybrid_groups(scheduler.kv_cache_config)
    specs = [g.kv_cache_spec for g in scheduler.kv_cache_config.kv_cache_groups]
    pages = {s.page_size_bytes for s in specs}
    if groups is None or len(pages) != 1 or len(groups[2]) != 1:
        return None
    kv, state, sizes = groups
    return {
        "blocks": int(scheduler.kv_cache_manager.block_pool.num_gpu_blocks),
        "block_tokens": int(sizes.pop()),
        "page_bytes": int(pages.pop()),
        "kv_groups": len(kv),
        "state_groups": len(state),
        "model_type": str(getattr(hf_config, "model_type", "")),
    }


def is_attention_mamba_hybrid(kv_cache_config: Any) -> bool:
    """Full-attention and Mamba groups, at least one of each, and nothing else."""
    groups = hybrid_groups(kv_cache_config)
    return groups is not None and bool(groups[0]) and bool(groups[1])


def is_full_attention(manager: Any) -> bool:
    """vLLM's ``FullAttentionManager`` (``vllm/v1/core/single_type_kv_cache_manager.py``;
    by name, not a subclass: the append-only KV that partial prefix-cache entries suit)."""
    return type(manager).__name__ == "FullAttentionManager"


def engine_cost_model(
    config: HybridCacheConfig,
    vllm_config: Any,
    kv_cache_config: Any,
    block_tokens: int,
    kv_groups: Sequence[int],
    state_groups: Sequence[int],
) -> CostModel:
    """FLOPs from the model's shape (``config.shape``; ``auto`` picks a shipped shape by the
    HF ``model_type``), bytes as the pool holds them: one page per group, so a block's KV is
    ``len(kv_groups)`` pages and a snapshot ``len(state_groups)`` pages of the pool's size."""
    name = config.shape
    if name == "auto":
        model_type = getattr(vllm_config.model_config.hf_config, "model_type", "")
        name = shape_name_for_model_type(model_type)
    shape = load_shape(name)
    groups = kv_cache_config.kv_cache_groups
    kv_page = sum(groups[g].kv_cache_spec.page_size_bytes for g in kv_groups)
    state_page = sum(groups[g].kv_cache_spec.page_size_bytes for g in state_groups)
    cost = CostModel.from_pages(shape, block_tokens, kv_page, state_page)
    logger.info(
        "vllm-hybrid: cost model: FLOPs of shape %s, bytes held: KV %d B/token, snapshot %d B",
        shape.name,
        cost.kv_bytes_per_token,
        cost.snapshot_bytes,
    )
    return cost


def configure_host_tier(engine_args: Any) -> None:
    """With ``host_tier_gb > 0`` (``additional_config["vllm_hybrid"]`` or the environment),
    select our host-tier connector in ``engine_args.kv_transfer_config`` before vLLM builds its
    config (``EngineArgs.create_engine_config``, which both ``LLM`` and ``vllm serve`` call).
    Refuses (ConfigError) if the user selected another KV connector or vLLM's KV offloading:
    vLLM has one connector slot. Host tier off: nothing changes."""
    extra = getattr(engine_args, "additional_config", None) or {}
    section = extra.get(SECTION) if isinstance(extra, dict) else None
    if section is not None and not isinstance(section, dict):
        return  # load_config refuses it in the engine, with its message
    config = HybridCacheConfig.from_sources(section, os.environ)
    if config.host_tier_bytes <= 0 or not config.enabled:
        return
    from vllm.config.kv_transfer import KVTransferConfig

    from vllm_hybrid.adapters.vllm.host_connector import BYTES_KEY, CONNECTOR_NAME, MODULE_PATH

    current = engine_args.kv_transfer_config
    name = (
        current.get("kv_connector")
        if isinstance(current, dict)
        else (getattr(current, "kv_connector", None))
    )
    if name is not None and name != CONNECTOR_NAME:
        raise ConfigError(
            f"vllm_hybrid: host_tier_gb {config.host_tier_gb:g} needs vLLM's KV connector slot "
            f"for {CONNECTOR_NAME}, but --kv-transfer-config already selects {name}; "
            "set host_tier_gb to 0 or drop the other connector"
        )
    if getattr(engine_args, "kv_offloading_size", None) is not None:
        raise ConfigError(
            f"vllm_hybrid: host_tier_gb {config.host_tier_gb:g} cannot run with "
            "--kv-offloading-size (vLLM's offloading connector takes the one connector slot); "
            "set host_tier_gb to 0 or drop --kv-offloading-size"
        )
    engine_args.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role="kv_consumer",  # it only brings states back; no producer-side hand-off paths
        kv_connector_module_path=MODULE_PATH,
        kv_connector_extra_config={BYTES_KEY: config.host_tier_bytes},
    )
    logger.info("vllm-hybrid: host tier of %g GB: %s selected", config.host_tier_gb, CONNECTOR_NAME)


def configure_match_unit(engine_args: Any, vllm_config: Any) -> None:
    """Give a hybrid engine our prefix match unit (``match_unit``, default ``auto``: 1 token)
    when the user set none (``--prefix-match-unit`` / ``prefix_match_unit=``), on the config
    ``EngineArgs.create_engine_config`` just built and before the engine core reads it
    (``EngineCore._initialize_kv_caches`` -> ``kv_cache_utils.resolve_kv_cache_block_sizes``,
    which takes it as the hash block size when there are several KV cache groups and every
    Mamba group is in align mode, and backs off to the block otherwise). vLLM leaves it out of
    the config hash (``CacheConfig.compute_hash``). Only for hybrids (``ModelConfig.is_hybrid``)
    with prefix caching on and Mamba cache mode ``align``: a one-group model refuses a unit
    below its block. Bad settings fail later, in the engine, with load_config's message."""
    cache = getattr(vllm_config, "cache_config", None)
    model = getattr(vllm_config, "model_config", None)
    if cache is None or model is None or not cache.enable_prefix_caching:
        return
    extra = getattr(engine_args, "additional_config", None) or {}
    section = extra.get(SECTION) if isinstance(extra, dict) else None
    if section is not None and not isinstance(section, dict):
        return
    try:
        config = HybridCacheConfig.from_sources(section, os.environ)
    except ConfigError:
        return  # the engine refuses it with the message (load_config)
    hybrid_align = bool(model.is_hybrid) and cache.mamba_cache_mode == "align"
    unit = config.engine_match_unit(getattr(engine_args, "prefix_match_unit", None), hybrid_align)
    if unit is None:
        return
    cache.prefix_match_unit = unit
    logger.info(
        "vllm-hybrid: prefix match unit %d token(s) for this hybrid (hits resume at any "
        "multiple of it; set --prefix-match-unit or match_unit to choose another)",
        unit,
    )
