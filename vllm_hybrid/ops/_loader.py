"""Loads the compiled extension on first use and explains how to build it when it is missing.

``import vllm_hybrid`` and ``import vllm_hybrid.ops`` never need the extension; only calling an
op does (DESIGN.md rule 7).
"""

from __future__ import annotations

import functools
from typing import Any

BUILD_HINT = (
    "vllm_hybrid's compiled ops are not built. Build them with `bash scripts/install.sh` "
    "(or `pip install --no-build-isolation -e .` in an environment that already has torch), "
    "then retry."
)


class MissingExtensionError(RuntimeError):
    """Raised when an op is called but ``vllm_hybrid._C`` could not be imported."""


@functools.cache
def _load() -> Any:
    import torch

    try:
        import vllm_hybrid._C  # noqa: F401  (registers torch.ops.vllm_hybrid.*)
    except ImportError as exc:
        raise MissingExtensionError(f"{BUILD_HINT} (import error: {exc})") from exc
    return torch.ops.vllm_hybrid


def extension_available() -> bool:
    """True when the compiled ops can be loaded."""
    try:
        _load()
    except MissingExtensionError:
        return False
    return True


def op(name: str) -> Any:
    """Return ``torch.ops.vllm_hybrid.<name>``, loading the extension on first use."""
    return getattr(_load(), name)
