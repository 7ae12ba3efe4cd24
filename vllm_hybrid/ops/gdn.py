"""The gated delta rule (Qwen3-Next / Qwen3.5 / OLMo-Hybrid "GDN" layers, and Kimi-Linear's
Kimi delta attention) in float32, one token at a time.

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
key heads, value head ``h`` reads key head ``h // (Hv / Hk)``. Kimi delta attention is the same
rule with ``g`` a vector over ``K``: row ``i`` of ``S`` is scaled by ``exp(g[i])`` (gates from
:func:`kda_gating_ref`); pass ``g`` as ``[T, Hv, K]`` instead of ``[T, Hv]``.

Why sequential: the state after ``n`` tokens is then the same bits however the tokens were cut
into prefill chunks, so a run that resumes from a cached state continues exactly as a run
that never stopped (vLLM's CPU GDN ops are bfloat16-only and chunked).

Two implementations with the same bits (docs/kernels.md, "gated_delta_rule"):

- ``gated_delta_rule``: the C++ op (csrc/cpu/gdn.cpp), all sequences of a batch in one call,
  states in a pool addressed by slot; parallel over (sequence, value head, 16 value columns).
- ``gated_delta_rule_ref``: its pure-torch twin, one sequence, a Python loop over tokens
  (``gated_delta_rule_varlen_ref`` loops it over a batch with the op's signature).

Both fix every rounding: each product and sum is one float32 operation (no fused multiply-add),
every sum over ``K`` runs in the order of :func:`lane_sum` (16 lanes, then a halving tree),
``exp(g)`` is computed in float64 and rounded once, the norm is ``x * (1 / sqrt(sum x^2 +
eps))`` with an IEEE (correctly rounded) float32 sqrt and division. Nothing depends on the
vector width, the batch layout or the position of a token in a tensor, so the op equals the
twin bit for bit (the tests assert it) and both are exact under any chunking.
:func:`gdn_gating_ref` computes the gates in float64 for the same reason: torch's float32
``softplus`` / ``sigmoid`` give different bits in the vectorised body and the scalar tail of a
tensor, i.e. for one token depending on where the batch put it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_hybrid.ops._loader import op

#: L2-norm epsilon of q and k (FLA's, vLLM's and transformers').
L2_EPS = 1e-6

#: Accumulator lanes of every sum over K (csrc/cpu/gdn.cpp's kLanes; they must agree).
LANES = 16


def gdn_gating_ref(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` of shape ``[T, Hv]`` in float32 from ``a, b`` of shape ``[T, Hv]``.

    Computed in float64 and rounded once: the bits of a token's gates do not depend on where
    it sits in the batch (torch's float32 softplus and sigmoid differ between the vectorised
    body and the scalar tail of a tensor)."""
    g = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    return g.float(), b.double().sigmoid().float()


