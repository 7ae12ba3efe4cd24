"""vLLM general plugin (entry point ``vllm.general_plugins: vllm_hybrid``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers;
``vllm/plugins/__init__.py::load_general_plugins``), possibly more than once, so everything here
is idempotent and cheap when there is nothing to do.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_hybrid.adapters.vllm.version import check_vllm_version

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

    carry_hybrid_stats()
    from vllm.platforms import current_platform

    from vllm_hybrid.adapters.vllm.kv_copy import patch_kv_cache_block_copies

    patch_kv_cache_block_copies()  # device-agnostic: every platform (docs/serving.md)
    if current_platform.is_cpu():
        from vllm_hybrid.adapters.vllm.cpu_mamba2 import patch_cpu_mamba2_prefix_caching

        patch_cpu_mamba2_prefix_caching()
    select_hybrid_scheduler()
    select_host_tier_connector()


def share_vllm_logging() -> None:
    """Print our log lines the way vLLM prints its own: the ``vllm_hybrid`` logger gets the
    handlers and level vLLM configured on its ``vllm`` logger (``vllm/logger.py``), unless the
    application configured ours itself. Records still propagate (to pytest's capture, say).
    vLLM configures logging when it builds the engine's config, after plugins load, so this
    runs when the scheduler starts (``scheduler.py::activate``)."""
    ours, theirs = logging.getLogger("vllm_hybrid"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.level)


def select_hybrid_scheduler() -> bool:
    """Make our schedulers vLLM's default: where no ``scheduler_cls`` is configured,
    ``SchedulerConfig.get_scheduler_cls`` (``vllm/config/scheduler.py``, called once by
    ``EngineCore.__init__``) returns ``HybridAsyncScheduler`` or ``HybridScheduler`` (matching
    ``async_scheduling``) instead of vLLM's. They stay vLLM's own schedulers unless the model is
    a hybrid with prefix caching on (``scheduler.py::activate``). An explicit
    ``--scheduler-cls`` is left alone. Idempotent; refused on another vLLM version."""
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls
    if getattr(original, "_vllm_hybrid", False):
        return True
    if not check_vllm_version("automatic scheduler selection"):
        return False

    def get_scheduler_cls(self: SchedulerConfig) -> type:
        if self.scheduler_cls is None:
            from vllm_hybrid.adapters.vllm import scheduler

            return (
                scheduler.HybridAsyncScheduler
                if self.async_scheduling
                else scheduler.HybridScheduler
            )
        return original(self)

    get_scheduler_cls._vllm_hybrid = True  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls  # type: ignore[method-assign]
    return True


def select_host_tier_connector() -> bool:
    """Let ``host_tier_gb`` turn the host tier on by itself: ``EngineArgs.create_engine_config``
    (``vllm/engine/arg_utils.py``; ``LLM`` and ``vllm serve`` build their config with it, after
    this plugin was loaded by ``EngineArgs.__post_init__``) first fills in our connector
    (``config.py::configure_host_tier``). Host tier off: the args are left as they are.
    Idempotent; refused on another vLLM version."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_vllm_hybrid", False):
        return True
    if not check_vllm_version("the host tier's connector"):
        return False

    def create_engine_config(self: EngineArgs, *args: Any, **kwargs: Any) -> Any:
        from vllm_hybrid.adapters.vllm.config import configure_host_tier

        configure_host_tier(self)
        return original(self, *args, **kwargs)

    create_engine_config._vllm_hybrid = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    return True
