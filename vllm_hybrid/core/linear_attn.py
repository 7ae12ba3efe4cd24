"""Recurrent layer kinds beyond Mamba: gated delta nets, Kimi delta attention, short convs.

State sizes are the ones vLLM 0.32 allocates
(``vllm/model_executor/layers/mamba/mamba_utils.py``, ``MambaStateShapeCalculator``):

* ``gated_delta_net_state_shape``: conv ``(K - 1, 2 H_k d_k + H_v d_v)`` and recurrent
  ``(H_v, d_v, d_k)`` (Qwen3-Next, Qwen3.5, OLMo-Hybrid: ``get_mamba_state_shape_from_config``
  in ``qwen3_next.py``, ``qwen3_5.py``, ``olmo_hybrid.py``);
* ``kda_state_shape``: conv ``(K - 1, 3 H d)`` and recurrent ``(H, d, d)`` (Kimi-Linear,
  ``vllm/models/kimi_k3/nvidia/model.py``), whose recurrent dtype is float32 unless
  ``mamba_ssm_cache_dtype`` says otherwise (``MambaStateDtypeCalculator.kda_state_dtype``);
* ``short_conv_state_shape``: conv ``(K - 1, conv_dim)`` only (LFM2 / LFM2-MoE, ``lfm2.py``
  and ``lfm2_moe.py``, with ``K = conv_L_cache``).

FLOPs are per token, a multiply-add counting 2; docs/cost_model.md derives each term.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_hybrid.core.layer_base import INT8_SCALE_BYTES, ZeroByDefault

#: Chunk length of the chunked delta-rule prefill (FLA's ``FLA_CHUNK_SIZE``, which vLLM's
#: ``third_party/flash_linear_attention/ops/chunk.py`` uses for GDN and KDA alike).
DELTA_CHUNK_TOKENS = 64


def delta_rule_head_flops(d_k: int, d_v: int, chunk: int) -> int:
    """FLOPs per token and head of the chunked (WY) delta-rule prefill.

    Per chunk of ``C`` tokens: ``K K^T`` (``2 C^2 d_k``), the unit-triangular solve
    (``2 C^3 / 3``), ``W = T K`` and ``U = T V`` (``2 C^2 (d_k + d_v)``), the intra-chunk
    ``Q K^T`` and its product with the corrected values (``2 C^2 (d_k + d_v)``), and three
    ``C x d_k x d_v`` products with the carried state (``W S``, ``Q S``, ``K^T V``). Divided
    by ``C``: ``C (6 d_k + 4 d_v) + 2 C^2 / 3 + 6 d_k d_v``.
    """
    return chunk * (6 * d_k + 4 * d_v) + (2 * chunk * chunk) // 3 + 6 * d_k * d_v


@dataclass(frozen=True)
class GatedDeltaNetLayers(ZeroByDefault):
    """Gated delta net (Qwen3-Next / Qwen3.5 ``linear_attention``, OLMo-Hybrid's GDN).

    ``n_k_heads`` query/key heads of ``d_k``, ``n_v_heads`` value heads of ``d_v`` (the
    query/key heads are repeated up to ``n_v_heads``); a depthwise causal conv of
    ``conv_kernel`` over q, k and v; the output is gated (``z`` or ``g``) before out_proj.
    """

    count: int
    d_model: int
    n_k_heads: int
    n_v_heads: int
    d_k: int
    d_v: int
    conv_kernel: int = 4
    chunk_tokens: int = DELTA_CHUNK_TOKENS
    conv_dtype_bytes: int = 2
    state_dtype_bytes: int = 2

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.d_k

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.d_v

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_flops_per_token(self) -> int:
        # q, k, v, the output gate z and the per-head beta and decay a.
        in_width = 2 * self.key_dim + 2 * self.value_dim + 2 * self.n_v_heads
        per_layer = 2 * self.d_model * in_width
        per_layer += 2 * self.conv_dim * self.conv_kernel
        per_layer += self.n_v_heads * delta_rule_head_flops(self.d_k, self.d_v, self.chunk_tokens)
        per_layer += self.value_dim  # output gate
        per_layer += 2 * self.value_dim * self.d_model  # out_proj
        return self.count * per_layer

    @property
    def _recurrent_elements(self) -> int:
        return self.n_v_heads * self.d_v * self.d_k

    @property
    def _conv_bytes(self) -> int:
        return (self.conv_kernel - 1) * self.conv_dim * self.conv_dtype_bytes

    @property
    def state_bytes(self) -> int:
        rec = self._recurrent_elements * self.state_dtype_bytes
        return self.count * (self._conv_bytes + rec)

    @property
    def state_bytes_int8(self) -> int:
        """Int8 recurrent state with one fp32 scale per value head; conv state as is."""
        rec = self._recurrent_elements + self.n_v_heads * INT8_SCALE_BYTES
        return self.count * (self._conv_bytes + rec)


@dataclass(frozen=True)
class KimiDeltaLayers(ZeroByDefault):
    """Kimi delta attention (Kimi-Linear's ``linear_attention``): a delta rule whose decay is
    per key channel, with ``n_heads`` heads of ``head_dim`` for q, k and v alike, a short conv
    on each, low-rank (``head_dim``) projections for the decay and the output gate."""

    count: int
    d_model: int
    n_heads: int
    head_dim: int
    conv_kernel: int = 4
    chunk_tokens: int = DELTA_CHUNK_TOKENS
    conv_dtype_bytes: int = 2
    state_dtype_bytes: int = 4

    @property
    def proj_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def linear_flops_per_token(self) -> int:
        d, p, r = self.d_model, self.proj_dim, self.head_dim
        per_layer = 2 * d * 3 * p  # q, k, v
        per_layer += 2 * (2 * d * r + 2 * r * p)  # decay f and gate g, each d -> r -> p
        per_layer += 2 * d * self.n_heads  # beta
        per_layer += 2 * 3 * p * self.conv_kernel  # short convs on q, k, v
        core = delta_rule_head_flops(r, r, self.chunk_tokens)
        per_layer += self.n_heads * (core + 4 * r)  # + q, k scaled by the cumulative decay
        per_layer += p  # output gate
        per_layer += 2 * p * d  # o_proj
        return self.count * per_layer

    @property
    def _conv_bytes(self) -> int:
        return (self.conv_kernel - 1) * 3 * self.proj_dim * self.conv_dtype_bytes

    @property
    def state_bytes(self) -> int:
        rec = self.n_heads * self.head_dim * self.head_dim * self.state_dtype_bytes
        return self.count * (self._conv_bytes + rec)

    @property
    def state_bytes_int8(self) -> int:
        rec = self.n_heads * self.head_dim * self.head_dim + self.n_heads * INT8_SCALE_BYTES
        return self.count * (self._conv_bytes + rec)


@dataclass(frozen=True)
class ShortConvLayers(ZeroByDefault):
    """LFM2's double-gated short conv: ``in_proj`` to ``B, C, x`` (``3 conv_dim``),
    ``y = C * conv(B * x)`` over a window of ``conv_kernel`` tokens, ``out_proj``. Its only
    state is the last ``conv_kernel - 1`` inputs of the conv."""

    count: int
    d_model: int
    conv_dim: int
    conv_kernel: int = 3
    conv_dtype_bytes: int = 2

    @property
    def linear_flops_per_token(self) -> int:
        per_layer = 2 * self.d_model * 3 * self.conv_dim  # in_proj
        per_layer += self.conv_dim  # B * x
        per_layer += 2 * self.conv_dim * self.conv_kernel  # depthwise conv
        per_layer += self.conv_dim  # C * (.)
        per_layer += 2 * self.conv_dim * self.d_model  # out_proj
        return self.count * per_layer

    @property
    def state_bytes(self) -> int:
        return self.count * (self.conv_kernel - 1) * self.conv_dim * self.conv_dtype_bytes

    @property
    def state_bytes_int8(self) -> int:
        """Nothing to quantize: the conv state stays in its dtype (as for Mamba)."""
        return self.state_bytes
