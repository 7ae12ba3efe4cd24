"""Build a :class:`ModelShape` from a Hugging Face ``config.json`` dict (stdlib only).

Each family spells its layer layout differently (read from the ``transformers`` 5.19 config
classes, ``transformers/models/<family>/configuration_<family>.py``, and the vLLM 0.32 model
files that size the caches):

=================  ===============================================================
model_type         layout keys
=================  ===============================================================
zamba2             ``layers_block_type`` ("mamba"/"hybrid") or ``hybrid_layer_ids``
nemotron_h         ``hybrid_override_pattern`` (M * - E) or ``layers_block_type``
granitemoehybrid   ``layer_types`` ("mamba"/"attention"), an MoE block on every layer
falcon_h1          none: attention and Mamba2 side by side in every layer
bamba              ``attn_layer_indices``
jamba              ``attn_layer_period/offset``, ``expert_layer_period/offset``
qwen3_next         ``layer_types`` ("linear_attention" = GDN), MoE unless ``mlp_only_layers``
qwen3_5(_moe)      the same under ``text_config``
olmo_hybrid        ``layer_types`` ("linear_attention" = GDN)
lfm2 / lfm2_moe    ``layer_types`` ("conv") or ``full_attn_idxs``; ``num_dense_layers``
kimi_linear        ``layer_types`` or ``linear_attn_config`` (1-based ``kda_layers``), MLA
=================  ===============================================================

Caches are costed in bf16 except where vLLM keeps a state in another dtype: NemotronH's SSM
state follows ``mamba_ssm_cache_dtype`` (float32 when unset, ``NemotronHForCausalLMConfig``
in ``vllm/model_executor/models/config.py``), Qwen3.5's follows ``mamba_ssm_dtype``, and the
KDA recurrent state is float32 (``MambaStateDtypeCalculator.kda_state_dtype``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

from vllm_hybrid.core.config_reader import (
    Config,
    ConfigReader,
    attention,
    keep,
    layout,
    mamba2,
)
from vllm_hybrid.core.layers import (
    AttentionLayers,
    LayerGroup,
    LinearLayers,
    Mamba1Layers,
    MLALayers,
    MLPLayers,
    MoELayers,
)
from vllm_hybrid.core.linear_attn import GatedDeltaNetLayers, KimiDeltaLayers, ShortConvLayers
from vllm_hybrid.core.model_shape import ModelShape, ShapeError


def _zamba2(r: ConfigReader) -> list[LayerGroup]:
    n = r.num("num_hidden_layers")
    ids = r.seq("hybrid_layer_ids")
    if r.seq("layers_block_type") is not None:
        aliases = {"mamba": "m", "linear_attention": "m", "hybrid": "h"}
        kinds = layout(r, "layers_block_type", aliases)
        n_hybrid = kinds.count("h")
    elif ids is not None:
        n_hybrid = len(ids)
    else:
        raise ShapeError(f"{r.where}: zamba2 needs 'layers_block_type' or 'hybrid_layer_ids'")
    d = r.num("hidden_size")
    d_inner = r.num("mamba_expand", 2) * d
    heads = r.num("num_attention_heads")
    att_width = r.opt_num("attention_hidden_size", 2 * d)
    # Every layer has a Mamba2 mixer; a hybrid layer adds an invocation of a shared
    # transformer block (own KV) that reads concat(hidden, embeddings) = 2 d_model.
    return keep(
        [
            mamba2(
                r,
                n,
                d_inner // r.num("mamba_headdim", 64),
                r.num("mamba_headdim", 64),
                d_state="mamba_d_state",
                n_groups="mamba_ngroups",
                conv="mamba_d_conv",
            ),
            AttentionLayers(
                n_hybrid,
                heads,
                r.opt_num("num_key_value_heads", heads),
                r.opt_num("attention_head_dim", att_width // heads),
                att_width,
                d,
            ),
            MLPLayers(n_hybrid, d, r.num("intermediate_size"), gated=True),
            LinearLayers(n_hybrid, d, d),
        ]
    )


def _nemotron_h(r: ConfigReader) -> list[LayerGroup]:
    pattern = r.cfg.get("hybrid_override_pattern")
    aliases = {
        "M": "m",
        "*": "a",
        "-": "f",
        "E": "e",
        "mamba": "m",
        "linear_attention": "m",
        "attention": "a",
        "full_attention": "a",
        "mlp": "f",
        "moe": "e",
    }
    if isinstance(pattern, str):
        cfg = {**r.cfg, "_pattern": list(pattern), "num_hidden_layers": len(pattern)}
        r = ConfigReader(cfg, r.where)
        kinds = layout(r, "_pattern", aliases)
    else:
        key = "layers_block_type" if "layers_block_type" in r.cfg else "layer_types"
        kinds = layout(r, key, aliases)
    c = Counter(kinds)
    d = r.num("hidden_size")
    n_experts = r.opt_num("n_routed_experts")
    m2 = mamba2(
        r,
        c["m"],
        r.num("mamba_num_heads"),
        r.num("mamba_head_dim"),
        d_state="ssm_state_size",
        n_groups="n_groups",
        conv="conv_kernel",
    )
    # vLLM keeps NemotronH's SSM state in mamba_ssm_cache_dtype, float32 when unset.
    ssm_bytes = r.dtype_bytes("mamba_ssm_cache_dtype", 4)
    groups: list[LayerGroup] = [
        dataclasses.replace(m2, ssm_dtype_bytes=ssm_bytes),
        attention(r, c["a"]),
        MLPLayers(c["f"], d, r.num("intermediate_size"), gated=False),
    ]
    if c["e"]:
        shared = r.opt_num("n_shared_experts") * r.opt_num("moe_shared_expert_intermediate_size")
        groups.append(
            MoELayers(
                c["e"],
                d,
                r.num("moe_intermediate_size"),
                n_experts,
                r.num("num_experts_per_tok"),
                shared,
                gated=False,
            )
        )
    return keep(groups)


def _granite(r: ConfigReader) -> list[LayerGroup]:
    kinds = layout(
        r,
        "layer_types",
        {"mamba": "m", "linear_attention": "m", "attention": "a", "full_attention": "a"},
    )
    n, d = len(kinds), r.num("hidden_size")
    n_experts = r.opt_num("num_local_experts")
    ffn: LayerGroup
    if n_experts:
        ffn = MoELayers(
            n,
            d,
            r.num("intermediate_size"),
            n_experts,
            r.num("num_experts_per_tok"),
            r.opt_num("shared_intermediate_size"),
        )
    else:  # the dense Granite-4.0-H (1B, micro): one MLP of shared_intermediate_size
        ffn = MLPLayers(n, d, r.num("shared_intermediate_size"))
    return keep(
        [
            mamba2(
                r,
                kinds.count("m"),
                r.num("mamba_n_heads"),
                r.num("mamba_d_head"),
                d_state="mamba_d_state",
                n_groups="mamba_n_groups",
                conv="mamba_d_conv",
            ),
            attention(r, kinds.count("a")),
            ffn,
        ]
    )


def _falcon_h1(r: ConfigReader) -> list[LayerGroup]:
    n, d = r.num("num_hidden_layers"), r.num("hidden_size")
    heads = r.num("mamba_n_heads")
    d_ssm = r.opt_num("mamba_d_ssm", 0) or r.num("mamba_expand", 2) * d
    return keep(
        [
            mamba2(
                r,
                n,
                heads,
                d_ssm // heads,
                d_state="mamba_d_state",
                n_groups="mamba_n_groups",
                conv="mamba_d_conv",
            ),
            attention(r, n),
            MLPLayers(n, d, r.num("intermediate_size")),
        ]
    )


def _bamba(r: ConfigReader) -> list[LayerGroup]:
    n, d = r.num("num_hidden_layers"), r.num("hidden_size")
    n_att = len(r.seq("attn_layer_indices") or [])
    return keep(
        [
            mamba2(
                r,
                n - n_att,
                r.num("mamba_n_heads"),
                r.num("mamba_d_head"),
                d_state="mamba_d_state",
                n_groups="mamba_n_groups",
                conv="mamba_d_conv",
            ),
            attention(r, n_att),
            MLPLayers(n, d, r.num("intermediate_size")),
        ]
    )


def _jamba(r: ConfigReader) -> list[LayerGroup]:
    n, d = r.num("num_hidden_layers"), r.num("hidden_size")
    a_per, a_off = r.num("attn_layer_period", 8), r.num("attn_layer_offset", 4)
    e_per, e_off = r.num("expert_layer_period", 2), r.num("expert_layer_offset", 1)
    n_att = sum(1 for i in range(n) if i % a_per == a_off)
    n_moe = sum(1 for i in range(n) if i % e_per == e_off)
    dt_rank = r.cfg.get("mamba_dt_rank", "auto")
    dt = -(-d // 16) if dt_rank == "auto" else r.num("mamba_dt_rank")
    ffn = r.num("intermediate_size")
    return keep(
        [
            Mamba1Layers(
                n - n_att,
                d,
                r.num("mamba_expand", 2) * d,
                r.num("mamba_d_state", 16),
                dt,
                conv_kernel=r.num("mamba_d_conv", 4),
            ),
            attention(r, n_att),
            MoELayers(n_moe, d, ffn, r.num("num_experts"), r.num("num_experts_per_tok")),
            MLPLayers(n - n_moe, d, ffn),
        ]
    )


def _gdn(r: ConfigReader, count: int, ssm_bytes: int = 2) -> GatedDeltaNetLayers:
    return GatedDeltaNetLayers(
        count,
        r.num("hidden_size"),
        r.num("linear_num_key_heads"),
        r.num("linear_num_value_heads"),
        r.num("linear_key_head_dim"),
        r.num("linear_value_head_dim"),
        conv_kernel=r.num("linear_conv_kernel_dim", 4),
        state_dtype_bytes=ssm_bytes,
    )


_GDN_KINDS = {"linear_attention": "g", "full_attention": "a"}


def _qwen3_next(r: ConfigReader) -> list[LayerGroup]:
    if isinstance(r.cfg.get("text_config"), dict):  # Qwen3.5 wraps the LM in text_config
        r = ConfigReader({**r.cfg["text_config"], "model_type": r.cfg.get("model_type")}, r.where)
    kinds = layout(r, "layer_types", _GDN_KINDS)
    n, d = len(kinds), r.num("hidden_size")
    n_experts = r.opt_num("num_experts")
    step = r.opt_num("decoder_sparse_step", 1) or 1
    dense_only = set(r.seq("mlp_only_layers") or [])
    n_moe = (
        sum(1 for i in range(n) if i not in dense_only and (i + 1) % step == 0) if n_experts else 0
    )
    groups: list[LayerGroup] = [
        _gdn(r, kinds.count("g"), r.dtype_bytes("mamba_ssm_dtype", 2)),
        attention(r, kinds.count("a"), q_gate=True),  # q_proj doubles as the output gate
    ]
    if n_moe:
        groups.append(
            MoELayers(
                n_moe,
                d,
                r.num("moe_intermediate_size"),
                n_experts,
                r.num("num_experts_per_tok"),
                r.opt_num("shared_expert_intermediate_size"),
            )
        )
    if n - n_moe:
        groups.append(MLPLayers(n - n_moe, d, r.num("intermediate_size")))
    return keep(groups)


def _olmo_hybrid(r: ConfigReader) -> list[LayerGroup]:
    kinds = layout(r, "layer_types", _GDN_KINDS)
    return keep(
        [
            _gdn(r, kinds.count("g")),
            attention(r, kinds.count("a")),
            MLPLayers(len(kinds), r.num("hidden_size"), r.num("intermediate_size")),
        ]
    )


def _lfm2_layout(r: ConfigReader) -> list[str]:
    if r.seq("layer_types") is not None:
        return layout(r, "layer_types", {"conv": "c", "full_attention": "a"})
    idxs = r.seq("full_attn_idxs")
    if idxs is None:
        raise ShapeError(f"{r.where}: lfm2 needs 'layer_types' or 'full_attn_idxs'")
    return ["a" if i in idxs else "c" for i in range(r.num("num_hidden_layers"))]


def _lfm2_ffn(r: ConfigReader) -> int:
    """The MLP width ``Lfm2MLP`` builds: ``block_ff_dim`` (= ``intermediate_size``), cut to
    2/3, scaled and rounded up to ``block_multiple_of`` when ``block_auto_adjust_ff_dim``."""
    ff = r.opt_num("block_ff_dim", 0) or r.num("intermediate_size")
    if r.cfg.get("block_auto_adjust_ff_dim", False):
        ff = int(2 * ff / 3)
        mult = r.cfg.get("block_ffn_dim_multiplier")
        if mult is not None:
            ff = int(float(mult) * ff)
        step = r.num("block_multiple_of", 256)
        ff = step * ((ff + step - 1) // step)
    return ff


def _lfm2(r: ConfigReader) -> list[LayerGroup]:
    kinds = _lfm2_layout(r)
    n, d = len(kinds), r.num("hidden_size")
    conv = ShortConvLayers(
        kinds.count("c"), d, r.opt_num("conv_dim", d), conv_kernel=r.num("conv_L_cache", 3)
    )
    groups: list[LayerGroup] = [conv, attention(r, kinds.count("a"))]
    if r.cfg.get("model_type") == "lfm2_moe":
        dense = min(r.num("num_dense_layers", 2), n)
        groups += [
            MLPLayers(dense, d, r.num("intermediate_size")),
            MoELayers(
                n - dense,
                d,
                r.num("moe_intermediate_size"),
                r.num("num_experts"),
                r.num("num_experts_per_tok"),
            ),
        ]
    else:
        groups.append(MLPLayers(n, d, _lfm2_ffn(r)))
    return keep(groups)


def _kimi_linear(r: ConfigReader) -> list[LayerGroup]:
    lac = r.cfg.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ShapeError(f"{r.where}: 'linear_attn_config' must be an object")
    n, d = r.num("num_hidden_layers"), r.num("hidden_size")
    if r.seq("layer_types") is not None:
        kinds = layout(r, "layer_types", _GDN_KINDS)
    elif "full_attn_layers" in lac:  # the checkpoint's 1-based lists
        full = set(lac["full_attn_layers"])
        kinds = ["a" if i + 1 in full else "g" for i in range(n)]
    else:
        raise ShapeError(f"{r.where}: kimi_linear needs 'layer_types' or linear_attn_config")
    mlp_types = r.seq("mlp_layer_types")
    if mlp_types is not None:
        n_dense = sum(1 for t in mlp_types if t == "dense")
    else:
        n_dense = min(r.opt_num("first_k_dense_replace", 1), n)
    lr = ConfigReader(lac, r.where)
    heads = lr.opt_num("num_heads", 0) or r.num("linear_num_heads")
    head_dim = lr.opt_num("head_dim", 0) or r.num("linear_head_dim")
    kernel = lr.opt_num("short_conv_kernel_size", 0) or r.num("linear_conv_kernel_dim", 4)
    moe_ffn = r.num("moe_intermediate_size")
    experts_per_tok = r.opt_num("num_experts_per_token", 0) or r.num("num_experts_per_tok")
    return keep(
        [
            KimiDeltaLayers(
                kinds.count("g"),
                d,
                heads,
                head_dim,
                conv_kernel=kernel,
                state_dtype_bytes=r.dtype_bytes("mamba_ssm_cache_dtype", 4),
            ),
            MLALayers(
                kinds.count("a"),
                d,
                r.num("num_attention_heads"),
                r.num("kv_lora_rank"),
                r.num("qk_nope_head_dim"),
                r.num("qk_rope_head_dim"),
                r.num("v_head_dim"),
                q_lora_rank=r.opt_num("q_lora_rank"),
            ),
            MLPLayers(n_dense, d, r.num("intermediate_size")),
            MoELayers(
                n - n_dense,
                d,
                moe_ffn,
                r.num("num_experts"),
                experts_per_tok,
                r.opt_num("num_shared_experts") * moe_ffn,
            ),
        ]
    )


FAMILIES: dict[str, Callable[[ConfigReader], list[LayerGroup]]] = {
    "zamba2": _zamba2,
    "nemotron_h": _nemotron_h,
    "granitemoehybrid": _granite,
    "falcon_h1": _falcon_h1,
    "bamba": _bamba,
    "jamba": _jamba,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_next,
    "qwen3_5_text": _qwen3_next,
    "qwen3_5_moe": _qwen3_next,
    "qwen3_5_moe_text": _qwen3_next,
    "olmo_hybrid": _olmo_hybrid,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2,
    "kimi_linear": _kimi_linear,
}


def shape_from_hf_config(cfg: Config, name: str, source: str = "", where: str = "") -> ModelShape:
    """The shape of the model an HF ``config.json`` describes; raises :class:`ShapeError`
    naming the key to fix when the config is not one of :data:`FAMILIES` or lacks a field."""
    where = where or name
    if not isinstance(cfg, dict):
        raise ShapeError(f"{where}: a config.json must be a JSON object")
    model_type = cfg.get("model_type")
    build = FAMILIES.get(str(model_type))
    if build is None:
        raise ShapeError(
            f"{where}: model_type {model_type!r} is not a hybrid family the loader knows "
            f"(known: {', '.join(sorted(FAMILIES))}); pass a shape JSON instead "
            "(the schema in vllm_hybrid/core/shapes.py)"
        )
    try:
        layers = build(ConfigReader(cfg, where))
    except (TypeError, ValueError, ZeroDivisionError, KeyError) as exc:
        if isinstance(exc, ShapeError):
            raise
        raise ShapeError(f"{where}: malformed {model_type} config: {exc!r}") from exc
    if not layers:
        raise ShapeError(f"{where}: the config describes no layers")
    return ModelShape(name=name, layers=tuple(layers), source=source or f"{model_type} config")
