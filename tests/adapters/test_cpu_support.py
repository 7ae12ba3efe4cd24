"""The plugin refuses prefix caching on CPU for families whose cached outputs are not exact
there (adapters/vllm/cpu_support.py), naming the vLLM file and function responsible."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hybrid.adapters.vllm import cpu_support
from vllm_hybrid.adapters.vllm.cpu_support import (
    ENV_ALLOW_INEXACT,
    UnsupportedOnCPU,
    refusal,
    refuse_inexact_cpu_prefix_caching,
)


def fake_config(arch: str, caching: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=caching),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch])),
    )


@pytest.mark.parametrize(
    "arch, where",
    [
        ("Qwen3NextForCausalLM", "gdn_attention.py::cpu_gdn_attention_core"),
        ("Qwen3_5ForCausalLM", "gdn_attention.py::cpu_gdn_attention_core"),
        ("Qwen3_5MoeForCausalLM", "gdn_attention.py::cpu_gdn_attention_core"),
        ("Lfm2ForCausalLM", "lfm2.py::Lfm2Attention.forward"),
        ("Lfm2MoeForCausalLM", "lfm2.py::Lfm2Attention.forward"),
    ],
)
def test_refusal_names_the_vllm_function(arch: str, where: str) -> None:
    message = refusal([arch])
    assert message is not None and arch in message and where in message
    assert "--no-enable-prefix-caching" in message and ENV_ALLOW_INEXACT in message


@pytest.mark.parametrize(
    "arch", ["Zamba2ForCausalLM", "NemotronHForCausalLM", "FalconH1ForCausalLM", "LlamaForCausalLM"]
)
def test_exact_families_are_not_refused(arch: str) -> None:
    assert refusal([arch]) is None
    refuse_inexact_cpu_prefix_caching(fake_config(arch))


def test_refused_only_with_prefix_caching_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm", reason="needs the cpu extra")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU platform only")
    with pytest.raises(UnsupportedOnCPU, match="lfm2.py::Lfm2Attention.forward"):
        refuse_inexact_cpu_prefix_caching(fake_config("Lfm2ForCausalLM"))
    refuse_inexact_cpu_prefix_caching(fake_config("Lfm2ForCausalLM", caching=False))
    monkeypatch.setenv(ENV_ALLOW_INEXACT, "1")
    refuse_inexact_cpu_prefix_caching(fake_config("Lfm2ForCausalLM"))
    assert issubclass(UnsupportedOnCPU, ValueError)
    assert set(cpu_support.INEXACT_ON_CPU) >= {"Qwen3NextForCausalLM", "Lfm2ForCausalLM"}
