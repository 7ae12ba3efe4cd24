"""CUDA snapshot ops and the CUDA prefill-checkpoint store == their torch twins (GPU only).

Skipped without a GPU or without a CUDA build of the extension; benchmarks/gpu_check.sh builds
one and runs these.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_prefill_checkpoint import make_case
from tests.ops.test_snapshot import DTYPES, PAIRS, make_pool, pairs_of
from vllm_hybrid.ops import (
    extension_available,
    int8_pool_like,
    snapshot_copy,
    snapshot_copy_ref,
    snapshot_dequantize_int8,
    snapshot_dequantize_int8_ref,
    snapshot_quantize_int8,
    snapshot_quantize_int8_ref,
    store_prefill_checkpoint,
    store_prefill_checkpoint_ref,
)


def _cuda_ops_built() -> bool:
    if not (torch.cuda.is_available() and extension_available()):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("vllm_hybrid::snapshot_copy", "CUDA")


pytestmark = pytest.mark.skipif(
    not _cuda_ops_built(), reason="needs a GPU and a CUDA build (VLLM_HYBRID_CUDA=1)"
)


def same_pages(a, b):
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a.pages, b.pages, strict=True))


@pytest.mark.parametrize("pad", [36, 6, 0])
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}")
def test_copy_on_device_matches_ref(dtypes, pad):
    if pad == 6 and torch.float32 in dtypes:
        pad = 4
    pool = make_pool(23, conv_dtype=dtypes[0], ssm_dtype=dtypes[1], pad_bytes=pad, device="cuda")
    ours, ref = pool.clone(), pool.clone()
    snapshot_copy(ours.states, ours.states, PAIRS)
    snapshot_copy_ref(ref.states, ref.states, PAIRS)
    assert same_pages(ours, ref)


def test_copy_device_to_pinned_host_and_back():
    dev = make_pool(11, device="cuda", seed=2)
    host = make_pool(29, pad_bytes=100, seed=3, pin=True)
    ref_host = make_pool(29, pad_bytes=100, seed=3)
    save = pairs_of([[0, 28], [10, 3], [0, 4], [7, 0]])
    snapshot_copy(dev.states, host.states, save)
    torch.cuda.synchronize()
    snapshot_copy_ref(dev.states, ref_host.states, save)
    assert same_pages(host, ref_host)
    restore = pairs_of([[28, 5], [3, 1]])
    ref_dev = dev.clone()
    snapshot_copy(host.states, dev.states, restore)
    snapshot_copy_ref(host.states, ref_dev.states, restore)
    assert same_pages(dev, ref_dev)


def test_many_pairs_and_layers_on_device():
    shapes = [(5 + i % 7, 4, 1 + i % 3, 3 + i % 5, 1 + i % 4) for i in range(54)]
    pool = make_pool(300, shapes=shapes, device="cuda", seed=4)
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(0))
    pairs = torch.stack([perm[150:][torch.arange(150) % 37], perm[:150]], 1)
    ours, ref = pool.clone(), pool.clone()
    snapshot_copy(ours.states, ours.states, pairs)
    snapshot_copy_ref(ref.states, ref.states, pairs)
    assert same_pages(ours, ref)


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}")
def test_int8_on_device_equals_cpu_bit_for_bit(dtypes):
    cpu = make_pool(23, conv_dtype=dtypes[0], ssm_dtype=dtypes[1], seed=5)
    dev = make_pool(23, conv_dtype=dtypes[0], ssm_dtype=dtypes[1], seed=5, device="cuda")
    q, s = int8_pool_like(dev.states, 9, device="cuda")
    q_ref, s_ref = int8_pool_like(cpu.states, 9)
    save = pairs_of([[3, 0], [3, 5], [17, 8], [1, 2], [20, 7]])
    snapshot_quantize_int8(dev.states, q, s, save)
    snapshot_quantize_int8_ref(cpu.states, q_ref, s_ref, save)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(q + s, q_ref + s_ref, strict=True))
    restore = pairs_of([[0, 10], [5, 11], [8, 12], [2, 13], [7, 14]])
    snapshot_dequantize_int8(q, s, dev.states, restore)
    snapshot_dequantize_int8_ref(q_ref, s_ref, cpu.states, restore)
    assert same_pages(dev, cpu)


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_prefill_checkpoint_on_device_matches_ref(ssm_dtype):
    args, state_len = make_case(0, ssm_dtype=ssm_dtype)
    x, conv, chunks, ssm, *idx = args
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    store_prefill_checkpoint_ref(x, conv_ref, chunks, ssm_ref, *idx, state_len=state_len)
    conv_d, ssm_d = conv.cuda(), ssm.cuda()
    idx_d = [t.cuda().int() for t in idx]
    store_prefill_checkpoint(x.cuda(), conv_d, chunks.cuda(), ssm_d, *idx_d, state_len=state_len)
    assert torch.equal(conv_d.cpu(), conv_ref) and torch.equal(ssm_d.cpu(), ssm_ref)


def test_prefill_checkpoint_bad_indices_are_skipped_and_reported(monkeypatch):
    args, state_len = make_case(0, dst=(99, 0, 7))
    x, conv, chunks, ssm, *idx = (t.cuda() for t in args)
    before = conv.clone()
    monkeypatch.setenv("VLLM_HYBRID_CHECK_INDICES", "1")
    with pytest.raises(RuntimeError, match="out of range"):
        store_prefill_checkpoint(x, conv, chunks, ssm, *idx, state_len=state_len)
    kept = [b for b in range(conv.shape[0]) if b != 7]  # row 2 (dst 7) is valid
    assert torch.equal(conv[kept], before[kept])  # the bad row (dst 99) wrote nothing


def test_cuda_errors_are_clear():
    dev = make_pool(6, device="cuda")
    host = make_pool(6)  # not pinned
    with pytest.raises(RuntimeError, match="is not pinned"):
        snapshot_copy(dev.states, host.states, pairs_of([[0, 1]]))
    with pytest.raises(RuntimeError, match="destination block 1 appears twice"):
        snapshot_copy(dev.states, dev.states, pairs_of([[0, 1], [2, 1]]))
