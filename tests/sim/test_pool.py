"""SimPool over the one PrefixIndex: unit tests and a hypothesis property test (the pool's, the
index's and the host tier's invariants after every operation)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.layers import AttentionLayers, Mamba2Layers
from vllm_hybrid.core.policies import POLICIES, InfinitePolicy
from vllm_hybrid.core.shapes import ModelShape
from vllm_hybrid.sim.pool import SimPool

B = 4
# The pool below holds 1 KV byte per token and 3 bytes per snapshot; COST only ranks entries.
SHAPE = ModelShape(
    "tiny",
    (
        AttentionLayers(1, 1, 1, 1, 1, 1, kv_dtype_bytes=1),
        Mamba2Layers(1, 1, 1, 1, 1, 1, conv_kernel=2, state_dtype_bytes=1),
    ),
)
COST = CostModel(SHAPE, B)
POLICY_NAMES = sorted(POLICIES)


def make(budget: int, policy: str = "vllm", **kw) -> SimPool:
    pol = POLICIES[policy](COST) if policy != "infinite" else InfinitePolicy(COST)
    return SimPool(
        block_tokens=B,
        kv_bytes_per_token=1,
        snapshot_bytes=3,
        budget_bytes=budget,
        policy=pol,
        **kw,
    )


def test_shape_bytes() -> None:
    assert SHAPE.kv_bytes_per_token == 2  # K and V
    assert SHAPE.snapshot_bytes == 1 + 3  # ssm 1x1 + conv (2-1)x(1+2*1)


def test_insert_match_snapshot_and_evict() -> None:
    pool = make(11, "vllm")
    h = pool.lock(pool.root)
    a = pool.insert_block(h, "a")
    b = pool.insert_block(h, "b")
    assert a is not None and b is not None and h.node is b
    assert pool.admit_snapshot(h, a)
    m = pool.match(["a", "b", "c"], max_tokens=100)
    assert (m.kv_tokens, m.hit_tokens, m.hit_node) == (8, 4, a)
    assert m.ends_on_snapshot
    pool.check_integrity()
    assert pool.insert_block(h, "c") is None  # the pool is full of held pages
    assert pool.used_bytes == 11
    pool.unlock(h)
    pool.check_integrity()
    h = pool.lock(pool.root)
    c = pool.insert_block(h, "c")  # room is made: LRU's tail first, b (a has a child)
    assert c is not None and pool.node_of("b") is None and pool.node_of("a") is a
    assert pool.evicted_kv_blocks == 1 and pool.used_bytes == 11
    pool.check_integrity()


def test_max_tokens_caps_the_hit() -> None:
    pool = make(100, "infinite")
    h = pool.lock(pool.root)
    for key in "ab":
        node = pool.insert_block(h, key)
        assert node is not None and pool.admit_snapshot(h, node)
    assert pool.match(["a", "b"], max_tokens=7).hit_tokens == 4
    assert pool.match(["a", "b"], max_tokens=8).hit_tokens == 8


def test_partial_snapshot_matches_by_probe() -> None:
    pool = make(100, "sglang")
    h = pool.lock(pool.root)
    pool.insert_block(h, "a")
    p = pool.admit_partial(h, ("a", 2), 2)
    assert p is not None and p.end_tokens == 6 and p.has_snapshot
    probe = lambda i, n: ("a", n) if i == 1 else None  # noqa: E731
    assert pool.match(["a", "x"], 100, probe).hit_tokens == 6
    assert pool.match(["a", "x"], 5, probe).hit_tokens == 0  # the partial ends past the cap
    assert pool.match(["a", "x"], 100).hit_tokens == 0  # no probe, no partial hit
    pool.check_integrity()


def test_hidden_blocks_and_snapshots_do_not_match() -> None:
    pool = make(100, "infinite")
    h = pool.lock(pool.root)
    a = pool.insert_block(h, "a", origin=1)
    b = pool.insert_block(h, "b", origin=2)
    assert a is not None and b is not None
    pool.admit_snapshot(h, a)
    pool.admit_snapshot(h, b)
    assert pool.match(["a", "b"], 100).hit_tokens == 8
    hide_b = lambda node, snap: node.origin == 2  # noqa: E731
    assert pool.match(["a", "b"], 100, hidden=hide_b).kv_tokens == 4
    hide_b_state = lambda node, snap: snap and node is b  # noqa: E731
    m = pool.match(["a", "b"], 100, hidden=hide_b_state)
    assert (m.kv_tokens, m.hit_tokens) == (8, 4)


def test_budget_is_never_exceeded_and_held_pages_stay() -> None:
    pool = make(10, "lru-dense")
    h = pool.lock(pool.root)
    assert pool.insert_block(h, "a") is not None
    assert pool.insert_block(h, "b") is not None
    assert pool.insert_block(h, "c") is None  # 12 > 10 and all held
    assert pool.admit_snapshot(h, h.node) is False  # 8 + 3 > 10
    assert pool.used_bytes == 8 and pool.peak_bytes == 8
    pool.check_integrity()


def test_states_a_request_holds_go_only_without_hold_snapshots() -> None:
    for hold in (True, False):
        pool = make(11, "vllm", hold_snapshots=hold)
        h = pool.lock(pool.root)
        a = pool.insert_block(h, "a")
        assert a is not None and pool.admit_snapshot(h, a)
        b = pool.insert_block(h, "b")  # 4 + 3 + 4 = 11: full
        assert b is not None
        # the only page that can go is a's state, when the path does not hold it
        assert pool.admit_snapshot(h, b) != hold
        assert (a.has_snapshot, b.has_snapshot) == (hold, not hold)
        pool.check_integrity()


def test_misuse_raises() -> None:
    pool = make(100)
    h = pool.lock(pool.root)
    node = pool.insert_block(h, "a")
    assert node is not None
    pool.unlock(h)
    with pytest.raises(ValueError, match="already released"):
        pool.unlock(h)
    with pytest.raises(ValueError, match="in use"):
        pool.admit_snapshot(h, node)
    with pytest.raises(ValueError, match="released"):
        pool.insert_block(h, "b")
    h = pool.lock(pool.root)
    with pytest.raises(ValueError, match="elsewhere"):
        pool.insert_block(pool.lock(node), "a")  # a under a: the key is cached at the root


def test_integrity_detects_corruption() -> None:
    pool = make(100)
    h = pool.lock(pool.root)
    pool.insert_block(h, "a")
    pool.used_bytes += 1
    with pytest.raises(AssertionError, match="P3"):
        pool.check_integrity()
    pool.used_bytes -= 1
    page = next(iter(h.pages))
    pool._refs[page] += 1
    with pytest.raises(AssertionError, match="P2"):
        pool.check_integrity()
    pool._refs[page] -= 1
    pool.index.page_freed(page)  # the index believes a held page free
    with pytest.raises(AssertionError, match="inv 7"):
        pool.check_integrity()


def test_two_pools_evict_within_their_own_pool() -> None:
    """SGLang's two pools: a state shortage takes the least recently used state (an interior
    one alone), a KV shortage the least recently used KV leaf (its state with it), never a
    state alone, and the KV does not use the states' free bytes."""
    pool = make(20, "sglang", state_budget_bytes=6)  # two states; 14 bytes: 3 KV blocks
    h = pool.lock(pool.root)
    a = pool.insert_block(h, "a")
    b = pool.insert_block(h, "b")
    assert a is not None and b is not None
    assert pool.admit_snapshot(h, a) and pool.admit_snapshot(h, b)
    pool.unlock(h)
    pool.now = 1
    h = pool.lock(pool.root)
    c = pool.insert_block(h, "c")
    assert c is not None and pool.admit_snapshot(h, c)  # a third state: "a"'s goes (LRU)
    assert not a.has_snapshot and b.has_snapshot and pool.evicted_kv_blocks == 0
    assert pool.used_state_bytes == 6 and pool.used_bytes == 12 + 6
    d = pool.insert_block(h, "d")  # the KV pool is full: the LRU leaf "b" goes, state too
    assert d is not None and not b.alive and a.alive and pool.used_state_bytes == 3
    e = pool.insert_block(h, "e")  # 2 KV bytes free (3 in the state pool): "a" goes
    assert e is not None and not a.alive and c.has_snapshot
    assert (pool.evicted_kv_blocks, pool.evicted_snapshots) == (2, 2)
    pool.unlock(h)
    pool.check_integrity()
    with pytest.raises(ValueError, match="state pool"):
        make(5, "sglang", state_budget_bytes=6)


