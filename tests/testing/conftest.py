"""Session-scoped tiny models, built once per test session (or reused from
``$VLLM_HYBRID_MODEL_CACHE``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hybrid.testing.fixtures import model_cache_root


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this session's tiny models live."""
    return model_cache_root(tmp_path_factory.mktemp("models"))
