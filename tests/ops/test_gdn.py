"""``ops.gdn``: the float32 gated delta rule equals transformers' independent sequential
implementation (``torch_recurrent_gated_delta_rule``), and its state after a sequence is the
same bits however the sequence is cut into chunks (what makes prefix caching exact).

The C++ op (``gated_delta_rule``) equals its pure-torch twins bit for bit (``torch.equal``):
both fix every rounding and the order of every sum (docs/kernels.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import assert_cuts_change_no_bit, requires_ext, run_rule_op_and_twin
from vllm_hybrid.ops.gdn import (
    LANES,
    gated_delta_rule,
    gated_delta_rule_ref,
    gated_delta_rule_varlen_ref,
    gdn_gating_ref,
    lane_sum,
)


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


def assert_equals_transformers(q, k, v, g, beta, start, out, state) -> None:
    """``out`` and the final ``state`` (from ``start``) == transformers' sequential rule
    (``torch_recurrent_gated_delta_rule``, key heads repeated for GQA) to 1e-5."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    group = v.shape[1] // q.shape[1]
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


@pytest.mark.parametrize(
    "tokens, hk, hv, dk, dv, initial",
    [(1, 1, 1, 8, 8, False), (37, 2, 4, 16, 24, True), (65, 3, 3, 7, 5, False)],
)
def test_equals_transformers_recurrence(tokens, hk, hv, dk, dv, initial):
    q, k, v, g, beta, *_ = _inputs(tokens, hk, hv, dk, dv)
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(hv, dk, dv, generator=gen) if initial else torch.zeros(hv, dk, dv)
    state = start.clone()
    out = gated_delta_rule_ref(q, k, v, g, beta, state)
    assert_equals_transformers(q, k, v, g, beta, start, out, state)


def test_gating_formula():
    *_, A_log, a, b, dt_bias = _inputs(5, 1, 3, 4, 4)
    g, beta = gdn_gating_ref(A_log, a, b, dt_bias)
    torch.testing.assert_close(g, -A_log.exp() * F.softplus(a + dt_bias))
    torch.testing.assert_close(beta, torch.sigmoid(b))


@pytest.mark.parametrize("cuts", [(1,), (17,), (5, 6, 40), (63,)])
def test_chunking_does_not_change_a_bit(cuts):
    q, k, v, g, beta, *_ = _inputs(64, 2, 4, 16, 8, seed=3)
    assert_cuts_change_no_bit(q, k, v, g, beta, cuts)


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


def test_lane_sum_order():
    """lane_sum is the documented order, checked against a plain Python float32 loop."""
    gen = torch.Generator().manual_seed(5)
    for n in (1, 2, 7, 16, 17, 31, 48, 130):
        x = torch.randn(3, n, generator=gen) * 10 ** torch.randint(-3, 4, (3, n), generator=gen)
        want = []
        for row in x.numpy():
            lanes = [np.float32(row[i]) for i in range(min(LANES, n))]
            for i in range(len(lanes), n):
                lanes[i % LANES] = np.float32(lanes[i % LANES] + row[i])
            m = len(lanes)
            while m > 1:
                h = (m + 1) // 2
                for i in range(m - h):
                    lanes[i] = np.float32(lanes[i] + lanes[i + h])
                m = h
            want.append(lanes[0])
        want = torch.from_numpy(np.array(want, dtype=np.float32))
        assert torch.equal(lane_sum(x, 1), want)
        assert torch.equal(lane_sum(x.t().contiguous(), 0), want)


# ---- the C++ op ----------------------------------------------------------------------------

#: seq_lens, Hk, Hv, K, V: odd sizes, K below / at / above the 16 lanes, GQA, V not a multiple
#: of the op's 16-column blocks, an empty sequence, Qwen3-Next's 128 x 128.
OP_CASES = [
    ([1], 1, 1, 1, 1),
    ([37], 2, 4, 16, 24),
    ([5, 0, 70, 1, 33], 3, 3, 7, 5),
    ([29, 64], 2, 6, 33, 17),
    ([40, 9], 1, 2, 130, 40),
    ([12, 7], 2, 4, 128, 128),
]


def _batch(seq_lens, hk, hv, dk, dv, seed=0):
    tokens = sum(seq_lens)
    q, k, v, g, beta, *_ = _inputs(tokens, hk, hv, dk, dv, seed=seed)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, cu


