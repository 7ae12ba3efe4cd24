"""ssd_chunk_scan (C++) == ssd_chunk_scan_ref (chunked torch) == a plain token recurrence."""

from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import chunk_layout, requires_ext, scan_inputs
from vllm_hybrid.ops import ssd_chunk_scan, ssd_chunk_scan_ref

pytestmark = requires_ext


def sequential_recurrence(inp, cu_seqlens, cu_chunks, init=None, z=None):
    """Independent oracle: the Mamba2 recurrence, one token at a time, in float64."""
    x, dt, A, B, C, D = (inp[k].double() for k in ("x", "dt", "A", "B", "C", "D"))
    T, H, P = x.shape
    rep = H // B.shape[1]
    B, C = B.repeat_interleave(rep, 1), C.repeat_interleave(rep, 1)
    y = torch.zeros(T, H, P, dtype=torch.float64)
    ends = {int(e): i for i, e in enumerate(cu_chunks[1:].tolist())}
    chunk_states = torch.zeros(len(ends), H, P, B.shape[-1], dtype=torch.float64)
    for seq in range(len(cu_seqlens) - 1):
        s = torch.zeros(H, P, B.shape[-1], dtype=torch.float64)
        if init is not None:
            s = init[seq].double().clone()
        for t in range(int(cu_seqlens[seq]), int(cu_seqlens[seq + 1])):
            decay = torch.exp(dt[t] * A).view(H, 1, 1)
            s = s * decay + (dt[t].view(H, 1) * x[t]).unsqueeze(-1) * B[t].unsqueeze(1)
            y[t] = torch.einsum("hpn,hn->hp", s, C[t]) + D.view(H, 1) * x[t]
            if t + 1 in ends:
                chunk_states[ends[t + 1]] = s
    if z is not None:
        y = y * torch.nn.functional.silu(z.double())
    return y, chunk_states


def run_both(inp, layout, init=None, z=None):
    cu, bounds, owners, _ = layout
    results = []
    for fn in (ssd_chunk_scan, ssd_chunk_scan_ref):
        out = torch.full(inp["x"].shape, float("nan"), dtype=inp["x"].dtype)
        states = fn(
            inp["x"],
            inp["dt"],
            inp["A"],
            inp["B"],
            inp["C"],
            out,
            cu_seqlens=cu,
            cu_chunk_seqlens=bounds,
            chunk_seq_idx=owners,
            D=inp["D"],
            z=z,
            initial_states=init,
        )
        results.append((out, states))
    return results


CASES = [
    # seq_lens, chunk, computed, extra splits, heads, head_dim, groups, d_state
    ([37], 16, None, None, 4, 8, 1, 16),
    ([5, 70, 1, 33], 16, None, None, 6, 5, 3, 7),
    ([129, 64], 32, [100, 32], [[40], [17]], 2, 16, 2, 8),
    ([300], 64, [7], [[131]], 3, 9, 1, 11),
]


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("noncontiguous", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lens{c[0]}")
def test_scan_matches_ref_and_recurrence(case, noncontiguous, with_init):
    seq_lens, chunk, computed, extra, H, P, G, N = case
    layout = chunk_layout(seq_lens, chunk, computed, extra)
    inp = scan_inputs(sum(seq_lens), H, P, G, N, seed=len(seq_lens), noncontiguous=noncontiguous)
    init = torch.randn(len(seq_lens), H, P, N) if with_init else None
    (out, states), (out_ref, states_ref) = run_both(inp, layout, init)
    y_seq, states_seq = sequential_recurrence(inp, layout[0], layout[1], init)

    assert states.shape == (len(layout[2]), H, P, N) and states.dtype == torch.float32
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, states_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), y_seq, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states.double(), states_seq, rtol=1e-4, atol=1e-4)
    # the last chunk of every sequence holds its final state
    last = layout[3]
    torch.testing.assert_close(states[last].double(), states_seq[last], rtol=1e-4, atol=1e-4)


def test_output_gate_and_bf16_inputs():
    layout = chunk_layout([23, 41], 16)
    inp = scan_inputs(64, 4, 8, 2, 16, seed=3, dtype=torch.bfloat16)
    z = torch.randn(64, 4, 8)
    (out, states), (out_ref, states_ref) = run_both(inp, layout, z=z)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(states, states_ref, rtol=1e-4, atol=1e-4)


def test_splitting_chunks_does_not_change_output():
    """Extra chunk ends (checkpoints) only add states; `out` is unchanged bit for bit."""
    inp = scan_inputs(200, 4, 8, 1, 16, seed=7)
    plain = run_both(inp, chunk_layout([120, 80], 64))[0]
    split = run_both(inp, chunk_layout([120, 80], 64, extra_splits=[[3, 77], [50]]))[0]
    assert torch.equal(plain[0], split[0])


def test_resume_from_chunk_state_is_bit_identical():
    """Scanning [0, n) in one go == scanning [0, k) then resuming [k, n) from the k state."""
    inp = scan_inputs(90, 4, 8, 2, 16, seed=11)
    whole_out = torch.empty(90, 4, 8)
    whole = ssd_chunk_scan(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        whole_out,
        cu_seqlens=torch.tensor([0, 90]),
        cu_chunk_seqlens=torch.tensor([0, 33, 90]),
        chunk_seq_idx=torch.tensor([0, 0]),
        D=inp["D"],
    )
    tail = {k: v[33:] if v.dim() > 1 else v for k, v in inp.items()}
    tail_out = torch.empty(57, 4, 8)
    resumed = ssd_chunk_scan(
        tail["x"],
        tail["dt"],
        tail["A"],
        tail["B"],
        tail["C"],
        tail_out,
        cu_seqlens=torch.tensor([0, 57]),
        cu_chunk_seqlens=torch.tensor([0, 57]),
        chunk_seq_idx=torch.tensor([0]),
        D=tail["D"],
        initial_states=whole[:1],
    )
    assert torch.equal(resumed[0], whole[1])
    assert torch.equal(tail_out, whole_out[33:])


@pytest.mark.parametrize(
    "bounds, owners, match",
    [
        ([0, 10, 30], [0, 0], "never cross a sequence"),  # chunk 10..30 crosses seq end 20
        ([0, 20, 30], [0, 0], "never cross a sequence"),  # wrong owner
        ([0, 20, 40, 45], [0, 1, 1], "outside every sequence"),
        ([0, 20, 40], [0], "chunk_seq_idx has 1 entries"),
    ],
)
def test_bad_chunk_layout_is_a_clear_error(bounds, owners, match):
    inp = scan_inputs(40, 2, 4, 1, 4)
    with pytest.raises(RuntimeError, match=match):
        ssd_chunk_scan(
            inp["x"],
            inp["dt"],
            inp["A"],
            inp["B"],
            inp["C"],
            torch.empty(40, 2, 4),
            cu_seqlens=torch.tensor([0, 20, 40]),
            cu_chunk_seqlens=torch.tensor(bounds),
            chunk_seq_idx=torch.tensor(owners),
        )
