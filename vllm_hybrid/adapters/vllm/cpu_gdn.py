"""Gated delta net (Qwen3-Next, Qwen3.5) in float32 on vLLM's CPU backend.

vLLM 0.32.0 runs a GDN layer on CPU through one custom op, ``cpu_gdn_attention_core``
(``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``, registered by
``register_cpu_gdn_attention_ops`` when the first layer is built and called from
``QwenGatedDeltaNetAttention.forward_cpu``, ``layers/mamba/gdn/qwen_gdn_linear_attn.py``). It
asserts bfloat16 ("CPU GDN attention requires BF16.") and keeps the states in bfloat16 between
prefill chunks, so a prefix-cached run, whose chunks end at other positions, rounds its state
elsewhere and its greedy outputs differ from caching off (docs/cpu_prefix_caching.md).

``cpu_gdn_attention_core`` here has the op's signature. For bfloat16 inputs it calls vLLM's
function unchanged. For float32 it runs the same steps as vLLM's non-speculative path (the
causal conv through vLLM's own torch conv functions, the gates, the rule), with the gates and
the rule from :mod:`vllm_hybrid.ops.gdn`: a sequential float32 recurrence whose state does not
depend on where prefill chunks end (the C++ op ``gated_delta_rule``, or its pure-torch twin
where the extension is not built; the same bits). ``patch_cpu_gdn_fp32`` installs it before
the op is registered (``plugin.register``, CPU only, vLLM 0.32.0 only). Speculative decoding
(a wide conv buffer) is refused in float32.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.utils.torch_utils import LayerNameType  # the op schema is inferred from the hints

from vllm_hybrid.adapters.vllm.compat.patches import (
    forward_context_layer,
    replace_cpu_gdn_attention_core,
    replace_olmo_gdn_forward_core,
)
from vllm_hybrid.ops import extension_available
from vllm_hybrid.ops.gdn import gated_delta_rule, gated_delta_rule_ref, gdn_gating_ref

logger = logging.getLogger("vllm_hybrid")

#: vLLM's ``cpu_gdn_attention_core``, kept once replaced (bfloat16 goes there).
VLLM_CPU_GDN_CORE: Any = None


def cpu_gdn_attention_core(
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    core_attn_out: torch.Tensor,
    layer_name: LayerNameType,
) -> None:
    """Drop-in for vLLM's op: float32 here, every other dtype in vLLM's function."""
    if mixed_qkv.dtype != torch.float32:
        VLLM_CPU_GDN_CORE(mixed_qkv, b, a, core_attn_out, layer_name)
        return
    from vllm.forward_context import get_forward_context

    layer = forward_context_layer(layer_name)
    metadata = get_forward_context().attn_metadata
    if metadata is None:
        return  # profiling run
    meta = metadata[layer.prefix]
    if meta.num_actual_tokens == 0:
        return
    if meta.spec_sequence_masks is not None or meta.num_accepted_tokens is not None:
        raise NotImplementedError(
            "vllm-hybrid: float32 gated delta net on CPU does not support speculative "
            "decoding; run it in bfloat16 (vLLM's op) or without a draft model"
        )
    _forward_fp32(layer, meta, mixed_qkv, b, a, core_attn_out)


def _forward_fp32(
    layer: Any,
    meta: Any,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    core_attn_out: torch.Tensor,
) -> None:
    """vLLM's ``_cpu_gdn_attention_nonspec`` order: decodes first, then prefills."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (
        causal_conv1d_fn_cpu,
        causal_conv1d_update_cpu,
    )

    conv_state, ssm_state = layer.kv_cache[0], layer.kv_cache[1]
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)  # (slots, dim, width - 1), a view
    weight = layer.conv1d.weight
    weight = weight.view(weight.size(0), weight.size(2))  # float32: never packed
    slots, heads, dv, dk = ssm_state.shape
    ssm_state = ssm_state.view(slots, heads, dk, dv)  # vLLM's CPU kernels' [K, V] per head
    indices = meta.non_spec_state_indices_tensor
    starts = meta.non_spec_query_start_loc
    decodes, decode_tokens = meta.num_decodes, meta.num_decode_tokens
    prefills = meta.num_prefills
    mixed_qkv = mixed_qkv.contiguous()
    if decodes > 0:
        x = causal_conv1d_update_cpu(
            x=mixed_qkv[:decode_tokens],
            conv_state=conv_state,
            weight=weight,
            bias=layer.conv1d.bias,
            activation=layer.activation,
            conv_state_indices=indices[:decodes],
        )
        _rule(
            layer,
            x,
            a[:decode_tokens],
            b[:decode_tokens],
            starts[: decodes + 1],
            indices[:decodes],
            None,
            ssm_state,
            core_attn_out[:decode_tokens],
        )
    if prefills > 0:
        end = decode_tokens + meta.num_prefill_tokens
        p_starts = starts[decodes : decodes + prefills + 1] - decode_tokens
        p_indices = indices[decodes : decodes + prefills]
        initial = meta.has_initial_state[decodes : decodes + prefills]
        x = causal_conv1d_fn_cpu(
            x=mixed_qkv[decode_tokens:end].transpose(0, 1),
            weight=weight,
            bias=layer.conv1d.bias,
            conv_states=conv_state,
            query_start_loc=p_starts,
            cache_indices=p_indices,
            has_initial_state=initial,
            activation=layer.activation,
        ).transpose(0, 1)
        _rule(
            layer,
            x,
            a[decode_tokens:end],
            b[decode_tokens:end],
            p_starts,
            p_indices,
            initial,
            ssm_state,
            core_attn_out[decode_tokens:end],
        )