def _pool(batch, hv, dk, dv, seed=1, pad=3):
    """A pool of 2 * batch + 1 slots, each padded by `pad` floats (a strided view, as vLLM's
    pages), random contents; sequences use odd slots in reverse order."""
    slots = 2 * batch + 1
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(slots, hv * dk * dv + pad, generator=gen)
    pool = flat[:, : hv * dk * dv].view(slots, hv, dk, dv)
    indices = torch.tensor([2 * (batch - i) - 1 for i in range(batch)], dtype=torch.int64)
    return pool, indices


def _same(a, b):
    return torch.equal(torch.nan_to_num(a, nan=1234.5), torch.nan_to_num(b, nan=1234.5))


@requires_ext
@pytest.mark.parametrize("initial", ["none", "all", "mixed"])
@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: f"lens{c[0]}-{c[1]}x{c[2]}-{c[3]}x{c[4]}")
def test_op_equals_ref_bit_for_bit(case, initial):
    seq_lens, hk, hv, dk, dv = case
    q, k, v, g, beta, cu = _batch(seq_lens, hk, hv, dk, dv, seed=len(seq_lens))
    pool, indices = _pool(len(seq_lens), hv, dk, dv)
    has_init = {
        "none": torch.zeros(len(seq_lens), dtype=torch.bool),
        "all": None,
        "mixed": torch.arange(len(seq_lens)) % 2 == 0,
    }[initial]
    (out, state), (out_ref, state_ref) = run_rule_op_and_twin(
        q, k, v, g, beta, pool, cu_seqlens=cu, state_indices=indices, has_initial_state=has_init
    )
    assert _same(out, out_ref) and not out.isnan().any()
    assert torch.equal(state, state_ref)
    # slots no sequence uses are untouched; used ones moved
    unused = [s for s in range(pool.shape[0]) if s not in indices.tolist()]
    assert torch.equal(state[unused], pool[unused])
    used = [int(indices[i]) for i, n in enumerate(seq_lens) if n > 0]
    assert not torch.equal(state[used], pool[used])


@requires_ext
def test_op_single_sequence_form_equals_ref():
    q, k, v, g, beta, *_ = _inputs(45, 2, 4, 20, 12, seed=6)
    start = torch.randn(4, 20, 12)
    s_op, s_ref = start.clone(), start.clone()
    out = gated_delta_rule(q, k, v, g, beta, s_op)
    assert torch.equal(out, gated_delta_rule_ref(q, k, v, g, beta, s_ref))
    assert torch.equal(s_op, s_ref)


@requires_ext
@pytest.mark.parametrize("tokens, hk, hv, dk, dv", [(37, 2, 4, 16, 24), (65, 3, 3, 7, 5)])
def test_op_equals_transformers_recurrence(tokens, hk, hv, dk, dv):
    q, k, v, g, beta, *_ = _inputs(tokens, hk, hv, dk, dv, seed=2)
    start = torch.randn(hv, dk, dv, generator=torch.Generator().manual_seed(1))
    state = start.clone()
    out = gated_delta_rule(q, k, v, g, beta, state)
    assert_equals_transformers(q, k, v, g, beta, start, out, state)


@requires_ext
def test_op_non_contiguous_and_bf16_inputs():
    """q, k, v as views into one projection (as vLLM's rearrange_mixed_qkv gives them), g and
    beta transposed, `out` a strided view; bfloat16 inputs read as float32 by both."""
    seq_lens, hk, hv, dk, dv = [23, 18], 2, 4, 16, 8
    q, k, v, g, beta, cu = _batch(seq_lens, hk, hv, dk, dv, seed=8)
    tokens = q.shape[0]
    mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qs = mixed[:, : hk * dk].view(tokens, hk, dk)
    ks = mixed[:, hk * dk : 2 * hk * dk].view(tokens, hk, dk)
    vs = mixed[:, 2 * hk * dk :].view(tokens, hv, dv)
    gs, bs = g.t().contiguous().t(), beta.t().contiguous().t()
    assert not (qs.is_contiguous() or vs.is_contiguous() or gs.is_contiguous())
    pool, indices = _pool(2, hv, dk, dv)
    want_out = torch.empty(tokens, hv, dv)
    want_state = pool.clone()
    gated_delta_rule_varlen_ref(
        q, k, v, g, beta, want_state, cu_seqlens=cu, state_indices=indices, out=want_out
    )
    state = pool.clone()
    wide = torch.full((tokens, hv, dv * 2), float("nan"))
    gated_delta_rule(
        qs, ks, vs, gs, bs, state, cu_seqlens=cu, state_indices=indices, out=wide[..., ::2]
    )
    assert torch.equal(wide[..., ::2], want_out) and wide[..., 1::2].isnan().all()
    assert torch.equal(state, want_state)

    bf = [x.bfloat16() for x in (q, k, v)]
    (out, st), (out_ref, st_ref) = run_rule_op_and_twin(
        *bf, g, beta, pool, cu_seqlens=cu, state_indices=indices
    )
    assert torch.equal(out, out_ref) and torch.equal(st, st_ref)


