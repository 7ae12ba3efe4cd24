"""The examples and the demo server run end to end on the tiny model."""

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


def test_server_chat_reports_cached_tokens(model_root, tmp_path):
    """`vllm-hybrid serve` (a real process on loopback) + the chat client example."""
    from vllm_hybrid.demo import free_port, start_server, stop_server, wait_ready

    port, log = free_port(), tmp_path / "server.log"
    proc = start_server(tiny_model_dir("zamba2", model_root), port, log)
    try:
        wait_ready(proc, port, log)
        cached = load_example("chat_client").main(f"http://127.0.0.1:{port}/v1", "tiny")
    finally:
        stop_server(proc)
    assert cached[0] == 0 and cached[1] > 0 and cached[2] >= cached[1]
