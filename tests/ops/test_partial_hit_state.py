"""The CPU ops at the failing sub-block hit of tests/engine/test_partial_hits.py, on the tiny
Nemotron-H's shapes (4 heads x 64, 2 groups, d_state 32, conv dim 384, kernel 4, chunk 128):
prompt A of 120 tokens keeps a checkpoint at 112; prompt B shares A's first 112 tokens and
resumes there for 28 more (its chunks split at the absolute position 128). The ops were not the
cause of that bug (vLLM's attention block copy was); this pins them at that position."""

from __future__ import annotations

import torch

from tests.ops.conftest import chunk_layout, requires_ext, scan_inputs
from vllm_hybrid.ops import (
    ssd_chunk_scan,
    ssd_chunk_scan_ref,
    store_prefill_checkpoint,
    store_prefill_checkpoint_ref,
)

pytestmark = requires_ext

HEADS, HEAD_DIM, GROUPS, D_STATE, CHUNK = 4, 64, 2, 32, 128
CONV_DIM, STATE_LEN = 384, 3
HIT, A_LEN, B_LEN = 112, 120, 140


def scan(fn, inp, layout, init=None):
    cu, bounds, owners, _ = layout
    out = torch.empty(inp["x"].shape)
    states = fn(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], out,
        cu_seqlens=cu, cu_chunk_seqlens=bounds, chunk_seq_idx=owners, D=inp["D"],
        initial_states=init,
    )  # fmt: skip
    return out, states


def test_checkpoint_at_112_and_resume_match_ref_and_uncut_scan():
    inp = scan_inputs(B_LEN, HEADS, HEAD_DIM, GROUPS, D_STATE, seed=3)
    a = {k: v[:A_LEN] if v.dim() > 1 else v for k, v in inp.items()}
    layout_a = chunk_layout([A_LEN], CHUNK, extra_splits=[[HIT]])  # chunks [0,112) [112,120)
    assert layout_a[1].tolist() == [0, HIT, A_LEN]
    x_pre = torch.randn(CONV_DIM, A_LEN, generator=torch.Generator().manual_seed(4))

    stored = []
    for scan_fn, store_fn in (
        (ssd_chunk_scan, store_prefill_checkpoint),
        (ssd_chunk_scan_ref, store_prefill_checkpoint_ref),
    ):
        _, chunk_states = scan(scan_fn, a, layout_a)
        conv = torch.zeros(4, CONV_DIM, STATE_LEN + 1)
        ssm = torch.zeros(4, HEADS, HEAD_DIM, D_STATE)
        store_fn(
            x_pre, conv, chunk_states, ssm, torch.tensor([0, A_LEN]),
            torch.tensor([HIT]), torch.tensor([2]), torch.tensor([0]), state_len=STATE_LEN,
        )  # fmt: skip
        stored.append((conv, ssm))
    (conv, ssm), (conv_ref, ssm_ref) = stored
    assert torch.equal(conv, conv_ref) and torch.allclose(ssm, ssm_ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(conv[2, :, :STATE_LEN], x_pre[:, HIT - STATE_LEN : HIT])

    # B from scratch, in one prefill (chunks [0,128) [128,140)) ...
    whole_out, _ = scan(ssd_chunk_scan, inp, chunk_layout([B_LEN], CHUNK))
    # ... and B resumed at 112 from the stored state (chunks [112,128) [128,140)).
    tail = {k: v[HIT:] if v.dim() > 1 else v for k, v in inp.items()}
    layout_tail = chunk_layout([B_LEN - HIT], CHUNK, computed=[HIT])
    assert layout_tail[1].tolist() == [0, 128 - HIT, B_LEN - HIT]
    tail_out, _ = scan(ssd_chunk_scan, tail, layout_tail, init=ssm[2:3])
    assert torch.equal(tail_out, whole_out[HIT:])
