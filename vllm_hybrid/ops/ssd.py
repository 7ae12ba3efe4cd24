"""Mamba2 SSD scan that returns the state at the end of every logical chunk.

``ssd_chunk_scan`` runs the C++ op (csrc/cpu/ssd_scan.cpp); ``ssd_chunk_scan_ref`` is its
pure-torch twin, written in the chunked ("state space dual") form rather than as a token loop,
so that the two implementations share no structure.

Shapes (T tokens over all sequences, H heads, P head_dim, G groups, N d_state):
    x: (T, H, P)        any float dtype, any strides
    dt: (T, H)          fp32, final step sizes (bias, softplus and clamp already applied;
                        see ``prepare_dt``)
    A: (H,)             fp32, negative
    B, C: (T, G, N)     H % G == 0
    D: (H,) or None;    z: (T, H, P) or None (output gate y * silu(z))
    initial_states: (batch, H, P, N) or None
    cu_seqlens: (batch + 1,) int, sequence starts
    cu_chunk_seqlens: (nchunks + 1,) int, logical chunk starts; chunks tile every sequence in
        order and never cross a sequence boundary (vLLM splits at chunk_size multiples of the
        absolute position and at prefill checkpoints)
    chunk_seq_idx: (nchunks,) int, the sequence each chunk belongs to
    out: (T, H, P), written in place (mutated); nothing else is mutated.
Returns: (nchunks, H, P, N) fp32, the state after the last token of every chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_hybrid.ops._loader import op


def prepare_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    softplus: bool,
    limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """Final fp32 step sizes: ``clamp(softplus(dt + bias))`` as Mamba2 defines them."""
    out = dt.float()
    if dt_bias is not None:
        out = out + dt_bias.float().unsqueeze(0)
    if softplus:
        out = F.softplus(out)
    if limit[0] > 0.0 or limit[1] < float("inf"):
        out = out.clamp(min=limit[0], max=limit[1])
    return out


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    cu_chunk_seqlens: torch.Tensor,
    chunk_seq_idx: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """C++ scan; see the module docstring for the contract."""
    return op("ssd_scan_fwd")(
        out, x, dt, A, B, C, D, z, initial_states, cu_seqlens, cu_chunk_seqlens, chunk_seq_idx
    )


def ssd_chunk_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    cu_chunk_seqlens: torch.Tensor,
    chunk_seq_idx: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch twin of ``ssd_chunk_scan`` (chunked dual form, fp32)."""
    H, P, N = x.shape[1], x.shape[2], B.shape[2]
    rep = H // B.shape[1]
    xf, Bf, Cf = x.float(), B.float().repeat_interleave(rep, 1), C.float().repeat_interleave(rep, 1)
    bounds = cu_chunk_seqlens.tolist()
    owners = chunk_seq_idx.tolist()
    states = torch.zeros(len(owners), H, P, N)
    y = torch.zeros(x.shape, dtype=torch.float32)
    prev_owner = -1
    for c, seq in enumerate(owners):
        if seq != prev_owner:
            s = torch.zeros(H, P, N) if initial_states is None else initial_states[seq].float()
            prev_owner = seq
        a, b = bounds[c], bounds[c + 1]
        y[a:b], s = _chunk_dual(xf[a:b], dt[a:b].float(), A.float(), Bf[a:b], Cf[a:b], s)
        states[c] = s
    if D is not None:
        y += D.float().view(1, H, 1) * xf
    if z is not None:
        y *= F.silu(z.float())
    out.copy_(y)
    return states


def _chunk_dual(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    s0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: outputs (l, H, P) without D, and the state after its last token.

    cum[t] = sum_{u<=t} dt[u] A;  L[t, u] = exp(cum[t] - cum[u]) for u <= t
    y[t]   = exp(cum[t]) C[t].s0 + sum_{u<=t} L[t, u] (C[t].B[u]) dt[u] x[u]
    s_end  = exp(cum[-1]) s0 + sum_u exp(cum[-1] - cum[u]) dt[u] x[u] (outer) B[u]
    """
    cum = torch.cumsum(dt * A.view(1, -1), dim=0)  # (l, H)
    seg = cum.unsqueeze(1) - cum.unsqueeze(0)  # (t, u, H)
    causal = torch.tril(torch.ones(seg.shape[:2], dtype=torch.bool)).unsqueeze(-1)
    L = torch.where(causal, seg, float("-inf")).exp()
    scores = torch.einsum("thn,uhn->tuh", C, B) * L  # (t, u, H)
    y = torch.einsum("tuh,uh,uhp->thp", scores, dt, x)
    y += torch.einsum("thn,hpn->thp", C, s0) * cum.exp().unsqueeze(-1)
    w = (cum[-1].unsqueeze(0) - cum).exp() * dt  # (l, H)
    s_end = s0 * cum[-1].exp().view(-1, 1, 1) + torch.einsum("uh,uhp,uhn->hpn", w, x, B)
    return y, s_end
