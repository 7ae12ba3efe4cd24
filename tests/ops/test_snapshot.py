"""snapshot_copy / snapshot_(de)quantize_int8 (C++) == their torch twins, on vLLM-like pools.

The pools mimic vLLM's hybrid KV cache: per layer one padded byte page per block, holding a
conv state in the transposed ("SD") layout and an SSM state, possibly of different dtypes. The
CUDA tests (test_snapshot_cuda.py) reuse these builders.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.ops.conftest import requires_ext
from vllm_hybrid.ops import (
    int8_error_bound,
    int8_pool_like,
    snapshot_copy,
    snapshot_copy_ref,
    snapshot_dequantize_int8,
    snapshot_dequantize_int8_ref,
    snapshot_quantize_int8,
    snapshot_quantize_int8_ref,
)

pytestmark = requires_ext

# (conv dim, conv width, heads, head_dim, d_state) per layer: odd sizes, all different
LAYER_SHAPES = [(13, 3, 3, 5, 7), (40, 4, 2, 8, 16), (7, 2, 5, 3, 1), (33, 4, 4, 16, 9)]


@dataclass
class Pool:
    pages: list[torch.Tensor]  # per layer (blocks, page_bytes) uint8, the storage
    conv: list[torch.Tensor]  # per layer (blocks, dim, width) view into the page
    ssm: list[torch.Tensor]  # per layer (blocks, H, P, N) view into the page

    @property
    def states(self) -> list[torch.Tensor]:
        return [t for pair in zip(self.conv, self.ssm, strict=True) for t in pair]

    def clone(self) -> Pool:
        return make_pool_from_pages([p.clone() for p in self.pages], self)


def _layout(shape, conv_dtype, ssm_dtype, pad_bytes):
    dim, width, H, P, N = shape
    conv_bytes = dim * width * conv_dtype.itemsize
    ssm_off = -(-conv_bytes // 16) * 16
    page = ssm_off + H * P * N * ssm_dtype.itemsize + pad_bytes
    return conv_bytes, ssm_off, page


def _views(page, shape, conv_dtype, ssm_dtype, pad_bytes):
    dim, width, H, P, N = shape
    conv_bytes, ssm_off, _ = _layout(shape, conv_dtype, ssm_dtype, pad_bytes)
    blocks = page.shape[0]
    # conv stored token-major (width, dim) and viewed (dim, width), like vLLM's SD layout
    conv = page[:, :conv_bytes].view(conv_dtype).view(blocks, width, dim).transpose(1, 2)
    ssm_bytes = H * P * N * ssm_dtype.itemsize
    ssm = page[:, ssm_off : ssm_off + ssm_bytes].view(ssm_dtype).view(blocks, H, P, N)
    return conv, ssm


def make_pool(
    blocks: int,
    *,
    shapes=LAYER_SHAPES,
    conv_dtype=torch.bfloat16,
    ssm_dtype=torch.float32,
    pad_bytes: int = 36,
    seed: int = 0,
    device: str | torch.device = "cpu",
    pin: bool = False,
) -> Pool:
    """Random finite states with per-head / per-channel magnitudes spanning 1e-3..1e3."""
    g = torch.Generator().manual_seed(seed)
    pages = []
    for shape in shapes:
        page = torch.zeros(
            blocks, _layout(shape, conv_dtype, ssm_dtype, pad_bytes)[2], dtype=torch.uint8
        )
        page[:] = torch.randint(0, 256, page.shape, generator=g, dtype=torch.uint8)  # padding
        c, s = _views(page, shape, conv_dtype, ssm_dtype, pad_bytes)
        dim, H = shape[0], shape[2]
        c_mag = 10 ** (torch.rand(1, dim, 1, generator=g) * 6 - 3)
        s_mag = 10 ** (torch.rand(1, H, 1, 1, generator=g) * 6 - 3)
        c.copy_(torch.randn(c.shape, generator=g) * c_mag)
        s.copy_(torch.randn(s.shape, generator=g) * s_mag)
        s[:, 0] = 0.0  # an all-zero head: scale 0
        if pin:
            page = page.pin_memory()
        pages.append(page.to(device))
    pool = Pool(pages, [], [])
    return make_pool_from_pages(pool.pages, pool, shapes, conv_dtype, ssm_dtype, pad_bytes)


def make_pool_from_pages(pages, like, shapes=None, conv_dtype=None, ssm_dtype=None, pad=None):
    if shapes is None:  # re-derive the views of `like` on new pages
        shapes = [
            (c.shape[1], c.shape[2], *s.shape[1:]) for c, s in zip(like.conv, like.ssm, strict=True)
        ]
        conv_dtype, ssm_dtype = like.conv[0].dtype, like.ssm[0].dtype
        pad = pages[0].shape[1] - _layout(shapes[0], conv_dtype, ssm_dtype, 0)[2]
    views = [_views(p, sh, conv_dtype, ssm_dtype, pad) for p, sh in zip(pages, shapes, strict=True)]
    return Pool(list(pages), [v[0] for v in views], [v[1] for v in views])


def pairs_of(rows):
    return torch.tensor(rows, dtype=torch.int64).view(-1, 2)


# 9 pairs, distinct destinations, repeated sources (block 3 three times), no block both ways
PAIRS = pairs_of([[3, 0], [3, 5], [17, 8], [3, 22], [1, 9], [20, 13], [17, 14], [2, 21], [4, 6]])
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize("pad", [36, 6, 0])
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}")
def test_copy_within_pool_matches_ref(dtypes, pad):
    if pad == 6 and torch.float32 in dtypes:
        pad = 4  # keep the fp32 views aligned to their element size
    pool = make_pool(23, conv_dtype=dtypes[0], ssm_dtype=dtypes[1], pad_bytes=pad, seed=1)
    ours, ref = pool.clone(), pool.clone()
    snapshot_copy(ours.states, ours.states, PAIRS)
    snapshot_copy_ref(ref.states, ref.states, PAIRS)
    for p_ours, p_ref, p0 in zip(ours.pages, ref.pages, pool.pages, strict=True):
        assert torch.equal(p_ours, p_ref)  # byte-exact, padding included
        dst = PAIRS[:, 1]
        assert torch.equal(
            p_ours[dst][:, : p_ours.shape[1] - pad], p_ref[dst][:, : p_ref.shape[1] - pad]
        )
        untouched = [b for b in range(23) if b not in dst.tolist()]
        assert torch.equal(p_ours[untouched], p0[untouched])
        assert torch.equal(p_ours[dst, p_ours.shape[1] - pad :], p0[dst, p0.shape[1] - pad :])


def test_copy_between_pools_of_different_sizes_and_padding():
    """Save device -> host pool (other block count, other page padding), then restore."""
    dev = make_pool(11, pad_bytes=36, seed=2)
    host = make_pool(29, pad_bytes=100, seed=3)
    save = pairs_of([[0, 28], [10, 3], [0, 4], [7, 0]])
    ref_host = host.clone()
    snapshot_copy(dev.states, host.states, save)
    snapshot_copy_ref(dev.states, ref_host.states, save)
    assert all(torch.equal(a, b) for a, b in zip(host.pages, ref_host.pages, strict=True))
    restore = pairs_of([[28, 5], [3, 0], [4, 10]])
    ref_dev = dev.clone()
    snapshot_copy(host.states, dev.states, restore)
    snapshot_copy_ref(host.states, ref_dev.states, restore)
    assert all(torch.equal(a, b) for a, b in zip(dev.pages, ref_dev.pages, strict=True))
    for t in range(len(dev.ssm)):
        assert torch.equal(dev.ssm[t][5], make_pool(11, pad_bytes=36, seed=2).ssm[t][0])


def test_copy_many_layers_many_pairs_and_plain_tensors():
    """54 layers, 60 pairs (more work items than threads) and a plain contiguous tensor."""
    shapes = [(5 + i % 7, 4, 1 + i % 3, 3 + i % 5, 1 + i % 4) for i in range(54)]
    pool = make_pool(130, shapes=shapes, seed=4)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(130, generator=g)
    dst, free = perm[:60], perm[60:]
    src = free[torch.randint(0, len(free), (60,), generator=g)]  # repeats included
    pairs = torch.stack([src, dst], 1)
    extra = torch.randn(130, 17)
    ours, ref = pool.clone(), pool.clone()
    extra_ours, extra_ref = extra.clone(), extra.clone()
    snapshot_copy([*ours.states, extra_ours], [*ours.states, extra_ours], pairs)
    snapshot_copy_ref([*ref.states, extra_ref], [*ref.states, extra_ref], pairs)
    assert all(torch.equal(a, b) for a, b in zip(ours.pages, ref.pages, strict=True))
    assert torch.equal(extra_ours, extra_ref)


def test_copy_no_pairs_or_no_tensors_is_a_no_op():
    pool = make_pool(4)
    before = pool.clone()
    snapshot_copy(pool.states, pool.states, torch.empty(0, 2, dtype=torch.int64))
    snapshot_copy([], [], PAIRS)
    assert all(torch.equal(a, b) for a, b in zip(pool.pages, before.pages, strict=True))


def _copy_error_cases():
    a, b = torch.zeros(8, 3, 4), torch.zeros(8, 3, 4)
    return [
        ([a], [b], pairs_of([[0, 1], [2, 1]]), "destination block 1 appears twice"),
        ([a], [a], pairs_of([[0, 1], [1, 2]]), "block 1 is written .* also read"),
        ([a], [b], pairs_of([[8, 1]]), "source block 8 out of range"),
        ([a], [b[:5]], pairs_of([[0, 5]]), r"destination block 5 out of range \[0, 5\)"),
        ([a], [b.double()], pairs_of([[0, 1]]), "is Float but dst_tensors\\[0\\] is Double"),
        ([a], [torch.zeros(8, 4, 3)], pairs_of([[0, 1]]), "must agree past their first"),
        ([a], [b.transpose(1, 2).contiguous().transpose(1, 2)], pairs_of([[0, 1]]), "strides"),
        ([a[:, :, ::2]], [b[:, :, ::2]], pairs_of([[0, 1]]), "must be dense within a block"),
        ([a], [b, b], pairs_of([[0, 1]]), "src_tensors has 1 tensors but dst_tensors has 2"),
        ([a], [b], torch.zeros(3), "pairs must be \\(n, 2\\)"),
        ([a], [b], torch.zeros(1, 2), "pairs must be int64 or int32"),
        (
            [torch.zeros(60).as_strided((8, 3, 4), (6, 4, 1))],
            [torch.zeros(60).as_strided((8, 3, 4), (6, 4, 1))],
            pairs_of([[0, 1]]),
            "blocks must not overlap",
        ),
    ]


@pytest.mark.parametrize("src, dst, pairs, match", _copy_error_cases())
def test_copy_bad_arguments_are_clear_errors(src, dst, pairs, match):
    with pytest.raises(RuntimeError, match=match):
        snapshot_copy(src, dst, pairs)


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}")
def test_int8_matches_ref_bit_for_bit_and_round_trips_within_bound(dtypes):
    pool = make_pool(23, conv_dtype=dtypes[0], ssm_dtype=dtypes[1], seed=5)
    q, s = int8_pool_like(pool.states, 9)
    q_ref, s_ref = int8_pool_like(pool.states, 9)
    save = pairs_of([[3, 0], [3, 5], [17, 8], [1, 2], [20, 7]])
    snapshot_quantize_int8(pool.states, q, s, save)
    snapshot_quantize_int8_ref(pool.states, q_ref, s_ref, save)
    assert all(torch.equal(a, b) for a, b in zip(q + s, q_ref + s_ref, strict=True))

    restore = pairs_of([[0, 10], [5, 11], [8, 12], [2, 13], [7, 14], [0, 15]])
    ours, ref = pool.clone(), pool.clone()
    snapshot_dequantize_int8(q, s, ours.states, restore)
    snapshot_dequantize_int8_ref(q, s, ref.states, restore)
    assert all(torch.equal(a, b) for a, b in zip(ours.pages, ref.pages, strict=True))

    originals = {10: 3, 11: 3, 12: 17, 13: 1, 14: 20, 15: 3}
    slot_of = dict(zip(restore[:, 1].tolist(), restore[:, 0].tolist(), strict=True))
    for x0, x1, sc in zip(pool.states, ours.states, s, strict=True):
        for dst, src in originals.items():
            err = (x1[dst].float() - x0[src].float()).abs()
            assert (err <= int8_error_bound(x1[dst], sc[slot_of[dst]])).all()
    for ssm in ours.ssm:  # the all-zero head comes back exactly
        assert (ssm[10:16, 0] == 0).all()


def test_int8_scale_is_per_head_and_per_channel():
    pool = make_pool(4, seed=6)
    q, s = int8_pool_like(pool.states, 4)
    snapshot_quantize_int8(pool.states, q, s, pairs_of([[2, 1]]))
    conv, ssm = pool.conv[0][2].float(), pool.ssm[0][2].float()
    assert torch.equal(s[0][1], conv.abs().amax(dim=1) / 127)  # one per channel
    assert torch.equal(s[1][1], ssm.abs().flatten(1).amax(dim=1) / 127)  # one per head
    assert q[1][1].abs().amax() == 127


def _int8_error_cases():
    x = torch.randn(6, 3, 4)
    q, s = torch.zeros(6, 3, 4, dtype=torch.int8), torch.zeros(6, 3)
    return [
        ([x], [q.float()], [s], "q_tensors\\[0\\] must be int8"),
        ([x], [q], [s[:, :2]], "scales\\[0\\] must be float32 \\(blocks, 3\\)"),
        ([x.int()], [q], [s], "states\\[0\\] must be float32, float16 or bfloat16"),
        ([x], [q[:, :2]], [s], "must match states\\[0\\]"),
        ([x], [q, q], [s], "they must pair up"),
        ([x[:, :, ::2]], [q[:, :, ::2]], [s], "must be dense within a block"),
        ([x], [q], [s[:, :1].expand(6, 3)], "must be contiguous within a block"),
    ]


@pytest.mark.parametrize("x, q, s, match", _int8_error_cases())
def test_int8_bad_arguments_are_clear_errors(x, q, s, match):
    with pytest.raises(RuntimeError, match=match):
        snapshot_quantize_int8(x, q, s, pairs_of([[0, 1]]))


def test_int8_duplicate_destination_and_range_errors():
    x = [torch.randn(6, 3, 4)]
    q, s = int8_pool_like(x, 2)
    with pytest.raises(RuntimeError, match="destination block 1 appears twice"):
        snapshot_quantize_int8(x, q, s, pairs_of([[0, 1], [2, 1]]))
    with pytest.raises(RuntimeError, match="destination block 2 out of range"):
        snapshot_quantize_int8(x, q, s, pairs_of([[0, 2]]))
    with pytest.raises(RuntimeError, match="source block 2 out of range"):
        snapshot_dequantize_int8(q, s, x, pairs_of([[2, 0]]))
