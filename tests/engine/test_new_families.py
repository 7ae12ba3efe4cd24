"""The 2026 hybrid families on vLLM's CPU backend (issue 23): what starts, and the plugin's
refusal of prefix caching where the cached outputs cannot be exact (adapters/vllm/cpu_support.py;
measurements in docs/results/2026-12-04-new-families.md).

CI runs the LFM2 refusal (an engine config is built, no engine starts) and the Qwen3.5 import
check; the Qwen3-Next refusal and the LFM2-without-caching start are marked slow.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.engine.conftest import engine, greedy, vllm
from vllm_hybrid.adapters.vllm.cpu_support import ENV_ALLOW_INEXACT, UnsupportedOnCPU
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine


def test_lfm2_prefix_caching_refused(model_root):
    model_dir = tiny_model_dir("lfm2", model_root)
    with pytest.raises(UnsupportedOnCPU, match="lfm2.py::Lfm2Attention.forward"):
        vllm.LLM(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=4096,
            enable_prefix_caching=True,
        )


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed"
)
def test_qwen3_5_needs_torchvision_on_vllm_cpu():
    """vLLM's qwen3_5.py imports qwen3_vl.py, which imports transformers' Qwen2-VL image
    processor, which needs torchvision: the reason the support table gives."""
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        importlib.import_module("vllm.model_executor.models.qwen3_5")


@pytest.mark.slow
def test_qwen3_next_prefix_caching_refused(model_root):
    model_dir = tiny_model_dir("qwen3_next", model_root)
    with pytest.raises(UnsupportedOnCPU, match="gdn_attention.py::cpu_gdn_attention_core"):
        vllm.LLM(
            model=str(model_dir),
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=4096,
            enable_prefix_caching=True,
        )


@pytest.mark.slow
def test_lfm2_runs_without_caching_and_with_the_override(model_root, monkeypatch):
    """Caching off starts and generates; the override lets a cached engine start (the
    measuring scripts use it)."""
    model_dir = tiny_model_dir("lfm2", model_root)
    prompts = [list(range(10, 40))]
    with engine(model_dir, enable_prefix_caching=False) as llm:
        assert len(greedy(llm, prompts)[0].outputs[0].token_ids) == 12
    monkeypatch.setenv(ENV_ALLOW_INEXACT, "1")
    with engine(model_dir, enable_prefix_caching=True) as llm:
        assert len(greedy(llm, prompts)[0].outputs[0].token_ids) == 12