def _rule(
    layer: Any,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    starts: torch.Tensor,
    indices: torch.Tensor,
    initial: torch.Tensor | None,
    ssm_state: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The gates and the rule per sequence, each from and into its state slot: one call of
    the C++ op for the batch, or the pure-torch twin per sequence without the extension."""
    query, key, value = layer.rearrange_mixed_qkv(x)  # (1, tokens, heads, dim) each
    query, key, value = query[0], key[0], value[0]
    g, beta = gdn_gating_ref(layer.A_log, a, b, layer.dt_bias)
    if getattr(layer, "allow_neg_eigval", False):  # OLMo-Hybrid: beta in (0, 2)
        beta = beta * 2.0
    if extension_available():
        # a padded slot (PAD_SLOT_ID, negative) is skipped by the op, as vLLM's conv skips it
        gated_delta_rule(
            query,
            key,
            value,
            g,
            beta,
            ssm_state,
            cu_seqlens=starts,
            state_indices=indices,
            has_initial_state=initial,
            out=out,
        )
        return
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    bounds = starts.tolist()
    for seq, slot in enumerate(indices.tolist()):
        lo, hi = bounds[seq], bounds[seq + 1]
        if hi == lo or slot == PAD_SLOT_ID:  # as vLLM's conv skips a padded slot
            continue
        state = ssm_state[slot]
        if initial is not None and not bool(initial[seq]):
            state.zero_()
        run = state.clone()  # contiguous float32 working copy, written back below
        out[lo:hi] = gated_delta_rule_ref(
            query[lo:hi], key[lo:hi], value[lo:hi], g[lo:hi], beta[lo:hi], run
        ).to(out.dtype)
        state.copy_(run)


def olmo_forward_core_cpu(
    layer: Any,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    core_attn_out: torch.Tensor,
) -> None:
    """CPU ``OlmoHybridGatedDeltaNetAttention._forward_core`` (``olmo_gdn_linear_attn.py``),
    whose own gating and rule are Triton kernels: the same float32 path as Qwen's layers."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if metadata is None:
        return  # profiling run
    meta = metadata.get(layer.prefix)
    if meta is None or meta.num_actual_tokens == 0:
        return
    if mixed_qkv.dtype != torch.float32:
        raise NotImplementedError(
            "vllm-hybrid: OLMo-Hybrid on CPU runs in float32 only (vLLM's own GDN path for it "
            "is Triton); start it with --dtype float32"
        )
    if meta.spec_sequence_masks is not None or meta.num_accepted_tokens is not None:
        raise NotImplementedError(
            "vllm-hybrid: OLMo-Hybrid on CPU does not support speculative decoding"
        )
    n = meta.num_actual_tokens
    _forward_fp32(layer, meta, mixed_qkv[:n], b[:n], a[:n], core_attn_out)


def installed() -> bool:
    """Whether :func:`patch_cpu_gdn_fp32` replaced vLLM's op in this process."""
    return VLLM_CPU_GDN_CORE is not None


def patch_cpu_gdn_fp32() -> bool:
    """Install :func:`cpu_gdn_attention_core` in place of vLLM's; idempotent. True when
    active (vLLM 0.32.0; the op not registered yet in this process)."""
    global VLLM_CPU_GDN_CORE
    if installed():
        return True
    original = replace_cpu_gdn_attention_core(cpu_gdn_attention_core)
    if original is None:
        return False
    VLLM_CPU_GDN_CORE = original
    replace_olmo_gdn_forward_core(olmo_forward_core_cpu)
    logger.info("vllm-hybrid: float32 gated delta net on CPU (sequential, exact across chunks)")
    return True
