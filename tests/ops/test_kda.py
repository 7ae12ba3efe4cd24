"""``ops.gdn`` with a per-channel decay (Kimi delta attention, Kimi-Linear's KDA layers): the
twin equals transformers' sequential ``recurrent_kimi_delta_attention`` and an independent
float64 recurrence written here; the C++ op equals the twin bit for bit (several sequences,
odd sizes, initial state on/off, strided inputs, padded slots); a state after a sequence is
the same bits however the sequence is cut; and a per-channel decay equal on every channel is
the per-head (GDN) rule, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import assert_cuts_change_no_bit, requires_ext, run_rule_op_and_twin
from vllm_hybrid.ops.gdn import (
    gated_delta_rule,
    gated_delta_rule_ref,
    kda_gating_ref,
)


def _inputs(tokens: int, heads: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dk, generator=gen)
    k = torch.randn(tokens, heads, dk, generator=gen)
    v = torch.randn(tokens, heads, dv, generator=gen)
    raw_g = torch.randn(tokens, heads * dk, generator=gen)
    raw_beta = torch.randn(tokens, heads, generator=gen)
    A_log = torch.empty(heads).uniform_(1, 16, generator=gen).log()  # transformers' init
    dt_bias = torch.randn(heads * dk, generator=gen)
    g, beta = kda_gating_ref(A_log, raw_g, raw_beta, dt_bias)
    return q, k, v, g, beta


def _textbook(q, k, v, g, beta, state):
    """KDA one token at a time in float64: S <- diag(exp g) S; S <- S + k ((v - S^T k) beta)^T;
    o = S^T q, with q, k L2-normalised (eps 1e-6) and q scaled by 1/sqrt(K)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s, outs = state.double().clone(), []
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            s[h] = torch.diag(g[t, h].exp()) @ s[h]
            delta = (v[t, h] - s[h].T @ k[t, h]) * beta[t, h]
            s[h] = s[h] + torch.outer(k[t, h], delta)
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(outs), s


@pytest.mark.parametrize(
    "tokens, heads, dk, dv, initial",
    [(1, 1, 8, 8, False), (37, 2, 16, 24, True), (65, 3, 7, 5, False)],
)
def test_ref_equals_transformers_and_textbook(tokens, heads, dk, dv, initial):
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    q, k, v, g, beta = _inputs(tokens, heads, dk, dv)
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(heads, dk, dv, generator=gen) if initial else torch.zeros(heads, dk, dv)
    state = start.clone()
    out = gated_delta_rule_ref(q, k, v, g, beta, state)
    # the torch function itself, not a hub kernel or FLA that the decorator may pick
    recurrence = getattr(
        kimi.recurrent_kimi_delta_attention, "__wrapped__", kimi.recurrent_kimi_delta_attention
    )
    want, want_state = recurrence(
        q[None], k[None], v[None], g[None], beta[None], start[None].clone(), True, True
    )
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state[0], rtol=1e-5, atol=1e-5)
    book, book_state = _textbook(q, k, v, g, beta, start)
    torch.testing.assert_close(out.double(), book, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), book_state, rtol=1e-5, atol=1e-5)


