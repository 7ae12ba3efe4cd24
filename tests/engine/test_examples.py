"""The offline example runs end to end on the tiny model (the server examples: test_server_e2e)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_offline_batch_example(model_root):
    outputs = load_example("offline_batch").main(str(tiny_model_dir("zamba2", model_root)))
    assert len(outputs) == 3 and all(len(o) > 0 for o in outputs)


def test_agent_loop_example(model_root):
    rows = load_example("agent_loop").main(str(tiny_model_dir("zamba2", model_root)))
    prompts, cached = zip(*rows, strict=True)
    assert cached[0] == 0
    assert all(c > 0 for c in cached[1:])  # every later step resumes from the previous one
    assert list(prompts) == sorted(prompts)
