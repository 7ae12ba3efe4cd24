"""Build-once helpers for pytest fixtures that need a tiny model on disk.

Typical use in a ``conftest.py``::

    import pytest
    from vllm_hybrid.testing import cpu_archs, tiny_model_dir

    @pytest.fixture(scope="session")
    def zamba2_dir(tmp_path_factory):
        return tiny_model_dir("zamba2", tmp_path_factory.getbasetemp())

    # or one fixture over every arch that runs on vLLM CPU:
    @pytest.fixture(scope="session", params=cpu_archs())
    def hybrid_dir(request, tmp_path_factory):
        return tiny_model_dir(request.param, tmp_path_factory.getbasetemp())

``root`` is shared by all callers: each (arch, seed) gets its own sub-directory, built the first
time and reused afterwards (in the same session, or across sessions when ``root`` persists,
e.g. ``$VLLM_HYBRID_MODEL_CACHE``). Builds are locked, so pytest-xdist workers can share a root.
Engines need ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) on CPU, see :data:`ENGINE_ENV`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from vllm_hybrid.testing.make_model import build_model

#: Environment a vLLM CPU engine on a tiny model wants.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
#: Keyword arguments for ``vllm.LLM`` that the tiny models were checked with (fp32 equals HF).
ENGINE_KWARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 4096}


def engine_dtype(arch: str) -> str:
    """The dtype engine tests run ``arch`` at on CPU: float32 where vLLM's CPU backend runs
    it, else the first dtype it runs at (bfloat16 for the GDN families)."""
    from vllm_hybrid.testing.archs import get_arch

    dtypes = get_arch(arch).cpu_dtypes
    if not dtypes:
        raise ValueError(f"{arch} does not run on vLLM's CPU backend: {get_arch(arch).note}")
    return "float32" if "float32" in dtypes else dtypes[0]


def model_cache_root(default: str | os.PathLike[str]) -> Path:
    """``$VLLM_HYBRID_MODEL_CACHE`` if set (models persist across runs), else ``default``."""
    return Path(os.environ.get("VLLM_HYBRID_MODEL_CACHE") or default)


def tiny_model_dir(
    arch: str, root: str | os.PathLike[str], seed: int = 0, dtype: str = "float32"
) -> Path:
    """Path of the tiny ``arch`` model under ``root``, building it on first use."""
    suffix = "" if dtype == "float32" else f"-{dtype}"
    return build_model(arch, Path(root) / f"{arch}-tiny-s{seed}{suffix}", "tiny", seed, dtype)


def weights_digest(model_dir: str | os.PathLike[str]) -> str:
    """SHA-256 over every tensor (name, dtype, shape, bytes) of the checkpoint's safetensors."""
    from safetensors import safe_open

    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in sorted(handle.keys()):
                tensor = handle.get_tensor(name).contiguous()
                digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
