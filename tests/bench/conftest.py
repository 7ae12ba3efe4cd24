"""Fixtures for ``bench replay`` tests: a session's tiny models (or ``$VLLM_HYBRID_MODEL_CACHE``)
and a small Mooncake-format trace written on the fly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hybrid.testing.fixtures import model_cache_root


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_cache_root(tmp_path_factory.mktemp("models"))


@pytest.fixture
def mooncake_trace(tmp_path: Path) -> Path:
    """Four requests in the Mooncake format; the first two share their first 512-token block."""
    lines = [
        {"timestamp": 0, "input_length": 700, "output_length": 8, "hash_ids": [1, 2]},
        {"timestamp": 500, "input_length": 900, "output_length": 4, "hash_ids": [1, 3]},
        {"timestamp": 1500, "input_length": 300, "output_length": 2, "hash_ids": [4]},
        {
            "timestamp": 2500,
            "input_length": 9000,
            "output_length": 2,
            "hash_ids": list(range(5, 23)),
        },
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path
