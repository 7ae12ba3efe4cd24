"""Tiny random-weight checkpoints of real hybrid architectures, built offline.

- :func:`build_model` / ``python -m vllm_hybrid.testing.make_model``: build a checkpoint
  (config, safetensors weights, a locally trained tokenizer with a chat template).
- :data:`ARCHS`: the supported architectures and whether vLLM's CPU backend runs them.
- :func:`tiny_model_dir`: build-once helper for session-scoped pytest fixtures.

Importing this package does not import torch or transformers; the functions do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_hybrid.testing.archs import ARCHS, ArchSpec, cpu_archs, get_arch

if TYPE_CHECKING:
    from vllm_hybrid.testing.fixtures import tiny_model_dir
    from vllm_hybrid.testing.make_model import build_model

__all__ = ["ARCHS", "ArchSpec", "build_model", "cpu_archs", "get_arch", "tiny_model_dir"]


def __getattr__(name: str) -> Any:
    """Import the torch-dependent helpers lazily."""
    if name == "build_model":
        from vllm_hybrid.testing.make_model import build_model

        return build_model
    if name == "tiny_model_dir":
        from vllm_hybrid.testing.fixtures import tiny_model_dir

        return tiny_model_dir
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
