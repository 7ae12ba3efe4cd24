"""``compat.flatten_cpu_rotary_inputs`` (LFM2's attention only): the CPU rotary op given q/k
as (tokens, heads, head_size), as vLLM 0.32.0's LFM2 attention gives them, equals
``forward_native``; vLLM's own ``forward_cpu`` does not (the bug the patch exists for)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs the cpu extra")

from vllm_hybrid.adapters.vllm.compat import patches  # noqa: E402

HEADS, KV_HEADS, HEAD = 4, 2, 32


def _rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU op")
    with set_current_vllm_config(VllmConfig()):  # a CustomOp is built under a config
        return get_rope(HEAD, max_position=512, is_neox_style=True, dtype=torch.float32)


def _inputs(tokens: int = 7, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor([3, 0, 1, 9, 100, 5, 2][:tokens])
    q = torch.randn(tokens, HEADS, HEAD, generator=gen)
    k = torch.randn(tokens, KV_HEADS, HEAD, generator=gen)
    return positions, q, k


def _native(rope, positions, q, k):
    return rope.forward_native(positions, q.clone(), k.clone())


def test_vllm_cpu_op_rotates_3d_inputs_wrongly():
    """When this fails, vLLM's CPU op reads 3D q/k and the patch can go."""
    rope = _rope()
    positions, q, k = _inputs()
    want_q, _ = _native(rope, positions, q, k)
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    got_q, _ = RotaryEmbedding.forward_cpu(rope, positions, q.clone(), k.clone())  # vLLM's
    assert not torch.allclose(got_q, want_q, atol=1e-5)


@pytest.mark.parametrize("rank", [3, 2])
def test_patched_cpu_op_equals_native(rank):
    rope = _rope()
    assert patches.flatten_cpu_rotary_inputs() and patches.flatten_cpu_rotary_inputs()
    assert patches.cpu_rotary_flattened()
    positions, q, k = _inputs()
    want_q, want_k = _native(rope, positions, q, k)
    if rank == 2:
        q, k, want_q, want_k = (t.reshape(t.shape[0], -1) for t in (q, k, want_q, want_k))
    q_in, k_in = q.clone(), k.clone()
    got_q, got_k = patches.flat_rotary_forward_cpu(rope, positions, q_in, k_in)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(q_in, got_q) and torch.equal(k_in, got_k)  # in place, as the op


def test_non_contiguous_inputs_are_written_back():
    rope = _rope()
    assert patches.flatten_cpu_rotary_inputs()
    positions, q, k = _inputs()
    want_q, want_k = _native(rope, positions, q, k)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, not viewable as 2D
    k_t = k.transpose(0, 1).contiguous().transpose(0, 1)
    got_q, got_k = patches.flat_rotary_forward_cpu(rope, positions, q_t, k_t)
    assert got_q is q_t and got_k is k_t
    torch.testing.assert_close(q_t, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_t, want_k, rtol=1e-5, atol=1e-5)
