"""Cost model: prefill FLOPs of a token span and bytes held per block and per snapshot.

All quantities derive from a :class:`~vllm_hybrid.core.shapes.ModelShape`; the formulas are
derived in docs/cost_model.md. Ranges are half-open: ``span_flops(a, b)`` is the cost of
prefilling tokens ``[a, b)`` when the prefix ``[0, a)`` is already cached (its KV is read by
attention, so the attention term depends on ``a``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_hybrid.core.model_shape import ModelShape


@dataclass(frozen=True)
class CostModel:
    """FLOPs and bytes for one model shape at one block size."""

    shape: ModelShape
    block_tokens: int
    #: ``(KV bytes per token, bytes per snapshot)`` as the engine really holds them (e.g. its
    #: padded pages), in place of the shape's natural sizes; None: the shape's.
    held_bytes: tuple[int, int] | None = None
    #: Snapshots stored compressed (int8 SSM state + per-head scales; docs/kernels.md) instead
    #: of in the state's dtype. Only the bytes change: FLOPs saved by a hit are the same.
    int8_snapshots: bool = False

    @classmethod
    def from_pages(
        cls, shape: ModelShape, block_tokens: int, kv_block_bytes: int, snapshot_bytes: int
    ) -> CostModel:
        """FLOPs of ``shape``, bytes as a page pool holds them: one block of KV costs
        ``kv_block_bytes`` (its pages in every attention group), a snapshot ``snapshot_bytes``
        (its pages in every recurrent group)."""
        return cls(shape, block_tokens, (max(1, kv_block_bytes // block_tokens), snapshot_bytes))

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")
        if self.held_bytes is not None and min(self.held_bytes) <= 0:
            raise ValueError(f"held bytes must be positive, got {self.held_bytes}")

    @property
    def kv_bytes_per_token(self) -> int:
        if self.held_bytes is not None:
            return self.held_bytes[0]
        return self.shape.kv_bytes_per_token

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_tokens

    @property
    def snapshot_bytes(self) -> int:
        if self.held_bytes is not None:
            return self.held_bytes[1]
        if self.int8_snapshots:
            return self.shape.snapshot_bytes_int8
        return self.shape.snapshot_bytes

    def span_flops(self, a_tokens: int, b_tokens: int) -> float:
        """FLOPs to prefill ``[a_tokens, b_tokens)`` given the cached prefix ``[0, a_tokens)``."""
        if not 0 <= a_tokens <= b_tokens:
            raise ValueError(f"bad span [{a_tokens}, {b_tokens})")
        pairs = (b_tokens * (b_tokens + 1) - a_tokens * (a_tokens + 1)) // 2
        linear = self.shape.linear_flops_per_token * (b_tokens - a_tokens)
        return float(linear + self.shape.pair_flops * pairs)

    def prefill_flops(self, n_tokens: int) -> float:
        """FLOPs to prefill a whole prompt of ``n_tokens`` with nothing cached."""
        return self.span_flops(0, n_tokens)
