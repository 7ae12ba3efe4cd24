"""The gated delta rule (Qwen3-Next / Qwen3.5 "GDN" layers) in float32, one token at a time.

For one head, with state ``S`` of shape ``[K, V]`` and per token ``q, k`` (``[K]``), ``v``
(``[V]``), decay ``g`` and write strength ``beta`` (scalars)::

    S   <- S * exp(g)
    d   =  (v - S^T k) * beta          # the delta: what S does not yet predict for k
    S   <- S + k d^T
    o   =  S^T (q / sqrt(K))

with ``q`` and ``k`` L2-normalised first (eps 1e-6), as vLLM's CPU kernels and transformers'
``torch_recurrent_gated_delta_rule`` do with ``use_qk_l2norm_in_kernel``. The gates come from
the layer's ``A_log``, ``dt_bias`` and projections ``a``, ``b``:
``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``. With more value heads than
key heads, value head ``h`` reads key head ``h // (Hv / Hk)``.

Why sequential: the state after ``n`` tokens is then the same bits however the tokens were cut
into prefill chunks, so a run that resumes from a cached state continues exactly as a run
that never stopped (vLLM's CPU GDN ops are bfloat16-only and chunked). The cost is a Python
loop over tokens: fine for tests and tiny models, not a production kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: L2-norm epsilon of q and k (FLA's, vLLM's and transformers').
L2_EPS = 1e-6


def gdn_gating_ref(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` of shape ``[T, Hv]`` in float32 from ``a, b`` of shape ``[T, Hv]``."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """Run one sequence through the rule and return its outputs ``[T, Hv, V]`` (float32).

    ``q, k``: ``[T, Hk, K]``; ``v``: ``[T, Hv, V]``; ``g, beta``: ``[T, Hv]``; ``state``:
    ``[Hv, K, V]`` float32, the state before the first token, updated in place to the state
    after the last one.
    """
    if state.dtype != torch.float32:
        raise TypeError(f"the gated delta rule state must be float32, got {state.dtype}")
    tokens, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if hv % hk or state.shape != (hv, dk, dv):
        raise ValueError(
            f"shapes do not fit: q/k {tuple(q.shape)}, v {tuple(v.shape)}, "
            f"state {tuple(state.shape)} (want ({hv}, {dk}, {dv}), Hv a multiple of Hk)"
        )
    group = hv // hk
    q = _l2norm(q.float()).repeat_interleave(group, dim=1) * (dk**-0.5)
    k = _l2norm(k.float()).repeat_interleave(group, dim=1)
    v, decay, beta = v.float(), g.float().exp(), beta.float()
    out = torch.empty(tokens, hv, dv, dtype=torch.float32, device=v.device)
    s = state
    for t in range(tokens):
        s.mul_(decay[t, :, None, None])
        kt = k[t, :, :, None]  # [Hv, K, 1]
        delta = (v[t] - (s * kt).sum(dim=1)) * beta[t, :, None]  # [Hv, V]
        s.add_(kt * delta[:, None, :])
        out[t] = (s * q[t, :, :, None]).sum(dim=1)
    return out
