"""Shared input builders for the kernel tests."""

from __future__ import annotations

import pytest
import torch

from vllm_hybrid.ops import extension_available

requires_ext = pytest.mark.skipif(
    not extension_available(), reason="vllm_hybrid._C not built (bash scripts/install.sh)"
)


def chunk_layout(
    seq_lens: list[int],
    chunk_size: int,
    computed: list[int] | None = None,
    extra_splits: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens, cu_chunk_seqlens, chunk_seq_idx, last_chunk_indices the way vLLM lays them
    out: chunks end at multiples of chunk_size of the absolute position (a sequence resumes at
    ``computed`` tokens) and at the extra split offsets given per sequence."""
    computed = computed or [0] * len(seq_lens)
    extra_splits = extra_splits or [[] for _ in seq_lens]
    cu, bounds, owners, last = [0], [0], [], []
    for seq, (length, done, extra) in enumerate(zip(seq_lens, computed, extra_splits, strict=True)):
        start = cu[-1]
        cuts = {o for o in range(1, length) if (done + o) % chunk_size == 0} | set(extra)
        for cut in sorted(cuts) + [length]:
            bounds.append(start + cut)
            owners.append(seq)
        last.append(len(owners) - 1)
        cu.append(start + length)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return as_t(cu), as_t(bounds), as_t(owners), torch.tensor(last, dtype=torch.int64)


def scan_inputs(
    total: int,
    heads: int,
    head_dim: int,
    groups: int,
    d_state: int,
    *,
    seed: int = 0,
    noncontiguous: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if noncontiguous:
        # x as a strided view inside a wider projection, B/C transposed from (G, T, N)
        x = rand(total, heads, head_dim * 2)[..., ::2]
        B = rand(groups, total, d_state).transpose(0, 1)
        C = rand(groups, total, d_state).transpose(0, 1)
    else:
        x, B, C = (
            rand(total, heads, head_dim),
            rand(total, groups, d_state),
            rand(total, groups, d_state),
        )
    return {
        "x": x.to(dtype),
        "dt": torch.nn.functional.softplus(rand(total, heads) - 1.0),
        "A": -torch.rand(heads, generator=g) * 2 - 0.1,
        "B": B.to(dtype),
        "C": C.to(dtype),
        "D": rand(heads),
    }


def run_rule_op_and_twin(q, k, v, g, beta, pool, **kw):
    """``[(out, pool)]`` of ``gated_delta_rule`` and of its twin ``gated_delta_rule_varlen_ref``,
    each from a copy of the same pool; outputs start NaN so rows the op must not touch stay NaN
    in both."""
    from vllm_hybrid.ops.gdn import gated_delta_rule, gated_delta_rule_varlen_ref

    results = []
    for fn in (gated_delta_rule, gated_delta_rule_varlen_ref):
        state = pool.clone()
        out = torch.full((q.shape[0], v.shape[1], v.shape[2]), float("nan"))
        fn(q, k, v, g, beta, state, out=out, **kw)
        results.append((out, state))
    return results


def assert_cuts_change_no_bit(q, k, v, g, beta, cuts) -> None:
    """``gated_delta_rule_ref`` over the tokens cut at ``cuts`` (the state carried from call to
    call, as a prefix-cached run resumes) gives the one-call outputs and final state, bit for
    bit."""
    from vllm_hybrid.ops.gdn import gated_delta_rule_ref

    shape = (v.shape[1], q.shape[2], v.shape[2])
    whole_state = torch.zeros(shape)
    whole = gated_delta_rule_ref(q, k, v, g, beta, whole_state)
    state, outs, lo = torch.zeros(shape), [], 0
    for hi in (*cuts, q.shape[0]):
        outs.append(
            gated_delta_rule_ref(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        )
        lo = hi
    assert torch.equal(torch.cat(outs), whole) and torch.equal(state, whole_state)
