"""Align-mode prefix caching for Mamba2 hybrids on vLLM's CPU backend.

vLLM 0.32 on CPU crashes on the first prefill of a Mamba2 hybrid with prefix caching on:

1. the CPU chunked scan (``vllm/model_executor/layers/mamba/ops/cpu/mamba_ssm.py``,
   ``_mamba_chunk_scan_combined_fwd_cpu``) ignores ``return_intermediate_states``, and
   ``MambaMixer2.forward`` (``mamba_mixer2.py``, "varlen_states[last_chunk_indices_p]") then
   indexes per-chunk states that are not there;
2. ``store_prefill_checkpoint`` (``.../mamba/ops/ssd_checkpoint.py``) is a Triton kernel.

``patch_cpu_mamba2_prefix_caching`` replaces exactly those two functions with our C++ ops
(``vllm_hybrid.ops``). The fix of vLLM's partial-hit block copy is not CPU-specific and lives in
``kv_copy.py`` (installed on every platform by ``plugin.register``).

The scan replacement is used for every CPU prefill, cached or not, so that a run with caching
and a run without it execute the same arithmetic: our scan is a sequential fp32 recurrence, and
a state resumed from a snapshot continues bit-identically.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_hybrid.adapters.vllm.compat.patches import replace_cpu_mamba2_ops
from vllm_hybrid.ops import extension_available, prepare_dt, ssd_chunk_scan
from vllm_hybrid.ops import store_prefill_checkpoint as _store_op

logger = logging.getLogger("vllm_hybrid")

_PATCHED = False


def mamba_chunk_scan_combined_fwd_cpu(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    out: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_intermediate_states: bool = False,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_chunk_seqlens: torch.Tensor | None = None,
    last_chunk_indices: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    state_dtype: torch.dtype | None = None,
    **_: Any,
) -> torch.Tensor:
    """Drop-in for vLLM's ``_mamba_chunk_scan_combined_fwd`` on CPU (same signature).

    Returns ``(nchunks, H, P, N)`` states when ``return_intermediate_states``, else the final
    ``(batch, H, P, N)`` state of every sequence; both in ``state_dtype`` (default x's dtype).
    ``out`` is written in place and does not depend on ``return_intermediate_states``.
    """
    if cu_seqlens is None or cu_chunk_seqlens is None or seq_idx is None:
        raise ValueError("the CPU SSD scan needs cu_seqlens, cu_chunk_seqlens and seq_idx")
    states = ssd_chunk_scan(
        x,
        prepare_dt(dt, dt_bias, dt_softplus, dt_limit),
        A.float(),
        B,
        C,
        out,
        cu_seqlens=cu_seqlens,
        cu_chunk_seqlens=cu_chunk_seqlens,
        chunk_seq_idx=seq_idx,
        D=_per_head(D),
        z=z,
        initial_states=initial_states,
    )
    if not return_intermediate_states:
        assert last_chunk_indices is not None
        states = states[last_chunk_indices.long()]
    return states.to(state_dtype if state_dtype is not None else x.dtype)


def _per_head(D: torch.Tensor | None) -> torch.Tensor | None:
    """Mamba2's D is per head; a (heads, head_dim) D must be a broadcast of it."""
    if D is None or D.dim() == 1:
        return D
    if D.stride(-1) == 0 or bool((D == D[:, :1]).all()):
        return D[:, 0].contiguous()
    raise ValueError("the CPU SSD scan supports a per-head D only")


def store_prefill_checkpoint_cpu(
    checkpoint: Any,
    chunk_idx: torch.Tensor,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    chunk_states: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    state_len: int,
) -> None:
    """Drop-in for vLLM's ``store_prefill_checkpoint`` (ssd_checkpoint.py), same signature."""
    _store_op(
        x,
        conv_state,
        chunk_states,
        ssm_state,
        query_start_loc,
        checkpoint.checkpoint_offsets,
        checkpoint.state_indices,
        chunk_idx,
        state_len=state_len,
    )


def patch_cpu_mamba2_prefix_caching() -> bool:
    """Install the two CPU functions into vLLM 0.32.0 (``compat.replace_cpu_mamba2_ops``);
    idempotent. True when active."""
    global _PATCHED
    if _PATCHED:
        return True
    if not extension_available():
        logger.warning(
            "vllm-hybrid: compiled ops missing, Mamba2 prefix caching on CPU stays broken; "
            "build them with `bash scripts/install.sh`."
        )
        return False
    if not replace_cpu_mamba2_ops(mamba_chunk_scan_combined_fwd_cpu, store_prefill_checkpoint_cpu):
        return False
    _PATCHED = True
    logger.info("vllm-hybrid: CPU SSD scan with chunk states and prefill checkpoints active")
    return True
