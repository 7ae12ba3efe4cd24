"""The host-memory snapshot tier: its own budget, the demote / promote / invalidate paths through
the index's hooks (``HostLedger``, run by the simulator's pool as by the engine), and the int8
snapshot size the simulator uses for compressed snapshots."""

import pytest

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.host_tier import HostTier, HostTierError
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policies import FlopPolicy
from vllm_hybrid.core.shapes import load_shape
from vllm_hybrid.sim.pool import SimPool

B = 4


def _node(key: str) -> Node:
    return Node(key, None, 0, B, 0)


def test_budget_is_never_exceeded_and_lowest_priority_goes_first() -> None:
    host = HostTier(budget_bytes=25, bandwidth_bytes_per_s=10.0)
    host.attach(10)
    a, b, c = _node("a"), _node("b"), _node("c")
    assert host.demote(a, priority=5.0) and host.demote(b, priority=1.0)
    assert host.used_bytes == 20
    assert host.demote(c, priority=3.0)  # full: b (lowest) is dropped to make room
    assert [host.holds(n) for n in (a, b, c)] == [True, False, True]
    assert (host.used_bytes, host.peak_bytes, host.dropped) == (20, 20, 1)
    assert host.take(a) == 5.0 and not host.holds(a)
    assert (host.promoted, host.promote_seconds) == (1, 1.0)  # 10 bytes at 10 B/s
    assert host.discard("c") and not host.discard("c")
    assert (host.used_bytes, host.invalidated) == (0, 1)


def test_a_snapshot_larger_than_the_tier_is_not_demoted() -> None:
    host = HostTier(budget_bytes=5, bandwidth_bytes_per_s=1.0)
    host.attach(10)
    assert not host.demote(_node("a"), 0.0)
    assert host.used_bytes == 0 and host.demoted == 0


@pytest.mark.parametrize(
    ("budget", "bandwidth", "message"),
    [(-1, 1.0, "host budget"), (10, 0.0, "host bandwidth"), (10, -5.0, "host bandwidth")],
)
def test_bad_settings_are_refused(budget, bandwidth, message) -> None:
    with pytest.raises(ValueError, match=message):
        HostTier(budget, bandwidth)


class StatesFirst:
    """Test policy: interior snapshots go first (alone), then leaves (KV + state), oldest first."""

    def kv_priority(self, node: Node, now: int) -> float | None:
        return 100.0 + node.last_access if node.is_leaf else None

    def snapshot_priority(self, node: Node, now: int) -> float | None:
        return None if node.is_leaf else float(node.snap_access)

    def on_evict(self, priority: float) -> None:
        return None


def _pool(budget: int, host_bytes: int) -> SimPool:
    return SimPool(
        block_tokens=B,
        kv_bytes_per_token=1,
        snapshot_bytes=8,
        budget_bytes=budget,
        policy=StatesFirst(),
        host_bytes=host_bytes,
        host_bandwidth=1.0,
    )


def _fill(pool: SimPool, keys: list[str], snap_at: set[int]) -> None:
    h = pool.lock(pool.root)
    for i, key in enumerate(keys):
        node = pool.insert_block(h, key)
        assert node is not None
        if i in snap_at:
            assert pool.admit_snapshot(h, node)
    pool.unlock(h)


def test_interior_snapshot_is_demoted_hit_from_host_and_promoted() -> None:
    pool = _pool(budget=4 * B + 2 * 8, host_bytes=100)
    _fill(pool, ["a", "b", "c"], {0, 2})  # states after a (interior) and after c (leaf)
    pool.check_integrity()
    # room is needed: the policy evicts a's state alone (its KV is still under b and c), and
    # the tier keeps it
    assert pool.make_room(pool.free_bytes + 8)
    assert (pool.evicted_snapshots, pool.evicted_kv_blocks) == (1, 0)
    a = pool.node_of("a")
    assert a is not None and not a.has_snapshot and pool.on_host(a)
    pool.check_integrity()
    # a request diverging after a resumes from the host copy
    m = pool.match(["a", "x"], max_tokens=2 * B)
    assert m.hit_node is a and m.hit_tokens == B
    h = pool.lock(m.kv_nodes[-1])
    assert pool.promote(h, m)
    assert a.has_snapshot and not pool.on_host(a) and pool.host.tier.promoted == 1
    pool.unlock(h)
    pool.check_integrity()


