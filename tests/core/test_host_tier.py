"""The host-memory snapshot tier: its own budget, the index's demote / promote / invalidate paths,
and the int8 snapshot size the simulator uses for compressed snapshots."""

import pytest

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.host_tier import HostTier, HostTierError
from vllm_hybrid.core.index import PrefixIndex
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policies import FlopPolicy
from vllm_hybrid.core.shapes import load_shape

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


def _index(budget: int, host: HostTier) -> PrefixIndex:
    return PrefixIndex(
        block_tokens=B,
        kv_bytes_per_token=1,
        snapshot_bytes=8,
        budget_bytes=budget,
        policy=StatesFirst(),
        record_evictions=True,
        host=host,
    )


def _fill(index: PrefixIndex, keys: list[str], snap_at: set[int], now: int) -> None:
    h = index.lock(index.root)
    for i, key in enumerate(keys):
        node = index.insert_block(h, key, now)
        assert node is not None
        if i in snap_at:
            assert index.admit_snapshot(node, now)
    index.unlock(h)


def test_interior_snapshot_is_demoted_hit_from_host_and_promoted() -> None:
    host = HostTier(budget_bytes=100, bandwidth_bytes_per_s=1.0)
    index = _index(budget=4 * B + 2 * 8, host=host)
    _fill(index, ["a", "b", "c"], {0, 2}, now=1)  # states after a (interior) and after c (leaf)
    index.check_integrity()
    # room is needed: the policy evicts a's state alone (its KV is still under b and c), and
    # the tier keeps it
    ev = index.evict(index.free_bytes + 8)
    assert ev.snapshot_keys == ["a"] and ev.kv_keys == []
    a = index.get("a")
    assert a is not None and not a.has_snapshot and index.on_host(a)
    index.check_integrity()
    # a request diverging after a resumes from the host copy
    m = index.match(["a", "x"], max_tokens=2 * B)
    assert m.hit_node is a and m.hit_tokens == B
    h = index.lock(m.kv_nodes[-1])
    assert index.promote(m, now=2)
    assert a.has_snapshot and not index.on_host(a) and host.promoted == 1
    index.unlock(h)
    index.check_integrity()


def test_evicting_the_kv_drops_the_host_copy() -> None:
    host = HostTier(budget_bytes=100, bandwidth_bytes_per_s=1.0)
    index = _index(budget=2 * B + 8, host=host)
    _fill(index, ["a", "b"], {0}, now=1)
    index.evict(index.free_bytes + 8)  # a's state alone: a is interior
    assert index.on_host(index.get("a"))
    index.evict(index.budget_bytes)  # everything: the KV of a goes, so its host state too
    assert index.get("a") is None and len(host) == 0 and host.invalidated == 1
    index.check_integrity()


def test_a_fresh_device_snapshot_supersedes_the_host_copy() -> None:
    host = HostTier(budget_bytes=100, bandwidth_bytes_per_s=1.0)
    index = _index(budget=100, host=host)
    _fill(index, ["a", "b"], {0}, now=1)
    index.evict(index.free_bytes + 8)
    a = index.get("a")
    assert index.on_host(a)
    h = index.lock(a)
    assert index.admit_snapshot(a, now=2)
    index.unlock(h)
    assert a.has_snapshot and not index.on_host(a) and host.superseded == 1
    index.check_integrity()


def test_integrity_catches_a_state_on_both_tiers() -> None:
    host = HostTier(budget_bytes=100, bandwidth_bytes_per_s=1.0)
    index = _index(budget=100, host=host)
    _fill(index, ["a", "b"], {0}, now=1)
    host.demote(index.get("a"), 0.0)  # bypassing the index: the state is now on both tiers
    with pytest.raises(HostTierError, match="H1"):
        index.check_integrity()


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
    host = HostTier(10 * cost.snapshot_bytes, 25e9) if with_host else None
    index = PrefixIndex(
        block_tokens=block,
        kv_bytes_per_token=cost.kv_bytes_per_token,
        snapshot_bytes=cost.snapshot_bytes,
        budget_bytes=10 * cost.kv_bytes_per_block + cost.snapshot_bytes,
        policy=FlopPolicy(cost),
        host=host,
    )
    keys = ["a", "b", "c", "d"]
    _fill(index, keys, {3}, now=1)
    ev = index.evict(index.free_bytes + cost.snapshot_bytes)
    d = index.get("d")
    if with_host:
        assert ev.snapshot_keys == ["d"] and ev.kv_keys == [] and index.on_host(d)
        m = index.match([*keys, "e"], max_tokens=5 * block)
        assert m.hit_node is d and m.hit_tokens == 4 * block  # resumable from the host copy
    else:
        assert d is None and ev.kv_keys == ["d"] and ev.snapshot_keys == ["d"]  # together
    index.check_integrity()
