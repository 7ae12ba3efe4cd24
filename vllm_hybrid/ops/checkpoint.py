"""Store a prefill checkpoint (conv history + SSM state at an exact token) into paged blocks.

``store_prefill_checkpoint`` runs the C++ op (csrc/cpu/prefill_checkpoint.cpp), the CPU twin of
vLLM 0.32's Triton kernel of the same name; ``store_prefill_checkpoint_ref`` is its pure-torch
twin.

Shapes (R prefill rows, D conv dim, K blocks, W conv width >= state_len):
    x: (D, T)                    pre-conv activations of the prefill tokens, any strides
    conv_state: (K, D, W)        paged conv state (mutated: block state_indices[r], first
                                 state_len columns)
    chunk_states: (nchunks, *S)  states at every logical chunk end (``ssd_chunk_scan``)
    ssm_state: (K, *S)           paged SSM state (mutated: block state_indices[r]); its dtype
                                 may differ from chunk_states (values are cast)
    query_start_loc: (R + 1,)    int, row starts in x's token dimension
    checkpoint_offsets: (R,)     int, tokens into the row's query; 0 = row has no checkpoint
    state_indices: (R,)          int, destination block per row
    chunk_idx: (R,)              int, the chunk of chunk_states that ends on the checkpoint
For a row with offset o > 0 and start q: conv_state[dst, :, j] = x[:, q + o - state_len + j]
for j in [0, state_len), and ssm_state[dst] = chunk_states[chunk_idx[r]].
"""

from __future__ import annotations

import torch

from vllm_hybrid.ops._loader import op


def store_prefill_checkpoint(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    chunk_states: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    checkpoint_offsets: torch.Tensor,
    state_indices: torch.Tensor,
    chunk_idx: torch.Tensor,
    *,
    state_len: int,
) -> None:
    """C++ op; see the module docstring for the contract."""
    op("store_prefill_checkpoint")(
        x,
        conv_state,
        chunk_states,
        ssm_state,
        query_start_loc,
        checkpoint_offsets,
        state_indices,
        chunk_idx,
        state_len,
    )


def store_prefill_checkpoint_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    chunk_states: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    checkpoint_offsets: torch.Tensor,
    state_indices: torch.Tensor,
    chunk_idx: torch.Tensor,
    *,
    state_len: int,
) -> None:
    """Pure-torch twin of ``store_prefill_checkpoint``."""
    starts = query_start_loc.tolist()
    for row, offset in enumerate(checkpoint_offsets.tolist()):
        if offset <= 0:
            continue
        dst, end = int(state_indices[row]), starts[row] + offset
        conv_state[dst, :, :state_len] = x[:, end - state_len : end]
        ssm_state[dst] = chunk_states[int(chunk_idx[row])]
