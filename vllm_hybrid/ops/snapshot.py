"""Fused batched snapshot save / restore of recurrent states, plain and int8-compressed.

A *snapshot* of a sequence is the conv state and the SSM state of every recurrent layer at one
token position. vLLM keeps them per layer as block-indexed views, often strided views into a
larger padded page: ``conv_state`` (blocks, dim, width) and ``ssm_state`` (blocks, H, P, N). These
ops move the snapshots of a batch of (source block, destination block) pairs for *all* listed
tensors in one call (one OpenMP loop on CPU, one kernel launch on CUDA).

``snapshot_copy(src_tensors, dst_tensors, pairs)``
    src_tensors, dst_tensors: equal-length lists; entry i is one state tensor of one layer,
        (blocks_i, *S_i), any dtype, the same dtype and the same per-block layout (sizes and
        strides past dim 0) on both sides. Within a block the elements must tile a dense span in
        some order (contiguous, transposed, or a view into a padded page); blocks may be padded
        (stride(0) >= block numel). The lists may hold the same tensors (copy within one pool)
        or different ones (e.g. device pool <-> host pool; on CUDA every tensor is on the
        current device or in pinned host memory).
    pairs: (n, 2) int64/int32 on any device: column 0 a source block, column 1 a destination
        block, valid for every tensor of the respective list.
    Mutates dst_tensors[i][pairs[:, 1]] = src_tensors[i][pairs[:, 0]] for every i; nothing else.
    Rejected (RuntimeError): a destination block twice in one call (two writers, no defined
    order), and, when a source tensor shares storage with a destination tensor, a block that is
    both written and read in the same call. A repeated *source* block is fine.

``snapshot_quantize_int8(states, q_tensors, scales, pairs)``  (save, compressing)
``snapshot_dequantize_int8(q_tensors, scales, states, pairs)``  (restore)
    states: list of (blocks_i, G_i, *R_i) float32/float16/bfloat16 state tensors (dims past the
        second form one strided run, e.g. contiguous (P, N) or a transposed conv view);
    q_tensors: list of int8 (qblocks_i, G_i, *R_i), the compressed pool;
    scales: list of float32 (qblocks_i, G_i): one scale per index of dim 1 of each state, i.e.
        per head of an SSM state (H, P, N) and per channel of a conv state (dim, width).
    Save mutates q_tensors[i][d] and scales[i][d] from states[i][s]; restore mutates states[i][d]
    from q_tensors[i][s] and scales[i][s], for every pair (s, d). Same pair rules as above.
    Arithmetic (fp32, identical in C++, CUDA and the ``*_ref`` twins, so they agree bit for
    bit): scale = absmax / 127 (0 for an all-zero group); q = clamp(round_half_even(x / scale),
    -127, 127); restored = cast(q * scale). Error bound per element, for finite states:
        |x - restored| <= scale * (1/2 + 2**-16) + u * |restored|
    with u the unit roundoff of the state dtype when it is narrower than fp32 (bf16: 2**-8,
    fp16: 2**-11; 0 for fp32).  See ``int8_error_bound``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_hybrid.ops._loader import op

#: unit roundoff of the dtypes a restored state can be cast to
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def snapshot_copy(
    src_tensors: Sequence[torch.Tensor], dst_tensors: Sequence[torch.Tensor], pairs: torch.Tensor
) -> None:
    """C++/CUDA op; see the module docstring for the contract."""
    op("snapshot_copy")(list(src_tensors), list(dst_tensors), pairs)


def snapshot_copy_ref(
    src_tensors: Sequence[torch.Tensor], dst_tensors: Sequence[torch.Tensor], pairs: torch.Tensor
) -> None:
    """Pure-torch twin of ``snapshot_copy`` (no validation beyond torch's own)."""
    src_idx, dst_idx = pairs[:, 0].long(), pairs[:, 1].long()
    for src, dst in zip(src_tensors, dst_tensors, strict=True):
        rows = src.index_select(0, src_idx.to(src.device))
        dst.index_copy_(0, dst_idx.to(dst.device), rows.to(dst.device))


def snapshot_quantize_int8(
    states: Sequence[torch.Tensor],
    q_tensors: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    pairs: torch.Tensor,
) -> None:
    """C++/CUDA op: compress states[i][s] into q_tensors[i][d], scales[i][d]."""
    op("snapshot_quantize_int8")(list(states), list(q_tensors), list(scales), pairs)


def snapshot_dequantize_int8(
    q_tensors: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    pairs: torch.Tensor,
) -> None:
    """C++/CUDA op: restore states[i][d] from q_tensors[i][s], scales[i][s]."""
    op("snapshot_dequantize_int8")(list(q_tensors), list(scales), list(states), pairs)


def quantize_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, G, *R) float -> int8 of the same shape and fp32 scales (blocks, G)."""
    xf = x.float().flatten(2) if x.dim() > 2 else x.float().unsqueeze(-1)
    scale = xf.abs().amax(dim=-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    q = torch.where(scale.unsqueeze(-1) > 0, torch.round(xf / safe), torch.zeros_like(xf))
    return q.clamp(-127, 127).to(torch.int8).view(x.shape), scale


def dequantize_int8_ref(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_int8_ref``, cast to ``dtype``."""
    shape = [*scale.shape] + [1] * (q.dim() - 2)
    return (q.float() * scale.view(shape)).to(dtype)


def snapshot_quantize_int8_ref(
    states: Sequence[torch.Tensor],
    q_tensors: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    pairs: torch.Tensor,
) -> None:
    """Pure-torch twin of ``snapshot_quantize_int8``."""
    src_idx, dst_idx = pairs[:, 0].long(), pairs[:, 1].long()
    for x, q, s in zip(states, q_tensors, scales, strict=True):
        qv, sv = quantize_int8_ref(x.index_select(0, src_idx.to(x.device)))
        q.index_copy_(0, dst_idx.to(q.device), qv.to(q.device))
        s.index_copy_(0, dst_idx.to(s.device), sv.to(s.device))


def snapshot_dequantize_int8_ref(
    q_tensors: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    pairs: torch.Tensor,
) -> None:
    """Pure-torch twin of ``snapshot_dequantize_int8``."""
    src_idx, dst_idx = pairs[:, 0].long(), pairs[:, 1].long()
    for q, s, x in zip(q_tensors, scales, states, strict=True):
        idx = src_idx.to(q.device)
        restored = dequantize_int8_ref(q.index_select(0, idx), s.index_select(0, idx), x.dtype)
        x.index_copy_(0, dst_idx.to(x.device), restored.to(x.device))


def int8_error_bound(restored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |x - restored| (see the module docstring); broadcast like x."""
    shape = [*scale.shape] + [1] * (restored.dim() - scale.dim())
    u = UNIT_ROUNDOFF[restored.dtype]
    return scale.view(shape) * (0.5 + 2.0**-16) + u * restored.float().abs()


def int8_pool_like(
    states: Sequence[torch.Tensor], blocks: int, device: torch.device | str | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Allocate an int8 snapshot pool of ``blocks`` blocks for ``states`` (zeros)."""
    q = [torch.zeros(blocks, *x.shape[1:], dtype=torch.int8, device=device) for x in states]
    s = [torch.zeros(blocks, x.shape[1], dtype=torch.float32, device=device) for x in states]
    return q, s
