"""vLLM general plugin (entry point ``vllm.general_plugins: vllm_hybrid``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers;
``vllm/plugins/__init__.py::load_general_plugins``), possibly more than once, so everything here
is idempotent and cheap when there is nothing to do.
"""

from __future__ import annotations

import logging
import os

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
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm_hybrid.adapters.vllm.cpu_mamba2 import patch_cpu_mamba2_prefix_caching

        patch_cpu_mamba2_prefix_caching()
