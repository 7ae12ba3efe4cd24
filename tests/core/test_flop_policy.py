"""``flop`` admission and its online reuse estimates, by hand."""

from __future__ import annotations

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policies import FlopPolicy
from vllm_hybrid.core.policy import AdmitContext
from vllm_hybrid.core.shapes import load_shape


def _ctx(t: int, cacheable: int, hit: int, kv: int, exact: bool) -> AdmitContext:
    return AdmitContext(t, cacheable, cacheable, hit, kv, False, 64, exact, lambda p: ("k", p))


def test_checkpoints_forward_without_exact_end_backward_with_it() -> None:
    pol = FlopPolicy(CostModel(load_shape("zamba2-7b"), 64))
    step = pol.interval_tokens  # 832 for Zamba2-7B
    assert step == 832
    # Not exact: absolute multiples of the interval past the cached KV.
    assert pol.checkpoint_positions(_ctx(0, 3000, 0, 0, False)) == [832, 1664, 2496]
    # Exact end 3000: one interval below it and on, floored to blocks, above the cached KV.
    back = pol.checkpoint_positions(_ctx(0, 3000, 0, 640, True))
    assert back == [2112, 1280]
    assert all(3000 - p >= step for p in back)
    assert pol.checkpoint_positions(_ctx(0, 900, 0, 0, True)) == [64]
    assert pol.checkpoint_positions(_ctx(0, 800, 0, 0, True)) == []


def test_reuse_probability_learns_liveness_by_hit_count() -> None:
    pol = FlopPolicy(CostModel(load_shape("zamba2-7b"), 64))
    node = Node("n", None, 0, 64, 0)
    node.snap_hits = 1
    assert pol.reuse_probability(node) == 0.5  # no data: Laplace prior
    for t in range(8):  # eight snapshots resumed once, none twice
        hit = Node(("h", t), None, 0, 64, 0)
        hit.snap_hits = 1
        pol.observe(_ctx(t, 128, 64, 64, True), hit)
    assert pol.reuse_probability(node) == 1 / 10
    node.snap_hits = 5  # pooled bucket: hits past the cap
    assert pol.reuse_probability(node) == 0.5
