"""What every layer group shares: zero defaults for the terms a kind does not have.

Kept apart from :mod:`vllm_hybrid.core.layers` so the layer kinds can live in more than one
module (:mod:`vllm_hybrid.core.linear_attn` holds the delta-rule and short-conv kinds) without
an import cycle.
"""

from __future__ import annotations

#: Bytes of one fp32 scale of an int8 snapshot (csrc/cpu/snapshot_int8.cpp: one per index of
#: dim 1 of a state, i.e. per head of a Mamba2 SSM state, per channel of a Mamba1 one).
INT8_SCALE_BYTES = 4


class ZeroByDefault:
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
