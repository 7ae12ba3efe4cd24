"""``ops.gdn``: the float32 gated delta rule equals transformers' independent sequential
implementation (``torch_recurrent_gated_delta_rule``), and its state after a sequence is the
same bits however the sequence is cut into chunks (what makes prefix caching exact)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_hybrid.ops.gdn import gated_delta_rule_ref, gdn_gating_ref


def _inputs(tokens: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, hk, dk, generator=gen)
    k = torch.randn(tokens, hk, dk, generator=gen)
    v = torch.randn(tokens, hv, dv, generator=gen)
    a = torch.randn(tokens, hv, generator=gen)
    b = torch.randn(tokens, hv, generator=gen)
    A_log = torch.randn(hv, generator=gen).abs().log()
    dt_bias = torch.randn(hv, generator=gen)
    g, beta = gdn_gating_ref(A_log, a, b, dt_bias)
    return q, k, v, g, beta, A_log, a, b, dt_bias


@pytest.mark.parametrize(
    "tokens, hk, hv, dk, dv, initial",
    [(1, 1, 1, 8, 8, False), (37, 2, 4, 16, 24, True), (65, 3, 3, 7, 5, False)],
)
def test_equals_transformers_recurrence(tokens, hk, hv, dk, dv, initial):
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    q, k, v, g, beta, *_ = _inputs(tokens, hk, hv, dk, dv)
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(hv, dk, dv, generator=gen) if initial else torch.zeros(hv, dk, dv)
    state = start.clone()
    out = gated_delta_rule_ref(q, k, v, g, beta, state)
    group = hv // hk
    want, want_state = qwen3_next.torch_recurrent_gated_delta_rule(
        q.repeat_interleave(group, dim=1)[None],
        k.repeat_interleave(group, dim=1)[None],
        v[None],
        g=g[None],
        beta=beta[None],
        initial_state=start[None].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state[0], rtol=1e-5, atol=1e-5)


def test_gating_formula():
    *_, A_log, a, b, dt_bias = _inputs(5, 1, 3, 4, 4)
    g, beta = gdn_gating_ref(A_log, a, b, dt_bias)
    torch.testing.assert_close(g, -A_log.exp() * F.softplus(a + dt_bias))
    torch.testing.assert_close(beta, torch.sigmoid(b))


@pytest.mark.parametrize("cuts", [(1,), (17,), (5, 6, 40), (63,)])
def test_chunking_does_not_change_a_bit(cuts):
    q, k, v, g, beta, *_ = _inputs(64, 2, 4, 16, 8, seed=3)
    whole_state = torch.zeros(4, 16, 8)
    whole = gated_delta_rule_ref(q, k, v, g, beta, whole_state)
    state, outs, lo = torch.zeros(4, 16, 8), [], 0
    for hi in (*cuts, 64):
        outs.append(
            gated_delta_rule_ref(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        )
        lo = hi
    assert torch.equal(torch.cat(outs), whole) and torch.equal(state, whole_state)


def test_non_contiguous_inputs():
    q, k, v, g, beta, *_ = _inputs(20, 2, 2, 8, 8, seed=4)
    want = gated_delta_rule_ref(q, k, v, g, beta, torch.zeros(2, 8, 8))
    wide = torch.cat([q, k], dim=-1)  # q and k as strided views of one buffer
    got = gated_delta_rule_ref(wide[..., :8], wide[..., 8:], v, g, beta, torch.zeros(2, 8, 8))
    assert torch.equal(got, want)


def test_bad_input_is_refused():
    q, k, v, g, beta, *_ = _inputs(4, 2, 3, 8, 8)
    with pytest.raises(ValueError, match="multiple of Hk"):
        gated_delta_rule_ref(q, k, v, g, beta, torch.zeros(3, 8, 8))
    q, k, v, g, beta, *_ = _inputs(4, 1, 2, 8, 8)
    with pytest.raises(TypeError, match="float32"):
        gated_delta_rule_ref(q, k, v, g, beta, torch.zeros(2, 8, 8, dtype=torch.bfloat16))
