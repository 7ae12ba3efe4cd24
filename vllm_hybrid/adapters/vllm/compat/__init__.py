"""The one place that touches vLLM 0.32.0's internals (and prometheus_client's).

Every private attribute or method of a vLLM object we read, call or override, every function
of vLLM we replace (a monkeypatch), every method rebound on an instance and the class swap of
vLLM's ``BlockPool`` live here, as small named functions and two hook classes; the rest of the
adapter uses vLLM's public classes and these names only. ``tests/adapters/test_compat.py``
holds one contract test per name (the attribute exists, its signature, its return shape,
against the installed vLLM) and the check that no module outside this package reaches a
private vLLM name; ``docs/compat.md`` lists each name with the vLLM file and function it
touches and why (a test keeps that table equal to :data:`__all__`).

The version gate (``adapters/vllm/version.py::check_vllm_version``): whatever changes vLLM's
behaviour (a patch, the class swap, the scheduler hooks, a toggle, an instance rebinding)
checks the installed release when it is installed and does nothing on another one (it returns
False or None and logs why). What is only reachable through something installed that way
(the block pool's helpers, called by the swapped-in pool) is not checked again. Readers of
the API server's state return a fallback where vLLM's attribute is missing.

Submodules: :mod:`.scheduler` (``Scheduler``, ``KVCacheCoordinator``, ``MambaManager``),
:mod:`.block_pool` (``BlockPool``), :mod:`.patches` (module-level functions and config
methods replaced), :mod:`.server` (the OpenAI server's ``app.state``). They are imported
lazily, so ``register()`` in vLLM's API server process loads no scheduler code.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Every name of the layer, with the submodule that defines it.
WHERE = {
    "SchedulerHooks": "scheduler",
    "skip_split_hook": "scheduler",
    "set_retention_interval": "scheduler",
    "enable_exact_stops": "scheduler",
    "replace_cache_blocks": "scheduler",
    "observe_prefix_lookups": "scheduler",
    "HookedBlockPool": "block_pool",
    "swap_pool_class": "block_pool",
    "cache_block_key": "block_pool",
    "drop_cached_hashes": "block_pool",
    "evict_cached_block": "block_pool",
    "notify_reuse": "block_pool",
    "observe_hash_removals": "block_pool",
    "install_scheduler_selector": "patches",
    "wrap_engine_config": "patches",
    "declare_scheduler_stats_field": "patches",
    "replace_cpu_mamba2_ops": "patches",
    "replace_kv_block_copy": "patches",
    "flatten_cpu_rotary_inputs": "patches",
    "cpu_rotary_flattened": "patches",
    "replace_cpu_gdn_attention_core": "patches",
    "forward_context_layer": "patches",
    "replace_olmo_gdn_forward_core": "patches",
    "keep_mid_block_mamba_states_unhashed": "scheduler",
    "import_qwen3_5_without_torchvision": "patches",
    "replace_cpu_selective_scan": "patches",
    "replace_mamba1_state_update": "patches",
    "contiguous_mamba1_out_proj_inputs": "patches",
    "server_vllm_config": "server",
    "server_args": "server",
    "anthropic_merge_inline_system": "server",
}

__all__ = sorted(WHERE)


def __getattr__(name: str) -> Any:
    """Import the submodule defining ``name`` on first use."""
    module = WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
