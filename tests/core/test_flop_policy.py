"""``flop`` admission and its online reuse estimates, by hand."""

from __future__ import annotations

import math

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


def test_reuse_probability_is_learned_apart_for_branch_points() -> None:
    pol = FlopPolicy(CostModel(load_shape("zamba2-7b"), 64))
    for t in range(8):  # eight turn ends resumed once (leaves), none twice
        hit = Node(("h", t), None, 0, 64, 0)
        hit.snap_hits = 1
        pol.observe(_ctx(t, 128, 64, 64, True), hit)
    branch = Node("b", None, 0, 64, 0)
    for k in range(3):  # a shared prefix with two continuations, resumed again and again
        branch.children[("c", k)] = Node(("c", k), branch, 64, 128, 0)
    for t in range(8, 14):
        branch.snap_hits = 1 + (t - 8) // 2
        pol.observe(_ctx(t, 128, 64, 64, True), branch)
    leaf = Node("n", None, 0, 64, 0)
    leaf.snap_hits = 1
    assert pol.reuse_probability(leaf) == 1 / 10
    branch.snap_hits = 1
    assert pol.reuse_probability(branch) == (2 + 1) / (2 + 2)  # 2 reached a 2nd hit, of 2


def test_ghost_hits_move_the_balance_and_scale_priorities() -> None:
    pol = FlopPolicy(CostModel(load_shape("zamba2-7b"), 64))
    assert pol.balance.gamma == 0.5  # no prior for recency or value
    node = Node("n", None, 0, 832, 0)
    node.has_snapshot = True
    node.children["c"] = Node("c", node, 832, 896, 0)  # interior: only its state is freed
    eff = pol._efficiency(node, True)
    base = pol.snapshot_priority(node, 0)
    assert base is not None and math.isclose(base, pol._weight(node) * pol.balance.scale(eff))
    pol.balance.gamma = 0.0
    assert pol.snapshot_priority(node, 0) == pol._weight(node)  # recency only


def test_a_leaf_state_is_a_candidate_alone_only_while_its_kv_is_in_use() -> None:
    pol = FlopPolicy(CostModel(load_shape("zamba2-7b"), 64))
    root = Node(None, None, 0, 0, 0)
    leaf = Node("leaf", root, 0, 64, 64)
    root.children["leaf"] = leaf
    leaf.has_snapshot = True
    assert pol.snapshot_priority(leaf, 1) is None  # free: goes with its KV
    assert pol.kv_priority(leaf, 1) is not None
    leaf.refs = 1  # an engine request holds the KV it resumed from
    prio = pol.snapshot_priority(leaf, 1)
    assert prio is not None and prio > pol.clock


def test_the_classes_remembered_per_request_are_bounded() -> None:
    """flop remembers the class of the most recent requests only (a long-running engine must
    not grow with every request it served); a forgotten inserter ranks as never seen."""
    pol = FlopPolicy(CostModel(load_shape("zamba2-7b"), 64))
    pol.origins_kept = 4
    root = Node("root", None, 0, 0, 0)
    for t in range(10):  # each inserts new content; each resumes from the previous one's
        resumed = Node(("n", t), None, 0, 64, 0)
        resumed.origin = t - 1
        pol.observe(_ctx(t, 256, 64 if t else 0, 64 if t else 0, True), resumed if t else root)
        assert len(pol._class_of) <= 4 and pol._reused_origins <= set(pol._class_of)
    assert sorted(pol._class_of) == [6, 7, 8, 9]
    old = Node("old", None, 0, 64, 0)
    old.origin = 2  # forgotten
    assert pol.reuse_probability(old) == 1.0
    recent = Node("recent", None, 0, 64, 0)
    recent.origin = 8  # remembered: its class's learned rate (<1: not every insert was reused)
    assert pol.reuse_probability(recent) < 1.0


def test_the_prompt_floor_stop_keeps_what_vllm_keeps_at_the_block() -> None:
    from vllm_hybrid.core import prompt_floor_stop

    # B = 128, U = 1: a 2,040-token prompt's exact end is 2,039, its last block boundary 1,920
    assert prompt_floor_stop(2040, 0, 128, 1) == 1920
    assert prompt_floor_stop(2040, 0, 128, 16) == 1920  # exact end 2,032
    assert prompt_floor_stop(2040, 0, 128, 128) == 0  # U = the block: vLLM's own checkpoint
    assert prompt_floor_stop(2049, 0, 128, 1) == 0  # the exact end is the boundary
    assert prompt_floor_stop(2040, 1792, 128, 1) == 1920  # a block computed before it
    assert prompt_floor_stop(2040, 1793, 128, 1) == 0  # under a block: not worth a chunk
    assert prompt_floor_stop(100, 0, 128, 1) == 0  # no boundary inside the prompt


def test_the_prompt_end_stop_is_the_prompt_itself_at_a_one_token_unit() -> None:
    from vllm_hybrid.core import prompt_end_stop

    # B = 128: a next turn that shares the 2,040-token prompt but not the answer as generated
    # resumes at 2,040 (the block floor 1,920 without it)
    assert prompt_end_stop(2040, 0, 128, 1) == 2040
    assert prompt_end_stop(2040, 1920, 128, 1) == 2040  # the last chunk from the floor hit
    assert prompt_end_stop(2040, 2040, 128, 1) == 0  # nothing computed past the hit
    assert prompt_end_stop(2048, 0, 128, 1) == 0  # a block boundary: kept as one
    assert prompt_end_stop(2049, 0, 128, 1) == 0  # one past it: vLLM's checkpoint at 2,048
    assert prompt_end_stop(2040, 0, 128, 16) == 0  # U > 1: vLLM's own tail checkpoint
    assert prompt_end_stop(2040, 0, 128, 128) == 0  # U = the block
