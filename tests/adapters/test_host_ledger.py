"""The engine host tier without an engine: the ledger on a PrefixIndex, the worker's copies on
CPU tensors, and the settings/connector selection."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.core.test_prefix_index import KV, S1, S2, B, Pool, make
from vllm_hybrid.core.config import ConfigError, HybridCacheConfig
from vllm_hybrid.core.host_ledger import (
    DEMOTE,
    PROMOTE,
    HostLedger,
    host_slots,
)
from vllm_hybrid.core.host_tier import HostTierError


def setup(slots: int = 2) -> tuple[HostLedger, Pool, dict]:
    """Chain abcd, snapshots after ab and abcd; sglang evicts the interior one (ab) alone."""
    mirror = make("sglang")
    ledger = HostLedger(mirror, slots, 100)
    pool = Pool(mirror)
    pages = pool.cache("abcd", snap_at={2, 4})
    return ledger, pool, pages


def key_at(chain: str):
    return lambda end: chain[: end // B]


def test_demote_when_the_policy_evicts_a_snapshot_alone() -> None:
    ledger, pool, pages = setup()
    victims = pool.evict(1)
    assert sorted(victims) == sorted([pages["ab", S1], pages["ab", S2]])
    assert ledger.take_ops() == [(DEMOTE, 0, (pages["ab", S1], pages["ab", S2]))]
    assert ledger.take_ops() == []  # drained
    node = ledger.mirror.node_of("ab")
    assert ledger.tier.holds(node) and ledger.bytes_used == 100
    ledger.check_integrity()


def test_promotion_walks_to_the_deepest_state() -> None:
    ledger, pool, pages = setup()
    pool.evict(1)
    ledger.take_ops()
    # a request of 4 blocks + 1 token resumes from abcd's device state: nothing to promote
    assert ledger.find_promotion(key_at("abcd"), 4 * B + 1) is None
    # 3 blocks + 1: abc has no state, ab's is on the host
    found = ledger.find_promotion(key_at("abcx"), 3 * B + 1)
    assert found is not None and found[1] == 2 * B and found[0].key == "ab"
    # a hit may not reach the last token: with exactly 2 blocks, only a's (none) counts
    assert ledger.find_promotion(key_at("ab"), 2 * B) is None
    slot = ledger.promote(found[0], [90, 91])
    assert ledger.take_ops() == [(PROMOTE, slot, (90, 91))]
    assert not ledger.tier.holds(found[0]) and ledger.tier.promoted == 1
    for page, group in ((90, S1), (91, S2)):  # the pool caches the blocks under ab
        ledger.mirror.page_used(page)
        ledger.mirror.add(page, "ab", group, 2 * B, "a")
    assert ledger.tier.superseded == 0  # taken before it was cached again
    ledger.check_integrity()
    with pytest.raises(ValueError):
        ledger.promote(found[0], [1])  # one block per Mamba group


def test_a_dead_path_is_not_promoted() -> None:
    ledger, pool, pages = setup()
    pool.evict(1)
    ledger.mirror.drop_page(pages["a", KV])  # a's KV goes: ab is no longer live
    assert ledger.find_promotion(key_at("abcx"), 3 * B + 1) is None
    ledger.check_integrity()  # still held: its KV may come back under the same hashes


def test_discard_when_the_kv_goes_or_the_state_comes_back() -> None:
    ledger, pool, pages = setup()
    pool.evict(1)
    ledger.mirror.add(50, "ab", S1, 2 * B, "a")
    ledger.mirror.add(51, "ab", S2, 2 * B, "a")  # the device holds ab's state again
    assert len(ledger.tier) == 0 and ledger.tier.superseded == 1
    ledger.check_integrity()
    ledger2, pool2, pages2 = setup()
    pool2.evict(1)
    ledger2.mirror.drop_page(pages2["ab", KV])  # ab's last page: the entry goes
    assert len(ledger2.tier) == 0 and ledger2.tier.invalidated == 1
    ledger2.check_integrity()


def test_a_full_host_drops_its_lowest_and_reuses_the_slot() -> None:
    mirror = make("sglang")
    ledger = HostLedger(mirror, 1, 100)
    pool = Pool(mirror)
    pool.cache("abcd", snap_at={2, 4})
    pool.cache("wxyz", snap_at={2, 4})
    pool.evict(1)
    pool.evict(1)
    ops = ledger.take_ops()
    assert [(kind, slot) for kind, slot, _ in ops] == [(DEMOTE, 0), (DEMOTE, 0)]
    assert len(ledger.tier) == 1 and ledger.tier.dropped == 1
    ledger.check_integrity()


def test_partial_blocks_stay_off_the_host_and_clear_empties_it() -> None:
    ledger, pool, pages = setup()
    partial = SimpleNamespace(n_tokens=B - 1, key="p")
    ledger._on_snapshot_evicted(partial, {S1: [1], S2: [2]}, 0.0)  # type: ignore[arg-type]
    assert ledger.take_ops() == [] and len(ledger.tier) == 0
    pool.evict(1)
    ledger.clear()
    assert len(ledger.tier) == 0 and ledger.bytes_used == 0
    ledger.check_integrity()


def test_integrity_catches_a_lost_slot() -> None:
    ledger, pool, _ = setup()
    pool.evict(1)
    ledger.tier._free_slots.append(0)  # slot 0 is held and free at once
    with pytest.raises(HostTierError):
        ledger.check_integrity()


def test_slots_and_settings() -> None:
    assert host_slots(10, 3) == 3 and host_slots(2, 3) == 0
    with pytest.raises(ValueError):
        host_slots(10, 0)
    assert HybridCacheConfig.from_sources({"host_tier_gb": "0.5"}, {}).host_tier_bytes == 5 * 10**8
    assert HybridCacheConfig.from_sources(None, {"VLLM_HYBRID_HOST_TIER_GB": "2"}).host_tier_gb == 2
    assert HybridCacheConfig.from_sources(None, {}).host_tier_bytes == 0  # off by default
    for bad in (-1, "lots", True, float("nan")):
        with pytest.raises(ConfigError, match="host_tier_gb"):
            HybridCacheConfig.from_sources({"host_tier_gb": bad}, {})


def test_worker_copies_run_in_order() -> None:
    from vllm_hybrid.adapters.vllm.host_connector import HostStateBuffer

    blocks, page = 6, 8
    layers = {
        f"m{i}": torch.arange(blocks * page, dtype=torch.int8).view(blocks, 1, 1, page) + i
        for i in range(3)
    }
    originals = {k: v.clone() for k, v in layers.items()}
    spec = SimpleNamespace(real_page_size_bytes=page)
    config = SimpleNamespace(
        num_blocks=blocks,
        kv_cache_groups=[
            SimpleNamespace(layer_names=["a0"]),
            SimpleNamespace(layer_names=["m0", "m1"], kv_cache_spec=spec),
            SimpleNamespace(layer_names=["m2"], kv_cache_spec=spec),
        ],
    )
    buffer = HostStateBuffer(layers, config, [1, 2], num_slots=2)  # type: ignore[arg-type]
    assert buffer.bytes == 3 * 2 * page
    buffer.run(
        [
            (DEMOTE, 0, (1, 2)),  # group 1's layers from block 1, group 2's from block 2
            (PROMOTE, 0, (4, 5)),  # same step: reads what the demote wrote
            (DEMOTE, 1, (4, 4)),  # a slot written after the promote that read slot 0
            (PROMOTE, 1, (0, 0)),
        ]
    )
    assert torch.equal(layers["m0"][4], originals["m0"][1])
    assert torch.equal(layers["m1"][4], originals["m1"][1])
    assert torch.equal(layers["m2"][5], originals["m2"][2])
    assert torch.equal(layers["m0"][0], originals["m0"][1])
    assert torch.equal(layers["m2"][0], originals["m2"][4])
    assert torch.equal(layers["m0"][3], originals["m0"][3])  # untouched
    with pytest.raises(RuntimeError, match="Mamba layer"):
        HostStateBuffer({"m0": torch.zeros(4, 8)}, config, [1], 1)  # type: ignore[arg-type]
    for wrong in (
        {k: v[:-1] for k, v in layers.items()},
        {k: v[..., :-1] for k, v in layers.items()},
    ):
        with pytest.raises(RuntimeError, match="pages"):
            HostStateBuffer(wrong, config, [1], 1)  # type: ignore[arg-type]


def test_the_connector_is_selected_only_when_the_tier_is_on(monkeypatch) -> None:
    from vllm_hybrid.adapters.vllm.config import configure_host_tier
    from vllm_hybrid.adapters.vllm.host_connector import BYTES_KEY, CONNECTOR_NAME

    monkeypatch.delenv("VLLM_HYBRID_HOST_TIER_GB", raising=False)

    def args(host=None, connector=None, offload=None):
        section = {} if host is None else {"host_tier_gb": host}
        return SimpleNamespace(
            additional_config={"vllm_hybrid": section},
            kv_transfer_config=connector,
            kv_offloading_size=offload,
        )

    off = args()
    configure_host_tier(off)
    assert off.kv_transfer_config is None
    on = args(0.25)
    configure_host_tier(on)
    assert on.kv_transfer_config.kv_connector == CONNECTOR_NAME
    assert on.kv_transfer_config.kv_connector_extra_config == {BYTES_KEY: 250_000_000}
    again = args(0.25, connector=on.kv_transfer_config)
    configure_host_tier(again)  # ours already: kept
    for clash in (args(1, connector={"kv_connector": "NixlConnector"}), args(1, offload=4)):
        with pytest.raises(ConfigError, match="host_tier_gb"):
            configure_host_tier(clash)
    stock = args(1)
    stock.additional_config["vllm_hybrid"]["policy"] = "stock"
    configure_host_tier(stock)
    assert stock.kv_transfer_config is None


def test_bench_host_rows() -> None:
    from vllm_hybrid.bench import BenchError
    from vllm_hybrid.bench.policies import engine_setup, parse_policies

    assert parse_policies("ours,ours+host,flop+host,off") == [
        "ours",
        "ours+host",
        "flop+host",
        "off",
    ]
    for bad in ("stock+host", "off+host", "nope+host"):
        with pytest.raises(BenchError, match="unknown policy"):
            parse_policies(bad)
    setup = engine_setup("ours+host", 0.05)
    assert setup.engine_kwargs["additional_config"]["vllm_hybrid"]["host_tier_gb"] == 0.05
    plain = engine_setup("ours", 0.05).engine_kwargs["additional_config"]["vllm_hybrid"]
    assert "host_tier_gb" not in plain
    with pytest.raises(BenchError, match="--host-gb"):
        engine_setup("ours+host")
