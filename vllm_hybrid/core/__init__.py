"""The core: prefix index, policies, cost model, simulator-side state (no torch, no vLLM)."""

from vllm_hybrid.core import _native  # noqa: F401  (compiled or source: decided before any import)