def kda_gating_ref(
    A_log: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi delta attention's gates: ``g`` ``[T, H, K]`` (one decay per key channel) and
    ``beta`` ``[T, H]`` in float32, from ``raw_g`` ``[T, H * K]``, ``raw_beta`` ``[T, H]``,
    ``A_log`` ``[H]`` and ``dt_bias`` ``[H * K]``.

    ``g = -exp(A_log) * softplus(raw_g + dt_bias)``, or with a ``lower_bound`` (the "safe
    gate") ``g = lower_bound * sigmoid(exp(A_log) * (raw_g + dt_bias))``; ``beta =
    sigmoid(raw_beta)``: FLA's ``fused_kda_gate`` as vLLM vendors it
    (``vllm/models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py``). In float64,
    rounded once, for the reason given in :func:`gdn_gating_ref`."""
    heads = A_log.numel()
    x = (raw_g.double() + dt_bias.double()).view(raw_g.shape[0], heads, -1)
    rate = A_log.double().view(1, heads, 1).exp()
    if lower_bound is None:
        g = -rate * F.softplus(x)
    else:
        g = lower_bound * (rate * x).sigmoid()
    return g.float(), raw_beta.double().sigmoid().float()


def lane_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` in the op's order: element ``i`` goes to lane ``i % 16``, each lane adds
    its elements in index order (starting from the first, not from 0), then the lanes are
    folded by halving: with ``n`` lanes left and ``h = ceil(n / 2)``, lane ``i`` += lane
    ``i + h`` for ``i < n - h``, until one is left. Every step is an elementwise float32 add."""
    n = x.shape[dim]
    if n == 0:
        return torch.zeros_like(x.narrow(dim, 0, 0).sum(dim))
    lanes = min(LANES, n)
    acc = x.narrow(dim, 0, lanes).clone()
    for start in range(lanes, n, lanes):
        width = min(lanes, n - start)
        acc.narrow(dim, 0, width).add_(x.narrow(dim, start, width))
    while lanes > 1:
        half = (lanes + 1) // 2
        acc.narrow(dim, 0, lanes - half).add_(acc.narrow(dim, half, lanes - half))
        lanes = half
    return acc.narrow(dim, 0, 1).squeeze(dim)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # sqrt in float64, rounded once: the correctly rounded float32 sqrt (C's sqrtf). torch's
    # float32 sqrt on CPU is not (MKL's vector math: about 15% of inputs differ by an ulp).
    root = torch.sqrt((lane_sum(x * x, -1) + L2_EPS).double()).float()
    return x * root.reciprocal().unsqueeze(-1)


def _check(
    q: torch.Tensor, v: torch.Tensor, state: torch.Tensor, pooled: bool, g: torch.Tensor
) -> None:
    if state.dtype != torch.float32:
        raise TypeError(f"the gated delta rule state must be float32, got {state.dtype}")
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    if tuple(g.shape) not in ((q.shape[0], hv), (q.shape[0], hv, dk)):
        raise ValueError(
            f"g must be (tokens, value heads) or (tokens, value heads, K) = "
            f"({q.shape[0]}, {hv}[, {dk}]), got {tuple(g.shape)}"
        )
    shape = tuple(state.shape[1:]) if pooled else tuple(state.shape)
    if hv % hk or shape != (hv, dk, dv) or (pooled and state.dim() != 4):
        want = f"(slots, {hv}, {dk}, {dv})" if pooled else f"({hv}, {dk}, {dv})"
        raise ValueError(
            f"shapes do not fit: q/k {tuple(q.shape)}, v {tuple(v.shape)}, "
            f"state {tuple(state.shape)} (want {want}, Hv a multiple of Hk)"
        )


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """Run one sequence through the rule and return its outputs ``[T, Hv, V]`` (float32).

    ``q, k``: ``[T, Hk, K]``; ``v``: ``[T, Hv, V]``; ``beta``: ``[T, Hv]``; ``g``: ``[T, Hv]``
    (one decay per head: GDN) or ``[T, Hv, K]`` (one per key channel, i.e. per row of the
    state: Kimi delta attention); ``state``: ``[Hv, K, V]`` float32, the state before the first
    token, updated in place to the state after the last one.
    """
    _check(q, v, state, pooled=False, g=g)
    tokens, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    group = hv // hk
    q = _l2norm(q.float()).repeat_interleave(group, dim=1) * (dk**-0.5)
    k = _l2norm(k.float()).repeat_interleave(group, dim=1)
    v, decay, beta = v.float(), g.double().exp().float(), beta.float()
    if decay.dim() == 2:  # one decay per head: the same for every row of the state
        decay = decay.unsqueeze(-1)
    out = torch.empty(tokens, hv, dv, dtype=torch.float32, device=v.device)
    s = state
    for t in range(tokens):
        s.mul_(decay[t, :, :, None])  # row i of head h's state by exp(g[t, h(, i)])
        kt = k[t, :, :, None]  # [Hv, K, 1]
        delta = (v[t] - lane_sum(s * kt, 1)) * beta[t, :, None]  # [Hv, V]
        s.add_(kt * delta[:, None, :])
        out[t] = lane_sum(s * q[t, :, :, None], 1)
    return out


def gated_delta_rule_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch twin of :func:`gated_delta_rule` with ``cu_seqlens``: ``gated_delta_rule_ref``
    per sequence, from and into its pool slot."""
    _check(q, v, state, pooled=True, g=g)
    if out is None:
        out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32)
    bounds = cu_seqlens.tolist()
    slots = range(len(bounds) - 1) if state_indices is None else state_indices.tolist()
    for seq, slot in enumerate(slots):
        lo, hi = bounds[seq], bounds[seq + 1]
        if hi == lo or slot < 0:  # an empty sequence, or a padded slot (vLLM's PAD_SLOT_ID)
            continue
        fresh = has_initial_state is not None and not bool(has_initial_state[seq])
        run = torch.zeros_like(state[slot]) if fresh else state[slot].clone()
        out[lo:hi] = gated_delta_rule_ref(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], run)
        if output_final_state:
            state[slot].copy_(run)
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The C++ op (csrc/cpu/gdn.cpp); the same bits as the twins.

    Without ``cu_seqlens``: one sequence, exactly :func:`gated_delta_rule_ref`'s contract
    (``state`` ``[Hv, K, V]`` updated in place). With it, a batch:

    - ``q, k``: ``[T, Hk, K]``; ``v``: ``[T, Hv, V]``; ``beta``: ``[T, Hv]``; ``g``:
      ``[T, Hv]`` or ``[T, Hv, K]`` (per key channel); any float dtype (read as float32), any
      strides.
    - ``state``: ``[slots, Hv, K, V]`` float32, each slot's ``[Hv, K, V]`` contiguous (slots
      may be padded: any ``stride(0)``), e.g. vLLM's ``ssm_state`` viewed as ``[K, V]``.
    - ``cu_seqlens``: ``[B + 1]`` int, sequence starts in the token dim.
    - ``state_indices``: ``[B]`` int or None (sequence ``b`` uses slot ``b``); a negative slot
      skips its sequence (nothing is read or written, as vLLM's ``PAD_SLOT_ID``).
    - ``has_initial_state``: ``[B]`` bool or None (all True); False starts from zeros.
    - ``output_final_state``: write each sequence's final state into its slot (else ``state``
      is only read). Two sequences may not write one slot.
    - ``out``: ``[T, Hv, V]`` float32, any strides, or None (allocated); rows of skipped
      sequences are left untouched. Returned.
    """
    single = cu_seqlens is None
    _check(q, v, state, pooled=not single, g=g)
    tokens, dk = q.shape[0], q.shape[2]
    if single:
        state = state.unsqueeze(0)
        cu_seqlens = torch.tensor([0, tokens], dtype=torch.int64)
    if out is None:
        out = torch.empty(tokens, v.shape[1], v.shape[2], dtype=torch.float32)
    op("gated_delta_rule_fwd")(
        out,
        q,
        k,
        v,
        g,
        beta,
        state,
        cu_seqlens,
        state_indices,
        has_initial_state,
        float(dk**-0.5),
        output_final_state,
    )
    return out
