"""The config.json loader: each family's spelling, bad input, and the regenerated shipped shapes."""

import importlib.util
import json
from pathlib import Path

import pytest

from vllm_hybrid.core.layers import MLALayers, MLPLayers, MoELayers
from vllm_hybrid.core.linear_attn import GatedDeltaNetLayers, KimiDeltaLayers, ShortConvLayers
from vllm_hybrid.core.shape_config import shape_from_hf_config
from vllm_hybrid.core.shapes import ShapeError, builtin_shape_names, load_shape

ROOT = Path(__file__).resolve().parents[2]


def _kinds(shape) -> dict[str, int]:
    return {type(g).__name__: g.count for g in shape.layers}


GDN_KEYS = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
QWEN_NEXT = {
    "model_type": "qwen3_next",
    "hidden_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 6,
    "shared_expert_intermediate_size": 5,
    "intermediate_size": 32,
    "mlp_only_layers": [0],
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    **GDN_KEYS,
}


def test_qwen3_next_gdn_moe_and_gated_attention() -> None:
    s = shape_from_hf_config(QWEN_NEXT, "q")
    assert _kinds(s) == {
        "GatedDeltaNetLayers": 3,
        "AttentionLayers": 1,
        "MoELayers": 3,
        "MLPLayers": 1,
    }
    # conv (3, 2*2*8 + 4*8) + recurrent (4, 8, 8), bf16, three GDN layers.
    assert s.snapshot_bytes == 3 * (3 * 64 + 4 * 8 * 8) * 2
    assert s.kv_bytes_per_token == 2 * 2 * 8 * 2
    att = next(g for g in s.layers if type(g).__name__ == "AttentionLayers")
    assert att.q_gate
    moe = next(g for g in s.layers if isinstance(g, MoELayers))
    assert (moe.n_experts, moe.n_active, moe.d_ffn_shared) == (8, 2, 5)


def test_qwen3_5_reads_text_config_and_ssm_dtype() -> None:
    text = {k: v for k, v in QWEN_NEXT.items() if k not in ("num_experts", "model_type")}
    s = shape_from_hf_config({"model_type": "qwen3_5", "text_config": text}, "q35")
    assert _kinds(s) == {"GatedDeltaNetLayers": 3, "AttentionLayers": 1, "MLPLayers": 4}
    fp32 = shape_from_hf_config(
        {"model_type": "qwen3_5", "text_config": {**text, "mamba_ssm_dtype": "float32"}}, "q"
    )
    assert fp32.snapshot_bytes - s.snapshot_bytes == 3 * 4 * 8 * 8 * 2  # recurrent doubles


def test_olmo_hybrid_is_a_gdn_family() -> None:
    cfg = {
        "model_type": "olmo_hybrid",
        "hidden_size": 16,
        "num_attention_heads": 2,
        "intermediate_size": 24,
        "layer_types": ["linear_attention", "full_attention"],
        **GDN_KEYS,
    }
    s = shape_from_hf_config(cfg, "o")
    assert _kinds(s) == {"GatedDeltaNetLayers": 1, "AttentionLayers": 1, "MLPLayers": 2}
    assert s.kv_bytes_per_token == 2 * 2 * 8 * 2  # no head_dim key: hidden / heads


def test_lfm2_idxs_and_ffn_adjust_and_moe() -> None:
    cfg = {
        "model_type": "lfm2",
        "hidden_size": 2048,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "conv_L_cache": 3,
        "full_attn_idxs": [2],
        "block_ff_dim": 12288,
        "block_auto_adjust_ff_dim": True,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256,
    }
    s = shape_from_hf_config(cfg, "l")
    assert _kinds(s) == {"ShortConvLayers": 3, "AttentionLayers": 1, "MLPLayers": 4}
    mlp = next(g for g in s.layers if isinstance(g, MLPLayers))
    assert mlp.d_ffn == 8192  # Lfm2MLP: int(2 * 12288 / 3), rounded up to 256
    assert s.snapshot_bytes == 3 * 2 * 2048 * 2
    moe_cfg = {
        "model_type": "lfm2_moe",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "moe_intermediate_size": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_dense_layers": 1,
        "layer_types": ["conv", "full_attention", "conv"],
    }
    m = shape_from_hf_config(moe_cfg, "lm")
    assert _kinds(m) == {"ShortConvLayers": 2, "AttentionLayers": 1, "MLPLayers": 1, "MoELayers": 2}
    assert next(g for g in m.layers if isinstance(g, ShortConvLayers)).conv_dim == 64


