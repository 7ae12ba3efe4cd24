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


class _ZeroByDefault:
    """Layer kinds contribute nothing to a term unless they override it."""

    @property
    def pair_flops(self) -> int:
        return 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 0

    @property
    def state_bytes(self) -> int:
        return 0

    @property
    def state_bytes_int8(self) -> int:
        return 0


#: Bytes of one fp32 scale of an int8 snapshot (csrc/cpu/snapshot_int8.cpp: one per index of
#: dim 1 of a state, i.e. per head of a Mamba2 SSM state, per channel of a Mamba1 one).
INT8_SCALE_BYTES = 4


@dataclass(frozen=True)
class AttentionLayers(_ZeroByDefault):
    """Softmax attention with GQA: ``n_heads`` query heads share ``n_kv_heads`` KV heads."""

    count: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_in: int
    d_out: int
    kv_dtype_bytes: int = 2

    @property
    def linear_flops_per_token(self) -> int:
        q_width = self.n_heads * self.head_dim
        kv_width = self.n_kv_heads * self.head_dim
        per_layer = 2 * self.d_in * q_width + 2 * self.d_in * 2 * kv_width
        per_layer += 2 * q_width * self.d_out
        return self.count * per_layer

    @property
    def pair_flops(self) -> int:
        # QK^T and (softmax)V: 2 * head_dim FLOPs each, per query head.
        return self.count * 4 * self.n_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        return self.count * 2 * self.n_kv_heads * self.head_dim * self.kv_dtype_bytes


@dataclass(frozen=True)
class Mamba2Layers(_ZeroByDefault):
    """Mamba2 (SSD) mixer: ``d_inner = n_heads * head_dim``, B and C shared per group."""

    count: int
    d_model: int
    d_inner: int
    d_state: int
    n_groups: int
    n_heads: int
    conv_kernel: int = 4
    state_dtype_bytes: int = 2

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
        ssm = self.d_inner * self.d_state
        conv = (self.conv_kernel - 1) * self.conv_dim
        return self.count * (ssm + conv) * self.state_dtype_bytes

    @property
    def state_bytes_int8(self) -> int:
        """Int8 SSM state (1 byte per value + one fp32 scale per head); the conv state stays in
        its dtype: with one scale per channel of only ``conv_kernel - 1`` values it would not
        shrink."""
        ssm = self.d_inner * self.d_state + self.n_heads * INT8_SCALE_BYTES
        conv = (self.conv_kernel - 1) * self.conv_dim * self.state_dtype_bytes
        return self.count * (ssm + conv)


@dataclass(frozen=True)
class Mamba1Layers(_ZeroByDefault):
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
class MLPLayers(_ZeroByDefault):
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
class MoELayers(_ZeroByDefault):
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
class LinearLayers(_ZeroByDefault):
    """Plain projections outside the blocks above (e.g. Zamba2's per-invocation output linear)."""

    count: int
    d_in: int
    d_out: int

    @property
    def linear_flops_per_token(self) -> int:
        return self.count * 2 * self.d_in * self.d_out


LayerGroup = AttentionLayers | Mamba2Layers | Mamba1Layers | MLPLayers | MoELayers | LinearLayers

#: JSON ``"kind"`` -> layer group class.
LAYER_KINDS: dict[str, type[LayerGroup]] = {
    "attention": AttentionLayers,
    "mamba2": Mamba2Layers,
    "mamba1": Mamba1Layers,
    "mlp": MLPLayers,
    "moe": MoELayers,
    "linear": LinearLayers,
}
