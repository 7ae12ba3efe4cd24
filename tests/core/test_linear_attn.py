"""The recurrent kinds beyond Mamba, and MLA, against hand computations (docs/cost_model.md)."""

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.layers import AttentionLayers, Mamba2Layers, MLALayers
from vllm_hybrid.core.linear_attn import (
    GatedDeltaNetLayers,
    KimiDeltaLayers,
    ShortConvLayers,
    delta_rule_head_flops,
)
from vllm_hybrid.core.shapes import ModelShape


def test_delta_rule_core_by_hand() -> None:
    # C (6 d_k + 4 d_v) + 2 C^2 / 3 + 6 d_k d_v with C = 2, d_k = 4, d_v = 3.
    assert delta_rule_head_flops(4, 3, 2) == 2 * (24 + 12) + 8 // 3 + 72
    # At FLA's chunk of 64 and 128-wide heads the intra-chunk work is ~45% of the total.
    assert delta_rule_head_flops(128, 128, 64) == 64 * 1280 + 2730 + 98304


def test_gated_delta_net_by_hand() -> None:
    g = GatedDeltaNetLayers(
        count=2,
        d_model=8,
        n_k_heads=1,
        n_v_heads=2,
        d_k=4,
        d_v=3,
        conv_kernel=4,
        chunk_tokens=2,
        conv_dtype_bytes=2,
        state_dtype_bytes=4,
    )
    in_proj = 2 * 8 * (2 * 4 + 2 * 6 + 2 * 2)  # q, k (4 each), v, z (6 each), b, a (2 each)
    conv = 2 * (2 * 4 + 6) * 4
    core = 2 * (2 * (6 * 4 + 4 * 3) + (2 * 2 * 2) // 3 + 6 * 4 * 3)  # two value heads
    gate, out = 6, 2 * 6 * 8
    assert g.linear_flops_per_token == 2 * (in_proj + conv + core + gate + out) == 2 * 890
    assert g.pair_flops == 0 and g.kv_bytes_per_token == 0
    # vLLM's gated_delta_net_state_shape: conv (3, 2*4 + 6) bf16, recurrent (2, 3, 4) fp32.
    assert g.state_bytes == 2 * (3 * 14 * 2 + 2 * 3 * 4 * 4) == 360
    assert g.state_bytes_int8 == 2 * (3 * 14 * 2 + 2 * 3 * 4 + 2 * 4)


def test_kimi_delta_attention_by_hand() -> None:
    k = KimiDeltaLayers(count=1, d_model=8, n_heads=2, head_dim=4, conv_kernel=3, chunk_tokens=2)
    qkv = 2 * 8 * 3 * 8
    low_rank = 2 * (2 * 8 * 4 + 2 * 4 * 8)  # decay f and output gate g: 8 -> 4 -> 8
    beta = 2 * 8 * 2
    conv = 2 * 24 * 3
    core = 2 * (2 * (24 + 16) + 8 // 3 + 6 * 16 + 4 * 4)
    assert k.linear_flops_per_token == qkv + low_rank + beta + conv + core + 8 + 2 * 8 * 8
    # kda_state_shape: conv (2, 3*8) bf16, recurrent (2, 4, 4) float32 (kda_state_dtype).
    assert k.state_bytes == 2 * 24 * 2 + 2 * 4 * 4 * 4 == 224


def test_short_conv_by_hand() -> None:
    s = ShortConvLayers(count=3, d_model=4, conv_dim=4, conv_kernel=3)
    per_layer = 2 * 4 * 12 + 4 + 2 * 4 * 3 + 4 + 2 * 4 * 4
    assert s.linear_flops_per_token == 3 * per_layer == 480
    # short_conv_state_shape: (conv_L_cache - 1, conv_dim), bf16; nothing to quantize.
    assert s.state_bytes == s.state_bytes_int8 == 3 * 2 * 4 * 2


def test_mla_by_hand() -> None:
    m = MLALayers(
        count=2,
        d_model=8,
        n_heads=2,
        kv_lora_rank=4,
        qk_nope_head_dim=3,
        qk_rope_head_dim=1,
        v_head_dim=2,
    )
    q, kv_a, kv_b, o = 2 * 8 * 8, 2 * 8 * 5, 2 * 4 * 2 * 5, 2 * 2 * 2 * 8
    assert m.linear_flops_per_token == 2 * (q + kv_a + kv_b + o)
    assert m.pair_flops == 2 * 2 * 2 * (4 + 2)  # QK^T over nope+rope, PV over v_head_dim
    assert m.kv_bytes_per_token == 2 * (4 + 1) * 2  # the latent and the rope key, bf16
    lora = MLALayers(2, 8, 2, 4, 3, 1, 2, q_lora_rank=3)
    assert lora.linear_flops_per_token == 2 * (2 * 8 * 3 + 2 * 3 * 8 + kv_a + kv_b + o)
    cost = CostModel(ModelShape("m", (m,)), block_tokens=4)
    assert cost.span_flops(0, 2) == 2 * m.linear_flops_per_token + 3 * m.pair_flops


def test_gated_query_and_fp32_ssm_state() -> None:
    plain = AttentionLayers(1, n_heads=2, n_kv_heads=1, head_dim=4, d_in=8, d_out=8)
    gated = AttentionLayers(1, 2, 1, 4, 8, 8, q_gate=True)
    assert plain.linear_flops_per_token == 2 * 8 * 8 + 2 * 8 * 8 + 2 * 8 * 8
    assert gated.linear_flops_per_token == 2 * 8 * 16 + 2 * 8 * 8 + 2 * 8 * 8 + 8
    assert gated.kv_bytes_per_token == plain.kv_bytes_per_token
    m = Mamba2Layers(1, 8, 16, 4, 1, 2, conv_kernel=4, state_dtype_bytes=2, ssm_dtype_bytes=4)
    assert m.state_bytes == 16 * 4 * 4 + 3 * (16 + 8) * 2
