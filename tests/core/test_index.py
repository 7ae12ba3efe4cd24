"""PrefixIndex: unit tests and hypothesis property tests (integrity after every operation)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.index import PrefixIndex
from vllm_hybrid.core.integrity import IntegrityError
from vllm_hybrid.core.layers import AttentionLayers, Mamba2Layers
from vllm_hybrid.core.policies import POLICIES, InfinitePolicy
from vllm_hybrid.core.shapes import ModelShape

B = 4
# The index below holds 1 KV byte per token and 3 bytes per snapshot; COST only ranks entries.
SHAPE = ModelShape(
    "tiny",
    (
        AttentionLayers(1, 1, 1, 1, 1, 1, kv_dtype_bytes=1),
        Mamba2Layers(1, 1, 1, 1, 1, 1, conv_kernel=2, state_dtype_bytes=1),
    ),
)
COST = CostModel(SHAPE, B)
POLICY_NAMES = sorted(POLICIES)


def make(budget: int, policy: str = "vllm", record: bool = False) -> PrefixIndex:
    pol = POLICIES[policy](COST) if policy != "infinite" else InfinitePolicy(COST)
    return PrefixIndex(
        block_tokens=B,
        kv_bytes_per_token=1,
        snapshot_bytes=3,
        budget_bytes=budget,
        policy=pol,
        record_evictions=record,
    )


def test_shape_bytes() -> None:
    assert SHAPE.kv_bytes_per_token == 2  # K and V
    assert SHAPE.snapshot_bytes == 1 + 3  # ssm 1x1 + conv (2-1)x(1+2*1)


def test_insert_match_snapshot_and_evict() -> None:
    idx = make(100, "vllm", record=True)
    h = idx.lock(idx.root)
    a = idx.insert_block(h, "a", 1)
    b = idx.insert_block(h, "b", 1)
    assert a is not None and b is not None and h.node is b
    assert idx.admit_snapshot(a, 1)
    m = idx.match(["a", "b", "c"], max_tokens=100)
    assert (m.kv_tokens, m.hit_tokens, m.hit_node) == (8, 4, a)
    assert m.ends_on_snapshot
    idx.check_integrity()
    out = idx.evict(100)  # everything is locked
    assert out.freed_bytes == 0 and idx.used_bytes == 11
    idx.unlock(h)
    out = idx.evict(100)
    assert sorted(out.kv_keys) == ["a", "b"] and out.snapshot_keys == ["a"]
    assert out.freed_bytes == 11 and idx.used_bytes == 0
    assert idx.pop_evictions().kv_keys == out.kv_keys
    idx.check_integrity()


def test_max_tokens_caps_the_hit() -> None:
    idx = make(100, "infinite")
    h = idx.lock(idx.root)
    for key in "ab":
        node = idx.insert_block(h, key, 0)
        assert node is not None and idx.admit_snapshot(node, 0)
    assert idx.match(["a", "b"], max_tokens=7).hit_tokens == 4
    assert idx.match(["a", "b"], max_tokens=8).hit_tokens == 8


def test_partial_snapshot_matches_by_probe() -> None:
    idx = make(100, "sglang")
    h = idx.lock(idx.root)
    idx.insert_block(h, "a", 0)
    p = idx.admit_partial(h, ("a", 2), 2, 0)
    assert p is not None and p.end_tokens == 6 and p.has_snapshot
    probe = lambda i, n: ("a", n) if i == 1 else None  # noqa: E731
    assert idx.match(["a", "x"], 100, probe).hit_tokens == 6
    assert idx.match(["a", "x"], 5, probe).hit_tokens == 0  # the partial ends past the cap
    assert idx.match(["a", "x"], 100).hit_tokens == 0  # no probe, no partial hit
    idx.check_integrity()


def test_budget_is_never_exceeded_and_locked_entries_stay() -> None:
    idx = make(10, "lru-dense")
    h = idx.lock(idx.root)
    assert idx.insert_block(h, "a", 0) is not None
    assert idx.insert_block(h, "b", 0) is not None
    assert idx.insert_block(h, "c", 0) is None  # 12 > 10 and all locked
    assert idx.admit_snapshot(h.node, 0) is False  # 8 + 3 > 10
    assert idx.used_bytes == 8 and idx.peak_bytes == 8
    idx.check_integrity()


def test_misuse_raises() -> None:
    idx = make(100)
    h = idx.lock(idx.root)
    node = idx.insert_block(h, "a", 0)
    assert node is not None
    idx.unlock(h)
    with pytest.raises(ValueError, match="already released"):
        idx.unlock(h)
    with pytest.raises(ValueError, match="locked"):
        idx.admit_snapshot(node, 0)
    with pytest.raises(ValueError, match="released"):
        idx.insert_block(h, "b", 0)


def test_integrity_detects_corruption() -> None:
    idx = make(100)
    h = idx.lock(idx.root)
    idx.insert_block(h, "a", 0)
    idx.used_bytes += 1
    with pytest.raises(IntegrityError, match="invariant 5"):
        idx.check_integrity()
    idx.used_bytes -= 1
    h.node.refs += 1
    with pytest.raises(IntegrityError, match="invariant 4"):
        idx.check_integrity()


# ---------------------------------------------------------------- random operation sequences
OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "insert", "snap", "partial", "unlock", "evict"]),
        st.integers(0, 5),
        st.integers(0, 3),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, policy=st.sampled_from(POLICY_NAMES), budget=st.integers(0, 40))
def test_random_operations_keep_invariants(ops, policy, budget) -> None:
    idx = make(budget, policy, record=True)
    handles = []
    for t, (op, a, b) in enumerate(ops):
        idx.now = t
        if op == "start" or not handles:
            path = [(a + i) % 3 for i in range(b + 1)]
            keys = [tuple(path[: i + 1]) for i in range(len(path))]
            m = idx.match(keys, max_tokens=100)
            tip = m.kv_nodes[-1] if m.kv_nodes else idx.root
            handles.append(idx.lock(tip))
            if b % 2:  # a lock without a touch must protect the path too
                idx.touch(m, t)
        elif op == "insert":
            h = handles[a % len(handles)]
            key = (*h.node.key, b) if h.node.key else (b,)
            if h.node.n_tokens in (0, B):
                idx.insert_block(h, key, t)
        elif op == "snap":
            node = handles[a % len(handles)].node
            if node is not idx.root:
                idx.admit_snapshot(node, t)
        elif op == "partial":
            h = handles[a % len(handles)]
            if h.node.n_tokens in (0, B):
                idx.admit_partial(h, ("p", h.node.key, b), b % (B - 1) + 1, t)
        elif op == "unlock":
            idx.unlock(handles.pop(a % len(handles)))
        else:
            ev = idx.evict(a * 3)
            assert ev.freed_bytes >= 0
        for h in handles:
            assert h.node.alive  # invariant 4: locked entries are never evicted
        idx.check_integrity()
        assert idx.used_bytes <= budget and idx.peak_bytes <= budget