def test_gating_formula_and_lower_bound():
    gen = torch.Generator().manual_seed(2)
    raw_g, raw_beta = torch.randn(5, 3 * 4, generator=gen), torch.randn(5, 3, generator=gen)
    A_log, dt_bias = torch.randn(3, generator=gen), torch.randn(3 * 4, generator=gen)
    g, beta = kda_gating_ref(A_log, raw_g, raw_beta, dt_bias)
    x = (raw_g + dt_bias).view(5, 3, 4)
    torch.testing.assert_close(g, -A_log.exp()[:, None] * F.softplus(x))
    torch.testing.assert_close(beta, torch.sigmoid(raw_beta))
    safe, _ = kda_gating_ref(A_log, raw_g, raw_beta, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(safe, -5.0 * torch.sigmoid(A_log.exp()[:, None] * x))
    assert g.shape == (5, 3, 4) and g.dtype == beta.dtype == torch.float32


@pytest.mark.parametrize("cuts", [(1,), (17,), (5, 6, 40)])
def test_chunking_does_not_change_a_bit(cuts):
    assert_cuts_change_no_bit(*_inputs(64, 2, 16, 8, seed=3), cuts)


def test_a_decay_equal_on_every_channel_is_the_per_head_rule():
    q, k, v, g, beta = _inputs(30, 2, 16, 16, seed=4)
    per_head = g[:, :, 0]
    a, b = torch.zeros(2, 16, 16), torch.zeros(2, 16, 16)
    out_head = gated_delta_rule_ref(q, k, v, per_head, beta, a)
    out_chan = gated_delta_rule_ref(q, k, v, per_head[..., None].expand_as(g), beta, b)
    assert torch.equal(out_head, out_chan) and torch.equal(a, b)
    # and a per-channel decay is not ignored
    assert not torch.equal(gated_delta_rule_ref(q, k, v, g, beta, torch.zeros(2, 16, 16)), out_head)


def test_bad_decay_shape_is_refused():
    q, k, v, g, beta = _inputs(4, 2, 8, 8)
    with pytest.raises(ValueError, match="g must be"):
        gated_delta_rule_ref(q, k, v, g[:, :, :5], beta, torch.zeros(2, 8, 8))


CASES = [
    ([1], 1, 1, 1),
    ([37], 2, 16, 24),
    ([5, 0, 70, 1, 33], 3, 7, 5),
    ([29, 64], 2, 33, 17),
    ([12, 7], 2, 128, 128),
]


def _batch(seq_lens, heads, dk, dv, seed=0):
    q, k, v, g, beta = _inputs(sum(seq_lens), heads, dk, dv, seed=seed)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, cu


@requires_ext
@pytest.mark.parametrize("initial", ["none", "all", "mixed"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lens{c[0]}-{c[1]}h-{c[2]}x{c[3]}")
def test_op_equals_ref_bit_for_bit(case, initial):
    seq_lens, heads, dk, dv = case
    q, k, v, g, beta, cu = _batch(seq_lens, heads, dk, dv, seed=len(seq_lens))
    batch = len(seq_lens)
    gen = torch.Generator().manual_seed(1)
    flat = torch.randn(2 * batch + 1, heads * dk * dv + 3, generator=gen)  # padded slots
    pool = flat[:, : heads * dk * dv].view(2 * batch + 1, heads, dk, dv)
    indices = torch.tensor([2 * (batch - i) - 1 for i in range(batch)], dtype=torch.int64)
    has_init = {
        "none": torch.zeros(batch, dtype=torch.bool),
        "all": None,
        "mixed": torch.arange(batch) % 2 == 0,
    }[initial]
    (out, state), (out_ref, state_ref) = run_rule_op_and_twin(
        q, k, v, g, beta, pool, cu_seqlens=cu, state_indices=indices, has_initial_state=has_init
    )
    assert torch.equal(out, out_ref) and not out.isnan().any()
    assert torch.equal(state, state_ref)
    unused = [s for s in range(pool.shape[0]) if s not in indices.tolist()]
    assert torch.equal(state[unused], pool[unused])


@requires_ext
def test_op_strided_decay_and_chunking():
    """The decay as a strided view (as vLLM's projections hand it over), and a sequence cut
    into three calls through the pool, give the one-call bits."""
    q, k, v, g, beta = _inputs(50, 2, 16, 16, seed=5)
    wide = torch.cat([g, g], dim=-1)[..., :16]  # non-contiguous, last stride 1
    assert not wide.is_contiguous() and torch.equal(wide, g)
    pool = torch.zeros(3, 2, 16, 16)
    whole = gated_delta_rule(
        q, k, v, wide, beta, pool, cu_seqlens=torch.tensor([0, 50]), state_indices=torch.tensor([1])
    )
    chunked, parts, lo = torch.zeros(3, 2, 16, 16), [], 0
    for hi in (9, 33, 50):
        parts.append(
            gated_delta_rule(
                q[lo:hi],
                k[lo:hi],
                v[lo:hi],
                g[lo:hi],
                beta[lo:hi],
                chunked,
                cu_seqlens=torch.tensor([0, hi - lo]),
                state_indices=torch.tensor([1]),
            )
        )
        lo = hi
    assert torch.equal(torch.cat(parts), whole) and torch.equal(chunked, pool)


@requires_ext
def test_op_refuses_a_bad_decay_shape():
    q, k, v, g, beta = _inputs(4, 2, 8, 8)
    pool = torch.zeros(1, 2, 8, 8)
    cu = torch.tensor([0, 4])
    from vllm_hybrid.ops._loader import op

    with pytest.raises(RuntimeError, match="g must be"):
        out = torch.empty(4, 2, 8)
        op("gated_delta_rule_fwd")(out, q, k, v, g[:, :, :5], beta, pool, cu, None, None, 1.0, True)