# ---------------------------------------------------------------- random operation sequences
OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "insert", "snap", "partial", "unlock", "promote"]),
        st.integers(0, 5),
        st.integers(0, 3),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=OPS,
    policy=st.sampled_from(POLICY_NAMES),
    budget=st.integers(0, 40),
    host_bytes=st.sampled_from([0, 3, 9]),
    hold=st.booleans(),
    state_share=st.sampled_from([None, 0.0, 0.5, 1.0]),
)
def test_random_operations_keep_invariants(
    ops, policy, budget, host_bytes, hold, state_share
) -> None:
    states = None if state_share is None else int(budget * state_share)
    pool = make(
        budget, policy, host_bytes=host_bytes, hold_snapshots=hold, state_budget_bytes=states
    )
    handles, matches = [], {}
    for t, (op, a, b) in enumerate(ops):
        pool.now = t
        if op == "start" or not handles:
            path = [(a + i) % 3 for i in range(b + 1)]
            keys = [tuple(path[: i + 1]) for i in range(len(path))]
            m = pool.match(keys, max_tokens=100)
            tip = m.kv_nodes[-1] if m.kv_nodes else pool.root
            handles.append(pool.lock(tip))
            if b % 2:  # a lock without a touch must hold the path too
                pool.touch(handles[-1], m)
            matches[id(handles[-1])] = m
        elif op == "insert":
            h = handles[a % len(handles)]
            key = (*h.node.key, b) if h.node.key else (b,)
            pool.insert_block(h, key)
        elif op == "snap":
            h = handles[a % len(handles)]
            if h.node is not pool.root:
                pool.admit_snapshot(h, h.node)
        elif op == "partial":
            h = handles[a % len(handles)]
            pool.admit_partial(h, ("p", h.node.key, b), b % (B - 1) + 1)
        elif op == "promote":
            h = handles[a % len(handles)]
            m = matches[id(h)]
            if m.hit_node is not pool.root and m.hit_node.alive:
                pool.promote(h, m)
        else:
            pool.unlock(handles.pop(a % len(handles)))
        for h in handles:
            assert h.node.alive  # held pages are never evicted
        pool.check_integrity()
        assert pool.used_bytes <= budget and pool.peak_bytes <= budget
        if states is not None:  # each pool within its own budget
            assert pool.used_state_bytes <= states
            assert pool.used_bytes - pool.used_state_bytes <= budget - states
