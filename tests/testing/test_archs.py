"""Config sanity of every architecture and size, without building weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from vllm_hybrid.testing import ARCHS, cpu_archs, get_arch
from vllm_hybrid.testing.archs import CPU_ATTENTION_HEAD_SIZES, TINY_VOCAB_SIZE
from vllm_hybrid.testing.make_model import make_config


def attention_head_size(config: Any) -> int:
    """The attention head size the way vLLM's model code derives it."""
    for field in ("attention_head_dim", "head_dim"):  # zamba2 names it attention_head_dim
        value = getattr(config, field, None)
        if value:
            return int(value)
    return int(config.hidden_size // config.num_attention_heads)


def recurrent_head_size(config: Any) -> int | None:
    """Head size of the Mamba2 / gated-delta-net mixer (None for Mamba1)."""
    fields = ("mamba_headdim", "mamba_head_dim", "mamba_d_head", "linear_value_head_dim")
    for field in fields:
        value = getattr(config, field, None)
        if value:
            return int(value)
    return None


def layer_kinds(config: Any) -> set[str]:
    """'attention' / 'recurrent' kinds present in the layer pattern."""
    if config.model_type == "falcon_h1":  # every layer runs both in parallel
        return {"attention", "recurrent"}
    types = list(getattr(config, "layers_block_type", None) or config.layer_types)
    kinds = set()
    for kind in types:
        if kind in ("hybrid", "full_attention", "attention"):
            kinds.add("attention")
        if kind in ("hybrid", "linear_attention", "mamba", "conv"):
            kinds.add("recurrent")
    return kinds


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_config_shapes(arch: str, size: str) -> None:
    config = make_config(arch, size)
    assert attention_head_size(config) in CPU_ATTENTION_HEAD_SIZES
    assert recurrent_head_size(config) in (None, 32, 64)
    assert layer_kinds(config) == {"attention", "recurrent"}
    assert config.max_position_embeddings >= 8192
    assert config.vocab_size >= TINY_VOCAB_SIZE
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    chunk = getattr(config, "mamba_chunk_size", None) or getattr(config, "chunk_size", None)
    if chunk is not None:
        assert chunk & (chunk - 1) == 0, "Mamba2 chunk_size must be a power of two"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_config_is_tiny(arch: str) -> None:
    config = make_config(arch, "tiny")
    assert config.vocab_size == TINY_VOCAB_SIZE
    assert 64 <= config.hidden_size <= 256
    assert config.num_hidden_layers <= 10
    state = getattr(config, "mamba_d_state", None) or getattr(config, "ssm_state_size", None)
    assert state is None or 16 <= state <= 64


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_small_is_about_100m_parameters(arch: str) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(arch, "small"))
    params = sum(p.numel() for p in model.parameters())
    assert 80e6 <= params <= 130e6, f"{arch} small has {params / 1e6:.1f}M parameters"


def test_arch_registry() -> None:
    mamba2 = ["zamba2", "nemotron_h", "granitemoehybrid", "falcon_h1"]
    gdn = ["qwen3_next", "qwen3_5", "olmo_hybrid", "qwen3_5_moe"]
    assert cpu_archs() == [*mamba2, "jamba", *gdn, "lfm2", "lfm2_moe"]
    assert cpu_archs(mixer="mamba2") == mamba2
    assert cpu_archs("bfloat16") == ["qwen3_next"]
    assert cpu_archs(mixer="gated_delta_net") == gdn
    assert ARCHS["jamba"].vllm_cpu and "selective_scan_fwd" in ARCHS["jamba"].note
    assert not ARCHS["kimi_linear"].vllm_cpu and "UNRUNNABLE_ON_CPU" in ARCHS["kimi_linear"].note
    with pytest.raises(ValueError, match="unknown arch"):
        get_arch("llama")
    with pytest.raises(ValueError, match="unknown size"):
        get_arch("zamba2").config_kwargs("huge")