def test_nemotron_pattern_and_fp32_ssm_default() -> None:
    cfg = {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-M*-E",
        "hidden_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "intermediate_size": 32,
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "n_groups": 2,
        "ssm_state_size": 4,
        "conv_kernel": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 8,
    }
    s = shape_from_hf_config(cfg, "n")
    assert _kinds(s) == {"Mamba2Layers": 2, "AttentionLayers": 1, "MLPLayers": 2, "MoELayers": 1}
    # SSM (4 heads x 8 x 4) in float32, as vLLM keeps NemotronH's; conv (3, 32 + 16) bf16.
    assert s.snapshot_bytes == 2 * (32 * 4 * 4 + 3 * 48 * 2)
    bf16 = shape_from_hf_config({**cfg, "mamba_ssm_cache_dtype": "bfloat16"}, "n")
    assert bf16.snapshot_bytes == 2 * (32 * 4 * 2 + 3 * 48 * 2)


def test_jamba_zamba2_granite_falcon_bamba() -> None:
    jamba = {
        "model_type": "jamba",
        "hidden_size": 32,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_d_state": 4,
    }
    assert _kinds(shape_from_hf_config(jamba, "j")) == {
        "Mamba1Layers": 7,
        "AttentionLayers": 1,
        "MoELayers": 4,
        "MLPLayers": 4,
    }
    zamba = {
        "model_type": "zamba2",
        "hidden_size": 16,
        "num_hidden_layers": 3,
        "layers_block_type": ["mamba", "hybrid", "mamba"],
        "mamba_d_state": 4,
        "mamba_headdim": 8,
        "num_attention_heads": 2,
        "intermediate_size": 24,
    }
    z = shape_from_hf_config(zamba, "z")
    assert _kinds(z) == {"Mamba2Layers": 3, "AttentionLayers": 1, "MLPLayers": 1, "LinearLayers": 1}
    assert z.kv_bytes_per_token == 2 * 2 * 16 * 2  # head_dim = 2 * hidden / heads
    granite = {
        "model_type": "granitemoehybrid",
        "hidden_size": 16,
        "num_attention_heads": 2,
        "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 4,
        "mamba_d_head": 8,
        "mamba_d_state": 4,
        "num_local_experts": 0,
        "shared_intermediate_size": 40,
        "intermediate_size": 8,
        "num_experts_per_tok": 0,
    }
    assert _kinds(shape_from_hf_config(granite, "g"))["MLPLayers"] == 2  # dense: no experts
    falcon = {
        "model_type": "falcon_h1",
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 4,
        "mamba_n_heads": 4,
        "mamba_d_ssm": 24,
        "mamba_d_state": 4,
        "intermediate_size": 8,
    }
    f = shape_from_hf_config(falcon, "f")
    assert _kinds(f) == {"Mamba2Layers": 2, "AttentionLayers": 2, "MLPLayers": 2}
    assert next(g for g in f.layers if type(g).__name__ == "Mamba2Layers").d_inner == 24
    bamba = {
        "model_type": "bamba",
        "hidden_size": 16,
        "num_hidden_layers": 4,
        "attn_layer_indices": [1],
        "num_attention_heads": 2,
        "mamba_n_heads": 4,
        "mamba_d_head": 8,
        "mamba_d_state": 4,
        "intermediate_size": 8,
    }
    assert _kinds(shape_from_hf_config(bamba, "b"))["Mamba2Layers"] == 3


