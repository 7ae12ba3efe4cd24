"""store_prefill_checkpoint (C++) == store_prefill_checkpoint_ref (torch)."""

from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import requires_ext
from vllm_hybrid.ops import store_prefill_checkpoint, store_prefill_checkpoint_ref

pytestmark = requires_ext


def make_case(
    seed,
    *,
    dim=13,
    width=4,
    state_len=3,
    blocks=9,
    ssm_shape=(3, 5, 7),
    ssm_dtype=torch.float32,
    row_lens=(40, 9, 25),
    offsets=(17, 0, 25),
    dst=(4, 0, 7),
    chunk_idx=(2, 0, 5),
):
    g = torch.Generator().manual_seed(seed)
    total = sum(row_lens)
    # x is (dim, T) as the transpose of a (T, dim) activation: non-contiguous, like vLLM's
    x = torch.randn(total, dim, generator=g).t()
    # conv_state stored token-major and viewed dim-first (vLLM's SD layout), wider than state_len
    conv_state = torch.randn(blocks, width, dim, generator=g).transpose(1, 2)
    # ssm blocks padded to a larger page, like vLLM's shared block pool
    page = torch.randn(blocks, 2 * torch.Size(ssm_shape).numel(), generator=g)
    ssm_state = page[:, : torch.Size(ssm_shape).numel()].view(blocks, *ssm_shape).to(ssm_dtype)
    chunk_states = torch.randn(6, *ssm_shape, generator=g)
    starts = torch.tensor([0, *torch.tensor(row_lens).cumsum(0).tolist()])
    args = (
        x,
        conv_state,
        chunk_states,
        ssm_state,
        starts,
        torch.tensor(offsets),
        torch.tensor(dst),
        torch.tensor(chunk_idx),
    )
    return args, state_len


def run(fn, args, state_len):
    x, conv, chunks, ssm, *rest = args
    conv, ssm = conv.clone(), ssm.clone()
    fn(x, conv, chunks, ssm, *rest, state_len=state_len)
    return conv, ssm


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_ref(seed, ssm_dtype):
    args, state_len = make_case(seed, ssm_dtype=ssm_dtype)
    conv, ssm = run(store_prefill_checkpoint, args, state_len)
    conv_ref, ssm_ref = run(store_prefill_checkpoint_ref, args, state_len)
    assert torch.equal(conv, conv_ref) and torch.equal(ssm, ssm_ref)
    # the op wrote what the contract says, and nothing else
    x, conv0, chunks, ssm0 = args[:4]
    assert torch.equal(conv[4, :, :3], x[:, 17 - 3 : 17])
    assert torch.equal(ssm[7], chunks[5].to(ssm_dtype))
    untouched = [b for b in range(9) if b not in (4, 7)]
    assert torch.equal(conv[untouched], conv0[untouched])
    assert torch.equal(conv[4, :, 3:], conv0[4, :, 3:])
    assert torch.equal(ssm[untouched], ssm0[untouched])


def test_many_rows_and_repeated_destination():
    """Later rows win on a repeated destination, in both implementations."""
    lens = (16,) * 7
    args, state_len = make_case(
        5,
        row_lens=lens,
        offsets=(16, 4, 0, 9, 16, 5, 12),
        dst=(1, 2, 0, 1, 3, 8, 2),
        chunk_idx=(0, 1, 0, 2, 3, 4, 5),
        state_len=4,
        width=4,
    )
    conv, ssm = run(store_prefill_checkpoint, args, state_len)
    conv_ref, ssm_ref = run(store_prefill_checkpoint_ref, args, state_len)
    assert torch.equal(conv, conv_ref) and torch.equal(ssm, ssm_ref)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"offsets": (2, 0, 25)}, "must lie in"),  # offset < state_len
        ({"offsets": (41, 0, 25)}, "must lie in"),  # past the row
        ({"dst": (99, 0, 7)}, "destination block 99 out of range"),
        ({"chunk_idx": (6, 0, 5)}, "chunk index 6 out of range"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, match):
    args, state_len = make_case(0, **kwargs)
    with pytest.raises(RuntimeError, match=match):
        run(store_prefill_checkpoint, args, state_len)