@requires_ext
@pytest.mark.parametrize("cuts", [(1,), (17,), (5, 6, 40), (63,)])
def test_op_chunking_does_not_change_a_bit(cuts):
    q, k, v, g, beta, *_ = _inputs(64, 2, 4, 16, 8, seed=3)
    whole_state = torch.zeros(4, 16, 8)
    whole = gated_delta_rule(q, k, v, g, beta, whole_state)
    state, outs, lo = torch.zeros(4, 16, 8), [], 0
    for hi in (*cuts, 64):
        outs.append(gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state))
        lo = hi
    assert torch.equal(torch.cat(outs), whole) and torch.equal(state, whole_state)
    ref_state = torch.zeros(4, 16, 8)
    assert torch.equal(gated_delta_rule_ref(q, k, v, g, beta, ref_state), whole)
    assert torch.equal(ref_state, whole_state)


@requires_ext
def test_op_chunk_in_a_batch_equals_alone():
    """A sequence's bits do not depend on its neighbours in the batch or its offset there."""
    q, k, v, g, beta, cu = _batch([31, 50, 3], 2, 4, 24, 40, seed=9)
    pool, indices = _pool(3, 4, 24, 40)
    state = pool.clone()
    out = gated_delta_rule(q, k, v, g, beta, state, cu_seqlens=cu, state_indices=indices)
    alone = pool[int(indices[1])].clone()
    lo, hi = int(cu[1]), int(cu[2])
    want = gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], alone)
    assert torch.equal(out[lo:hi], want) and torch.equal(state[int(indices[1])], alone)


@requires_ext
def test_op_without_final_state_and_padded_slots():
    q, k, v, g, beta, cu = _batch([10, 14, 6], 1, 2, 8, 16, seed=10)
    pool, _ = _pool(3, 2, 8, 16)
    indices = torch.tensor([3, -1, 5])  # the middle sequence is padding (PAD_SLOT_ID)
    (out, state), (out_ref, state_ref) = run_rule_op_and_twin(
        q, k, v, g, beta, pool, cu_seqlens=cu, state_indices=indices, output_final_state=False
    )
    assert torch.equal(state, pool) and torch.equal(state_ref, pool)
    assert _same(out, out_ref)
    assert out[10:24].isnan().all() and not out[:10].isnan().any() and not out[24:].isnan().any()
    (with_state, _), _ = run_rule_op_and_twin(
        q, k, v, g, beta, pool, cu_seqlens=cu, state_indices=indices
    )
    assert _same(out, with_state)


@requires_ext
def test_op_refuses_bad_input():
    q, k, v, g, beta, cu = _batch([4, 4], 2, 4, 8, 8)
    pool = torch.zeros(3, 4, 8, 8)
    with pytest.raises(RuntimeError, match="both write state slot 1"):
        gated_delta_rule(q, k, v, g, beta, pool, cu_seqlens=cu, state_indices=torch.tensor([1, 1]))
    gated_delta_rule(  # reading one slot twice is fine
        q,
        k,
        v,
        g,
        beta,
        pool,
        cu_seqlens=cu,
        state_indices=torch.tensor([1, 1]),
        output_final_state=False,
    )
    with pytest.raises(RuntimeError, match="the pool has 3"):
        gated_delta_rule(q, k, v, g, beta, pool, cu_seqlens=cu, state_indices=torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="cu_seqlens must rise"):
        gated_delta_rule(q, k, v, g, beta, pool, cu_seqlens=torch.tensor([0, 5, 4]))
    with pytest.raises(RuntimeError, match="contiguous"):
        gated_delta_rule(q, k, v, g, beta, pool.transpose(2, 3), cu_seqlens=cu)
    with pytest.raises(ValueError, match="multiple of Hk"):
        gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], torch.zeros(3, 8, 8))
    with pytest.raises(TypeError, match="float32"):
        gated_delta_rule(q, k, v, g, beta, pool.bfloat16(), cu_seqlens=cu)
