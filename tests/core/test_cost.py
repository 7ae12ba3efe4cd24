"""Cost model against hand computations (docs/cost_model.md derives each formula)."""

import pytest

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.layers import (
    AttentionLayers,
    LinearLayers,
    Mamba1Layers,
    Mamba2Layers,
    MLPLayers,
    MoELayers,
)
from vllm_hybrid.core.shapes import ModelShape, ShapeError, builtin_shape_names, load_shape


def test_attention_by_hand() -> None:
    att = AttentionLayers(count=2, n_heads=4, n_kv_heads=2, head_dim=8, d_in=32, d_out=32)
    # Q: 2*32*32 = 2048, K+V: 2*32*(2*16) = 2048, O: 2*32*32 = 2048 -> 6144 per layer.
    assert att.linear_flops_per_token == 2 * 6144
    # QK^T + AV: 2 * (2 * 8) per head per pair -> 4*4*8 = 128 per layer.
    assert att.pair_flops == 2 * 128
    # K and V, 2 heads of 8, 2 bytes, 2 layers.
    assert att.kv_bytes_per_token == 2 * 2 * 2 * 8 * 2
    cost = CostModel(ModelShape("a", (att,)), block_tokens=4)
    # tokens 0,1,2 attend to 1,2,3 keys: 6 pairs.
    assert cost.span_flops(0, 3) == 3 * 12288 + 256 * 6
    # tokens 3,4 attend to 4,5 keys given the cached prefix [0, 3).
    assert cost.span_flops(3, 5) == 2 * 12288 + 256 * 9
    assert cost.span_flops(0, 5) == cost.span_flops(0, 3) + cost.span_flops(3, 5)


def test_mamba2_by_hand() -> None:
    m = Mamba2Layers(
        count=3,
        d_model=8,
        d_inner=16,
        d_state=4,
        n_groups=1,
        n_heads=2,
        conv_kernel=4,
        state_dtype_bytes=2,
    )
    in_proj = 2 * 8 * (2 * 16 + 2 * 4 + 2)  # 672
    conv = 2 * (16 + 8) * 4  # 192
    scan = 5 * 16 * 4 + 5 * 16  # 400
    out = 2 * 16 * 8  # 256
    assert m.linear_flops_per_token == 3 * (in_proj + conv + scan + out)
    assert m.pair_flops == 0
    # ssm 16*4 = 64 plus conv (4-1)*(16+8) = 72 elements, bf16, 3 layers.
    assert m.state_bytes == 3 * (64 + 72) * 2


def test_mamba1_mlp_moe_linear_by_hand() -> None:
    m1 = Mamba1Layers(count=1, d_model=4, d_inner=8, d_state=2, dt_rank=1, conv_kernel=3)
    expected = 2 * 4 * 16 + 2 * 8 * 3 + 2 * 8 * (1 + 4) + 2 * 1 * 8 + 6 * 16 + 4 * 8 + 2 * 8 * 4
    assert m1.linear_flops_per_token == expected
    assert m1.state_bytes == (8 * 2 + 2 * 8) * 2
    assert MLPLayers(2, 4, 10, gated=True).linear_flops_per_token == 2 * 2 * 4 * 10 * 3
    assert MLPLayers(1, 4, 10, gated=False).linear_flops_per_token == 2 * 4 * 10 * 2
    moe = MoELayers(1, d_model=4, d_ffn_expert=6, n_experts=8, n_active=2, d_ffn_shared=5)
    assert moe.linear_flops_per_token == 2 * 4 * 8 + 2 * (2 * 4 * 6 * 3) + 2 * 4 * 5 * 3
    assert LinearLayers(3, 4, 5).linear_flops_per_token == 3 * 2 * 4 * 5


def test_zamba2_7b_snapshot_and_kv_bytes() -> None:
    shape = load_shape("zamba2-7b")
    # 81 Mamba2 layers: 7168*64 SSM + 3*(7168 + 2*2*64) conv elements, bf16.
    assert shape.snapshot_bytes == 81 * (7168 * 64 + 3 * (7168 + 256)) * 2
    # 13 shared-attention invocations, K and V of 32 heads x 224, bf16.
    assert shape.kv_bytes_per_token == 13 * 2 * 32 * 224 * 2


def test_marconi_7b_has_the_paper_layer_counts() -> None:
    shape = load_shape("marconi-7b")
    counts = {type(g).__name__: g.count for g in shape.layers}
    assert counts == {"Mamba2Layers": 24, "AttentionLayers": 4, "MLPLayers": 28}
    assert all(getattr(g, "d_model", 4096) == 4096 for g in shape.layers)


def test_all_builtin_shapes_load() -> None:
    names = builtin_shape_names()
    for want in (
        "zamba2-2.7b",
        "zamba2-7b",
        "nemotron-h-8b",
        "jamba-1.5-mini",
        "granite-4.0-h-small",
        "falcon-h1-7b",
        "marconi-7b",
        "granite-4.0-h-tiny",
        "qwen3.5-9b",
        "qwen3.5-35b-a3b",
        "qwen3-next-80b-a3b",
        "lfm2-1.2b",
        "lfm2-8b-a1b",
        "olmo-hybrid-7b",
        "kimi-linear-48b-a3b",
    ):
        assert want in names
    for n in names:
        s = load_shape(n)
        assert s.snapshot_bytes > 0 and s.kv_bytes_per_token > 0


def test_bad_shapes_raise_clear_errors(tmp_path) -> None:
    with pytest.raises(ShapeError, match="unknown model shape 'nope'"):
        load_shape("nope")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "layers": [{"kind": "conv9"}]}')
    with pytest.raises(ShapeError, match="unknown layer kind 'conv9'"):
        load_shape(str(bad))
    bad.write_text('{"name": "x", "layers": [{"kind": "mlp", "count": 1, "d_model": 2}]}')
    with pytest.raises(ShapeError, match="d_ffn"):
        load_shape(str(bad))
    with pytest.raises(ValueError, match="bad span"):
        CostModel(load_shape("zamba2-7b"), 64).span_flops(5, 3)
