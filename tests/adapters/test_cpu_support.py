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
    """LFM2 only without the plugin's CPU rotary fix (``rotary_fixed=False``)."""
    message = refusal([arch], rotary_fixed=False)
    assert message is not None and arch in message and where in message
    assert "--no-enable-prefix-caching" in message and ENV_ALLOW_INEXACT in message


@pytest.mark.parametrize(
    "arch",
    [
        "Zamba2ForCausalLM",
        "NemotronHForCausalLM",
        "FalconH1ForCausalLM",
        "LlamaForCausalLM",
        "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM",
    ],
)
def test_exact_families_are_not_refused(arch: str) -> None:
    """LFM2 with the CPU rotary fix in place, as ``plugin.register`` installs it on CPU."""
    assert refusal([arch]) is None
    if arch.startswith("Lfm2"):
        pytest.importorskip("vllm", reason="needs the cpu extra")
        from vllm_hybrid.adapters.vllm.compat import patches

        assert patches.flatten_cpu_rotary_inputs()
    refuse_inexact_cpu_prefix_caching(fake_config(arch))


def test_refused_only_with_prefix_caching_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm", reason="needs the cpu extra")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU platform only")
    from vllm_hybrid.adapters.vllm.compat import patches

    with pytest.raises(UnsupportedOnCPU, match="gdn_attention.py::cpu_gdn_attention_core"):
        refuse_inexact_cpu_prefix_caching(fake_config("Qwen3NextForCausalLM"))
    refuse_inexact_cpu_prefix_caching(fake_config("Qwen3NextForCausalLM", caching=False))
    assert patches.flatten_cpu_rotary_inputs()  # what plugin.register installs on CPU
    refuse_inexact_cpu_prefix_caching(fake_config("Lfm2ForCausalLM"))
    monkeypatch.setattr(patches, "cpu_rotary_flattened", lambda: False)
    with pytest.raises(UnsupportedOnCPU, match="lfm2.py::Lfm2Attention.forward"):
        refuse_inexact_cpu_prefix_caching(fake_config("Lfm2ForCausalLM"))
    monkeypatch.setenv(ENV_ALLOW_INEXACT, "1")
    refuse_inexact_cpu_prefix_caching(fake_config("Lfm2ForCausalLM"))
    refuse_inexact_cpu_prefix_caching(fake_config("Qwen3NextForCausalLM"))
    assert issubclass(UnsupportedOnCPU, ValueError)
    assert "Qwen3NextForCausalLM" in cpu_support.INEXACT_UNLESS_FP32_GDN
    assert "Lfm2ForCausalLM" in cpu_support.INEXACT_WITHOUT_ROTARY_FIX


def test_gdn_refused_in_bfloat16_not_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-Next / Qwen3.5 with prefix caching on CPU: float32 with the plugin's gated delta
    rule installed runs; bfloat16 (vLLM's op) and float32 without it are refused."""
    pytest.importorskip("vllm", reason="needs the cpu extra")
    import torch
    from vllm.platforms import current_platform

    from vllm_hybrid.adapters.vllm import cpu_gdn

    if not current_platform.is_cpu():
        pytest.skip("CPU platform only")
    monkeypatch.delenv(ENV_ALLOW_INEXACT, raising=False)
    for arch in ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"):
        fp32, bf16 = fake_config(arch), fake_config(arch)
        fp32.model_config.dtype, bf16.model_config.dtype = torch.float32, torch.bfloat16
        monkeypatch.setattr(cpu_gdn, "installed", lambda: True)
        refuse_inexact_cpu_prefix_caching(fp32)
        with pytest.raises(UnsupportedOnCPU, match="gdn_attention.py::cpu_gdn_attention_core"):
            refuse_inexact_cpu_prefix_caching(bf16)
        monkeypatch.setattr(cpu_gdn, "installed", lambda: False)
        with pytest.raises(UnsupportedOnCPU, match="cpu_gdn.py"):
            refuse_inexact_cpu_prefix_caching(fp32)
    assert refusal(["Qwen3NextForCausalLM"], fp32_gdn=True) is None


def _on_platform(monkeypatch: pytest.MonkeyPatch, cpu: bool) -> None:
    """Make vLLM's current platform report CPU (or not), so the refusals are tested the same
    on any machine."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: cpu)


def test_olmo_hybrid_refused_outside_float32_with_or_without_caching(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("vllm", reason="needs the cpu extra")
    import torch

    from vllm_hybrid.adapters.vllm.cpu_support import refuse_unrunnable_on_cpu

    _on_platform(monkeypatch, cpu=True)
    for caching in (True, False):
        bf16, fp32 = (fake_config("OlmoHybridForCausalLM", caching=caching) for _ in range(2))
        bf16.model_config.dtype, fp32.model_config.dtype = torch.bfloat16, torch.float32
        with pytest.raises(UnsupportedOnCPU, match="olmo_gdn_linear_attn.py::.*--dtype float32"):
            refuse_unrunnable_on_cpu(bf16.model_config)
        refuse_unrunnable_on_cpu(fp32.model_config)
    other = fake_config("Qwen3NextForCausalLM")
    other.model_config.dtype = torch.bfloat16
    refuse_unrunnable_on_cpu(other.model_config)
    _on_platform(monkeypatch, cpu=False)  # on a GPU vLLM's own path runs it
    refuse_unrunnable_on_cpu(bf16.model_config)


def test_kimi_linear_refused_on_cpu_at_every_dtype_with_or_without_caching(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("vllm", reason="needs the cpu extra")
    import torch

    from vllm_hybrid.adapters.vllm.cpu_support import refuse_unrunnable_on_cpu

    for caching in (True, False):
        for dtype in (torch.float32, torch.bfloat16):
            config = fake_config("KimiLinearForCausalLM", caching=caching)
            config.model_config.dtype = dtype
            _on_platform(monkeypatch, cpu=True)
            with pytest.raises(UnsupportedOnCPU, match="cpu.py::CpuPlatform.*mla.py::.*GPU"):
                refuse_unrunnable_on_cpu(config.model_config)
            _on_platform(monkeypatch, cpu=False)  # served by vLLM's own GPU path
            refuse_unrunnable_on_cpu(config.model_config)
