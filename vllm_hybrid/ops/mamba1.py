"""Mamba1 selective scan (Jamba's SSM layers) in float32, one token at a time.

For channel ``d`` with state ``s`` of ``N`` values and per token ``u, delta, z`` (scalars) and
``B, C`` (``[N]``, of the channel's group)::

    dt  = softplus(delta + bias)                 # threshold 20, as vLLM's CUDA kernel
    s   = exp(dt * A[d]) * s + B * (dt * u)
    y   = D[d] * u + sum_n s[n] C[n]              # n in index order
    out = y;  out_z = y * silu(z)

Two implementations with the same bits (docs/kernels.md, "selective_scan"):

- ``selective_scan``: the C++ op (csrc/cpu/selective_scan.cpp) with the arguments vLLM 0.32's
  ``selective_scan_fn`` passes to ``torch.ops._C.selective_scan_fwd`` in its varlen, non-APC
  form: ``u, delta, z`` ``(D, T)``, ``B, C`` ``(G, N, T)``, states ``(slots, D, N)`` read from
  and written back to ``cache_indices`` (the initial state only where ``has_initial_state``);
  ``delta`` receives ``y`` and ``z`` receives the gated output, in place.
- ``selective_scan_ref``: its pure-torch twin, a Python loop over tokens (and over ``n`` for
  the sum), with softplus, the decay and silu in float64 rounded once, as the op does: torch's
  float32 ``softplus`` / ``exp`` give different bits in the vectorised body and the scalar tail
  of a tensor.

Sequential, so the state after ``n`` tokens is the same bits however the prompt was cut into
prefill chunks: a run resumed from a cached state continues exactly as one that never stopped.
"""

from __future__ import annotations

import torch

from vllm_hybrid.ops._loader import op

#: softplus threshold (vLLM's CUDA kernel and torch's default).
SOFTPLUS_THRESHOLD = 20.0


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    ssm_states: torch.Tensor,
    null_block_id: int,
) -> None:
    """C++ op; see the module docstring. Mutates ``delta``, ``z`` and ``ssm_states``."""
    op("selective_scan_fwd")(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, query_start_loc,
        cache_indices, has_initial_state, ssm_states, null_block_id,
    )  # fmt: skip


def _softplus64(x: torch.Tensor) -> torch.Tensor:
    wide = x.double()
    return torch.where(x <= SOFTPLUS_THRESHOLD, torch.log1p(torch.exp(wide)), wide).float()


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    ssm_states: torch.Tensor,
    null_block_id: int,
) -> None:
    """Pure-torch twin of :func:`selective_scan` (same arguments, same mutations, same bits)."""
    dim, n_state = A.shape
    rep = dim // B.shape[0]
    uf, df, Af = u.float(), delta.float(), A.float()
    Bf = B.float().repeat_interleave(rep, 0)  # (D, N, T)
    Cf = C.float().repeat_interleave(rep, 0)
    Dv = D.float() if D is not None else torch.zeros(dim)
    out = torch.zeros(uf.shape)
    out_z = torch.zeros(uf.shape) if z is not None else None
    starts = query_start_loc.tolist()
    finals: dict[int, torch.Tensor] = {}
    for b in range(len(starts) - 1):
        slot = int(cache_indices[b]) if cache_indices is not None else b
        if slot == null_block_id:
            continue
        init = has_initial_state is not None and bool(has_initial_state[b])
        s = ssm_states[slot].float().clone() if init else torch.zeros(dim, n_state)
        for t in range(starts[b], starts[b + 1]):
            dt = df[:, t]
            if delta_bias is not None:
                dt = dt + delta_bias.float()
            if delta_softplus:
                dt = _softplus64(dt)
            du = dt * uf[:, t]
            decay = torch.exp((dt.unsqueeze(1) * Af).double()).float()
            s = decay * s + Bf[:, :, t] * du.unsqueeze(1)
            y = Dv * uf[:, t]
            for n in range(n_state):
                y = y + s[:, n] * Cf[:, n, t]
            out[:, t] = y
            if z is not None and out_z is not None:
                zt = z[:, t].double()
                out_z[:, t] = y * (zt / (1.0 + torch.exp(-zt))).float()
        finals[slot] = s
    delta.copy_(out)
    if z is not None and out_z is not None:
        z.copy_(out_z)
    for slot, s in finals.items():
        ssm_states[slot].copy_(s)
