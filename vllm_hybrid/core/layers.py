"""Layer groups of a hybrid model and what each costs: FLOPs, KV bytes, state bytes.

Every group describes ``count`` identical layers. The prefill FLOPs of a token span
``[a_tokens, b_tokens)`` whose prefix ``[0, a_tokens)`` is already cached are split in two
coefficients so the cost model can sum groups once and evaluate any span in O(1)::

    flops(a, b) = linear_flops_per_token * (b - a)
                + pair_flops * ((b * (b + 1) - a * (a + 1)) / 2)

``pair_flops`` is the cost of one (query, key) pair summed over the group (attention only: the
token at position ``t`` attends to ``t + 1`` keys). The derivations are in docs/cost_model.md.
A multiply-add counts as 2 FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_hybrid.core.layer_base import INT8_SCALE_BYTES, ZeroByDefault
from vllm_hybrid.core.linear_attn import GatedDeltaNetLayers, KimiDeltaLayers, ShortConvLayers


@dataclass(frozen=True)
class AttentionLayers(ZeroByDefault):
    """Softmax attention with GQA: ``n_heads`` query heads share ``n_kv_heads`` KV heads.

    ``q_gate``: the query projection also produces a sigmoid gate on the attention output
    (Qwen3-Next / Qwen3.5 ``attn_output_gate``), doubling its width."""

    count: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_in: int
    d_out: int
    kv_dtype_bytes: int = 2
    q_gate: bool = False

    @property
    def linear_flops_per_token(self) -> int:
        q_width = self.n_heads * self.head_dim
        kv_width = self.n_kv_heads * self.head_dim
        q_proj_width = 2 * q_width if self.q_gate else q_width
        per_layer = 2 * self.d_in * q_proj_width + 2 * self.d_in * 2 * kv_width
        per_layer += 2 * q_width * self.d_out
        if self.q_gate:
            per_layer += q_width  # gate * attention output
        return self.count * per_layer

    @property
    def pair_flops(self) -> int:
        # QK^T and (softmax)V: 2 * head_dim FLOPs each, per query head.
        return self.count * 4 * self.n_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        return self.count * 2 * self.n_kv_heads * self.head_dim * self.kv_dtype_bytes


@dataclass(frozen=True)
class MLALayers(ZeroByDefault):
    """Multi-head latent attention (DeepSeek-V2 style; Kimi-Linear's full-attention layers).

    The cache holds the compressed ``kv_lora_rank`` latent plus the shared rope key per token
    (vLLM's MLA spec); prefill up-projects the latent to per-head keys and values."""

    count: int
    d_model: int
    n_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0
    kv_dtype_bytes: int = 2

    @property
    def linear_flops_per_token(self) -> int:
        qk = self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.q_lora_rank:
            per_layer = 2 * self.d_model * self.q_lora_rank + 2 * self.q_lora_rank * qk
        else:
            per_layer = 2 * self.d_model * qk
        per_layer += 2 * self.d_model * (self.kv_lora_rank + self.qk_rope_head_dim)  # kv_a
        kv_b_width = self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        per_layer += 2 * self.kv_lora_rank * kv_b_width  # kv_b
        per_layer += 2 * self.n_heads * self.v_head_dim * self.d_model  # o_proj
        return self.count * per_layer

    @property
    def pair_flops(self) -> int:
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.count * 2 * self.n_heads * (qk + self.v_head_dim)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.count * (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_dtype_bytes


@dataclass(frozen=True)
class Mamba2Layers(ZeroByDefault):
    """Mamba2 (SSD) mixer: ``d_inner = n_heads * head_dim``, B and C shared per group."""

    count: int
    d_model: int
    d_inner: int
    d_state: int
    n_groups: int
    n_heads: int
    conv_kernel: int = 4
    state_dtype_bytes: int = 2
    #: Bytes of an SSM-state element when it differs from the conv state's (vLLM's
    #: ``mamba_ssm_cache_dtype``, ``MambaStateDtypeCalculator._mamba_state_dtype``); 0: same.
    ssm_dtype_bytes: int = 0

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def linear_flops_per_token(self) -> int:
        in_width = 2 * self.d_inner + 2 * self.n_groups * self.d_state + self.n_heads
        per_layer = 2 * self.d_model * in_width  # in_proj
        per_layer += 2 * self.conv_dim * self.conv_kernel  # depthwise causal conv
        per_layer += 5 * self.d_inner * self.d_state  # decay, x(x)B, C.h
        per_layer += 5 * self.d_inner  # dt*x, D skip, gate
        per_layer += 2 * self.d_inner * self.d_model  # out_proj
        return self.count * per_layer

    @property
    def state_bytes(self) -> int:
        # vLLM's mamba2_state_shape (mamba_utils.py): conv (K - 1, conv_dim) and SSM
        # (n_heads, head_dim, d_state) = d_inner * d_state elements.
        ssm = self.d_inner * self.d_state * (self.ssm_dtype_bytes or self.state_dtype_bytes)
        conv = (self.conv_kernel - 1) * self.conv_dim * self.state_dtype_bytes
        return self.count * (ssm + conv)

    @property
    def state_bytes_int8(self) -> int:
        """Int8 SSM state (1 byte per value + one fp32 scale per head); the conv state stays in
        its dtype: with one scale per channel of only ``conv_kernel - 1`` values it would not
        shrink."""
        ssm = self.d_inner * self.d_state + self.n_heads * INT8_SCALE_BYTES
        conv = (self.conv_kernel - 1) * self.conv_dim * self.state_dtype_bytes
        return self.count * (ssm + conv)


@dataclass(frozen=True)
class Mamba1Layers(ZeroByDefault):
    """Mamba (S6) mixer with a per-channel, per-state input-dependent decay."""

    count: int
    d_model: int
    d_inner: int
    d_state: int
    dt_rank: int
    conv_kernel: int = 4
    state_dtype_bytes: int = 2

    @property
    def linear_flops_per_token(self) -> int:
        per_layer = 2 * self.d_model * 2 * self.d_inner  # in_proj (x and z)
        per_layer += 2 * self.d_inner * self.conv_kernel  # depthwise conv
        per_layer += 2 * self.d_inner * (self.dt_rank + 2 * self.d_state)  # x_proj
        per_layer += 2 * self.dt_rank * self.d_inner  # dt_proj
        per_layer += 6 * self.d_inner * self.d_state  # exp(dt*A), decay, x(x)B, C.h
        per_layer += 4 * self.d_inner  # D skip, gate
        per_layer += 2 * self.d_inner * self.d_model  # out_proj
        return self.count * per_layer

    @property
    def state_bytes(self) -> int:
        # vLLM's mamba1_state_shape (mamba_utils.py): conv (K - 1, d_inner), SSM (d_inner, N).
        ssm = self.d_inner * self.d_state
        conv = (self.conv_kernel - 1) * self.d_inner
        return self.count * (ssm + conv) * self.state_dtype_bytes

    @property
    def state_bytes_int8(self) -> int:
        """Int8 SSM state with one fp32 scale per channel; the conv state in its dtype."""
        ssm = self.d_inner * self.d_state + self.d_inner * INT8_SCALE_BYTES
        conv = (self.conv_kernel - 1) * self.d_inner * self.state_dtype_bytes
        return self.count * (ssm + conv)


@dataclass(frozen=True)
class MLPLayers(ZeroByDefault):
    """Dense MLP; ``gated`` (SwiGLU/GeGLU) has three matrices, plain (relu^2, gelu) two."""

    count: int
    d_model: int
    d_ffn: int
    gated: bool = True

    @property
    def linear_flops_per_token(self) -> int:
        n_matrices = 3 if self.gated else 2
        return self.count * 2 * self.d_model * self.d_ffn * n_matrices


@dataclass(frozen=True)
class MoELayers(ZeroByDefault):
    """Mixture of experts: a router, ``n_active`` routed experts and optional shared experts."""

    count: int
    d_model: int
    d_ffn_expert: int
    n_experts: int
    n_active: int
    d_ffn_shared: int = 0
    gated: bool = True

    @property
    def linear_flops_per_token(self) -> int:
        n_matrices = 3 if self.gated else 2
        per_layer = 2 * self.d_model * self.n_experts  # router
        per_layer += self.n_active * 2 * self.d_model * self.d_ffn_expert * n_matrices
        per_layer += 2 * self.d_model * self.d_ffn_shared * n_matrices
        return self.count * per_layer


@dataclass(frozen=True)
class LinearLayers(ZeroByDefault):
    """Plain projections outside the blocks above (e.g. Zamba2's per-invocation output linear)."""

    count: int
    d_in: int
    d_out: int

    @property
    def linear_flops_per_token(self) -> int:
        return self.count * 2 * self.d_in * self.d_out


LayerGroup = (
    AttentionLayers
    | MLALayers
    | Mamba2Layers
    | Mamba1Layers
    | GatedDeltaNetLayers
    | KimiDeltaLayers
    | ShortConvLayers
    | MLPLayers
    | MoELayers
    | LinearLayers
)

#: JSON ``"kind"`` -> layer group class.
LAYER_KINDS: dict[str, type[LayerGroup]] = {
    "attention": AttentionLayers,
    "mla": MLALayers,
    "mamba2": Mamba2Layers,
    "mamba1": Mamba1Layers,
    "gdn": GatedDeltaNetLayers,
    "kda": KimiDeltaLayers,
    "short_conv": ShortConvLayers,
    "mlp": MLPLayers,
    "moe": MoELayers,
    "linear": LinearLayers,
}