def test_kimi_linear_checkpoint_spelling_is_one_based() -> None:
    cfg = {
        "model_type": "kimi_linear",
        "hidden_size": 16,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 2,
        "v_head_dim": 4,
        "intermediate_size": 32,
        "moe_intermediate_size": 8,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "linear_attn_config": {
            "num_heads": 2,
            "head_dim": 4,
            "short_conv_kernel_size": 4,
            "full_attn_layers": [4],
            "kda_layers": [1, 2, 3],
        },
    }
    s = shape_from_hf_config(cfg, "k")
    assert _kinds(s) == {"KimiDeltaLayers": 3, "MLALayers": 1, "MLPLayers": 1, "MoELayers": 3}
    assert s.kv_bytes_per_token == (8 + 2) * 2
    kda = next(g for g in s.layers if isinstance(g, KimiDeltaLayers))
    assert kda.state_bytes == 3 * (3 * 3 * 8 * 2 + 2 * 4 * 4 * 4)  # recurrent in float32
    assert isinstance(s.layers[1], MLALayers)


def test_bad_configs_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ShapeError, match="model_type 'llama' is not a hybrid family"):
        shape_from_hf_config({"model_type": "llama"}, "x")
    with pytest.raises(ShapeError, match="config has no 'hidden_size'"):
        shape_from_hf_config({"model_type": "olmo_hybrid", "layer_types": ["full_attention"]}, "x")
    bad = {**QWEN_NEXT, "layer_types": ["linear_attention", "mamba9"]}
    with pytest.raises(ShapeError, match=r"layer_types\[1\] is 'mamba9'; known"):
        shape_from_hf_config(bad, "x")
    with pytest.raises(ShapeError, match="has 2 entries, num_hidden_layers is 5"):
        shape_from_hf_config(
            {**QWEN_NEXT, "layer_types": ["full_attention"] * 2, "num_hidden_layers": 5}, "x"
        )
    with pytest.raises(ShapeError, match="must be a non-negative integer"):
        shape_from_hf_config({**QWEN_NEXT, "hidden_size": "big"}, "x")
    cfg = tmp_path / "config.json"
    cfg.write_text("{not json")
    with pytest.raises(ShapeError, match="invalid JSON"):
        load_shape(str(cfg))
    with pytest.raises(ShapeError, match="or a path to a shape JSON or an HF config.json"):
        load_shape("llama")


def test_load_shape_takes_a_config_path_and_a_model_type(tmp_path: Path) -> None:
    d = tmp_path / "my-qwen"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN_NEXT))
    s = load_shape(str(d / "config.json"))
    assert s.name == "my-qwen" and isinstance(s.layers[0], GatedDeltaNetLayers)
    from_type = load_shape("qwen3_next")
    assert from_type.snapshot_bytes == load_shape("qwen3-next-80b-a3b").snapshot_bytes
    assert load_shape("lfm2").name == "lfm2-1.2b"  # defaults that are no checkpoint


def test_flagship_figures_by_hand() -> None:
    q = load_shape("qwen3-next-80b-a3b")  # 36 GDN + 12 attention layers of 48
    assert q.snapshot_bytes == 36 * (3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128) * 2
    assert q.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2
    assert load_shape("lfm2-1.2b").snapshot_bytes == 10 * 2 * 2048 * 2
    # Nemotron-H-8B: 24 Mamba2 layers, SSM in float32 as vLLM keeps it.
    n = load_shape("nemotron-h-8b")
    assert n.snapshot_bytes == 24 * (8192 * 128 * 4 + 3 * (8192 + 2 * 8 * 128) * 2)


def test_shipped_shapes_are_what_the_generator_makes() -> None:
    spec = importlib.util.spec_from_file_location("gen_shapes", ROOT / "tools" / "gen_shapes.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    defaults = json.loads(gen.DEFAULTS_FILE.read_text())
    made = gen.generate(defaults)
    assert set(made) | {"marconi-7b"} == set(builtin_shape_names())
    for name, data in made.items():
        shipped = json.loads((gen.SHAPES / f"{name}.json").read_text())
        assert shipped == data, f"{name} is stale: rerun tools/gen_shapes.py"
        assert "_note" not in shipped