def test_evicting_the_kv_drops_the_host_copy() -> None:
    pool = _pool(budget=2 * B + 8, host_bytes=100)
    _fill(pool, ["a", "b"], {0})
    pool.make_room(pool.free_bytes + 8)  # a's state alone: a is interior
    assert pool.on_host(pool.node_of("a"))
    pool.make_room(pool.budget_bytes)  # everything: the KV of a goes, so its host state too
    tier = pool.host.tier
    assert pool.node_of("a") is None and len(tier) == 0 and tier.invalidated == 1
    pool.check_integrity()


def test_a_fresh_device_snapshot_supersedes_the_host_copy() -> None:
    pool = _pool(budget=100, host_bytes=100)
    _fill(pool, ["a", "b"], {0})
    pool.make_room(pool.free_bytes + 8)
    a = pool.node_of("a")
    assert pool.on_host(a)
    h = pool.lock(a)
    assert pool.admit_snapshot(h, a)
    pool.unlock(h)
    assert a.has_snapshot and not pool.on_host(a) and pool.host.tier.superseded == 1
    pool.check_integrity()


def test_integrity_catches_a_state_on_both_tiers() -> None:
    pool = _pool(budget=100, host_bytes=100)
    _fill(pool, ["a", "b"], {0})
    pool.host.tier.demote(pool.node_of("a"), 0.0)  # bypassing the pool: now on both tiers
    with pytest.raises(HostTierError, match="H1"):
        pool.check_integrity()


def test_int8_snapshots_are_about_half_the_bytes_and_save_the_same_flops() -> None:
    shape = load_shape("zamba2-7b")
    native, int8 = CostModel(shape, 64), CostModel(shape, 64, int8_snapshots=True)
    m2 = next(g for g in shape.layers if hasattr(g, "n_heads") and hasattr(g, "d_state"))
    ssm = m2.d_inner * m2.d_state
    conv = (m2.conv_kernel - 1) * m2.conv_dim * m2.state_dtype_bytes
    assert int8.snapshot_bytes == m2.count * (ssm + 4 * m2.n_heads + conv)
    assert 1.8 < native.snapshot_bytes / int8.snapshot_bytes < 2.0  # bf16 SSM state -> int8
    assert int8.span_flops(0, 1000) == native.span_flops(0, 1000)
    assert int8.kv_bytes_per_token == native.kv_bytes_per_token


@pytest.mark.parametrize("with_host", [False, True])
def test_flop_demotes_a_leaf_state_when_the_host_has_room(with_host) -> None:
    """Ours ranks by the tier: a state that can go to the host is worth, on the device, only
    the transfer it saves (here far less per byte than the 256-token KV path under it);
    without a tier, a free leaf's state goes with its KV."""
    block = 64
    cost = CostModel(load_shape("marconi-7b"), block)
    pool = SimPool(
        block_tokens=block,
        kv_bytes_per_token=cost.kv_bytes_per_token,
        snapshot_bytes=cost.snapshot_bytes,
        budget_bytes=10 * cost.kv_bytes_per_block + cost.snapshot_bytes,
        policy=FlopPolicy(cost),
        host_bytes=10 * cost.snapshot_bytes if with_host else 0,
        host_bandwidth=25e9,
    )
    keys = ["a", "b", "c", "d"]
    _fill(pool, keys, {3})
    pool.make_room(pool.free_bytes + cost.snapshot_bytes)
    d = pool.node_of("d")
    if with_host:
        assert (pool.evicted_snapshots, pool.evicted_kv_blocks) == (1, 0) and pool.on_host(d)
        m = pool.match([*keys, "e"], max_tokens=5 * block)
        assert m.hit_node is d and m.hit_tokens == 4 * block  # resumable from the host copy
    else:
        assert d is None and (pool.evicted_snapshots, pool.evicted_kv_blocks) == (1, 1)
    pool.check_integrity()
