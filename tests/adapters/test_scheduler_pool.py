"""HybridBlockPool on a real vLLM BlockPool, driven by hand (no engine): the mirror follows vLLM's
hash map, victims come from the policy, KV and its snapshot go together, in-use blocks stay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the cpu extra")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash  # noqa: E402

from vllm_hybrid.adapters.vllm import scheduler  # noqa: E402
from vllm_hybrid.adapters.vllm.block_pool import HybridBlockPool, install  # noqa: E402
from vllm_hybrid.core import PrefixIndex  # noqa: E402
from vllm_hybrid.core.cost import CostModel  # noqa: E402
from vllm_hybrid.core.policies import POLICIES  # noqa: E402
from vllm_hybrid.core.shapes import load_shape  # noqa: E402

B = 4
KV, STATE = 0, 1


def make_pool(n_blocks: int = 12, policy: str = "flop") -> HybridBlockPool:
    pool = BlockPool(num_gpu_blocks=n_blocks, enable_caching=True, hash_block_size=B)
    cost = CostModel(load_shape("zamba2-2.7b"), B)
    mirror = PrefixIndex(
        block_tokens=B, kv_groups=[KV], state_groups=[STATE], policy=POLICIES[policy](cost)
    )
    return install(pool, mirror)


def request(name: str, n_blocks: int) -> SimpleNamespace:
    hashes = [BlockHash(f"{name}{i}".encode()) for i in range(n_blocks)]
    return SimpleNamespace(request_id=name, block_hashes=hashes)


def run_request(pool: HybridBlockPool, req: SimpleNamespace, snap_at: int) -> dict:
    """Allocate KV blocks for the whole chain and one state block ending at block ``snap_at``,
    cache them as vLLM's managers do, then free them (the request finished)."""
    n = len(req.block_hashes)
    kv = pool.get_new_blocks(n)
    pool.cache_full_blocks(req, kv, 0, n, B, KV)
    state = pool.get_new_blocks(snap_at)  # align mode: only the block at snap_at is kept
    mask = [i == snap_at - 1 for i in range(snap_at)]
    pool.cache_full_blocks(req, state, 0, snap_at, B, STATE, block_mask=mask)
    pool.free_blocks(reversed(state[:-1]))
    pool.free_blocks(reversed(kv + state[-1:]))
    pool.hy_check_integrity()
    return {"kv": kv, "state": state[-1]}


def cached(pool: BlockPool, req: SimpleNamespace, i: int, group: int) -> bool:
    return pool.get_cached_block(req.block_hashes[i], [group]) is not None


def test_install_refuses_a_used_pool() -> None:
    pool = BlockPool(num_gpu_blocks=4, enable_caching=False, hash_block_size=B)
    with pytest.raises(ValueError):
        install(pool, PrefixIndex(block_tokens=B, kv_groups=[0], state_groups=[1], policy=None))


def test_victims_are_whole_units_and_lookup_stays_consistent() -> None:
    pool = make_pool(n_blocks=12)
    a, b = request("a", 3), request("b", 3)
    run_request(pool, a, snap_at=3)
    pool.hybrid.mirror.tick()
    run_request(pool, b, snap_at=3)
    # 11 usable blocks: a and b hold 4 cached blocks each, 3 blocks are free and uncached
    assert pool.get_num_free_blocks() == 11
    got = pool.get_new_blocks(4)  # one more than the uncached ones
    pool.hy_check_integrity()
    assert pool.hybrid.policy_pages >= 1 and pool.hybrid.fallback_pages == 0
    # a whole leaf went with its snapshot: its KV and its state are both gone from vLLM's map
    gone = [r for r in (a, b) if not cached(pool, r, 2, KV)]
    assert len(gone) == 1 and not cached(pool, gone[0], 2, STATE)
    assert all(blk.ref_cnt == 1 for blk in got)
    # the other chain is intact and still hits in full
    kept = b if gone[0] is a else a
    assert all(cached(pool, kept, i, KV) for i in range(3)) and cached(pool, kept, 2, STATE)


def test_blocks_in_use_are_never_victims() -> None:
    pool = make_pool(n_blocks=12)
    a, b = request("a", 3), request("b", 3)
    held = run_request(pool, a, snap_at=3)
    pool.touch(held["kv"] + [held["state"]])  # a running request hits all of a
    run_request(pool, b, snap_at=3)
    pool.get_new_blocks(pool.get_num_free_blocks())
    pool.hy_check_integrity()
    assert all(cached(pool, a, i, KV) for i in range(3)) and cached(pool, a, 2, STATE)
    assert not any(cached(pool, b, i, KV) for i in range(3))


def test_reset_and_move_keep_the_mirror_in_sync() -> None:
    pool = make_pool(n_blocks=12)
    a = request("a", 2)
    blocks = run_request(pool, a, snap_at=2)
    fresh = pool.get_new_blocks(1)[0]
    pool.touch([blocks["state"]])
    pool.move_block_hashes(blocks["state"], fresh)
    pool.hy_check_integrity()
    assert pool.get_cached_block(a.block_hashes[1], [STATE])[0] is fresh
    pool.free_blocks([blocks["state"], fresh])
    assert pool.reset_prefix_cache()
    pool.hy_check_integrity()
    assert len(pool.hybrid.mirror) == 0


def test_settings_come_from_additional_config_over_the_environment(monkeypatch) -> None:
    from vllm_hybrid.adapters.vllm.config import load_config
    from vllm_hybrid.core.config import ConfigError

    monkeypatch.setenv("VLLM_HYBRID_POLICY", "sglang")
    assert load_config(SimpleNamespace(additional_config={})).policy == "sglang"
    given = {"vllm_hybrid": {"policy": "vllm", "debug": True}}
    got = load_config(SimpleNamespace(additional_config=given))
    assert (got.policy, got.debug) == ("vllm", True)
    with pytest.raises(
        ConfigError, match="valid: stock, flop, learned, lru-dense, marconi, sglang, vllm"
    ):
        load_config(SimpleNamespace(additional_config={"vllm_hybrid": {"policy": "belady-ish"}}))
    with pytest.raises(ConfigError, match="must be an object"):
        load_config(SimpleNamespace(additional_config={"vllm_hybrid": "flop"}))


def test_activation_only_for_mamba_hybrids_with_caching() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    attn = SimpleNamespace(
        kv_cache_spec=FullAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32
        )
    )
    no_settings = SimpleNamespace(additional_config={})
    off = SimpleNamespace(
        vllm_config=no_settings, cache_config=SimpleNamespace(enable_prefix_caching=False)
    )
    assert scheduler.activate(off) is None
    attention_only = SimpleNamespace(
        vllm_config=no_settings,
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[attn]),
    )
    assert scheduler.activate(attention_only) is None


class _KeepAll:
    """A policy that offers nothing: every page the pool needs comes from the fallback."""

    name = "keep-all"

    def kv_priority(self, node, now):  # noqa: ANN001, ANN201
        return None

    def snapshot_priority(self, node, now):  # noqa: ANN001, ANN201
        return None

    def on_evict(self, priority):  # noqa: ANN001, ANN201
        return None


def test_fallback_takes_cached_blocks_in_vllms_lru_order() -> None:
    """With nothing offered by the policy, get_new_blocks hands out what vLLM's own pool would:
    the free queue's head, cached blocks included (their hashes dropped, the mirror in sync)."""
    pools = []
    for hybrid in (False, True):
        pool = BlockPool(num_gpu_blocks=12, enable_caching=True, hash_block_size=B)
        if hybrid:
            mirror = PrefixIndex(block_tokens=B, kv_groups=[KV], state_groups=[STATE], policy=None)
            mirror.policy = _KeepAll()  # type: ignore[assignment]
            pool = install(pool, mirror)
        for name in ("a", "b"):
            req = request(name, 3)
            kv = pool.get_new_blocks(3)
            pool.cache_full_blocks(req, kv, 0, 3, B, KV)
            pool.free_blocks(reversed(kv))
        pools.append(pool)
    stock, ours = pools
    for n in (3, 4, 2):  # uncached blocks first, then cached ones, the mirror in sync
        got = [b.block_id for b in ours.get_new_blocks(n)]
        assert got == [b.block_id for b in stock.get_new_blocks(n)]
        ours.hy_check_integrity()
    assert ours.hybrid.fallback_pages == 4 and ours.hybrid.policy_pages == 0


def test_snapshot_budget_drops_states_at_release_and_vllms_map_follows(caplog) -> None:
    """Budget 1 state page: when a second request's state is released, the older chain's state
    goes at once (with its leaf KV, flop's unit), vLLM's lookup no longer finds it, the budget
    holds (``hy_check_integrity`` checks it), and one debug line says so."""
    import logging

    pool = make_pool(n_blocks=16)
    pool.hybrid.mirror.snapshot_budget_pages = 1
    a, b = request("a", 3), request("b", 3)
    run_request(pool, a, snap_at=3)
    assert pool.hybrid.budget_pages == 0 and cached(pool, a, 2, STATE)
    pool.hybrid.mirror.tick()
    with caplog.at_level(logging.DEBUG, logger="vllm_hybrid"):
        run_request(pool, b, snap_at=3)  # checks integrity, budget included
    assert pool.hybrid.mirror.free_state_pages() == 1
    assert cached(pool, b, 2, STATE) and not cached(pool, a, 2, STATE)
    assert pool.hybrid.budget_pages >= 1 and pool.hybrid.policy_pages == 0
    lines = [r.getMessage() for r in caplog.records if "snapshot budget" in r.getMessage()]
    assert lines and "over 1" in lines[0]


def test_waiting_requests_keep_what_they_would_hit() -> None:
    """The scheduler's lookahead (``_hy_waiting_paths`` over ``Scheduler.waiting``) through the
    swapped pool: LRU-wise the older chain would go, but a waiting request resumes from it, so
    the newer one goes; vLLM's lookup still finds the older chain in full."""
    pool = make_pool(n_blocks=12, policy="vllm")
    a, b = request("a", 3), request("b", 3)
    run_request(pool, a, snap_at=3)
    pool.hybrid.mirror.tick()
    run_request(pool, b, snap_at=3)
    # a waiting request with a's prompt and one more token: its hit may end on block 3
    waiting = SimpleNamespace(block_hashes=a.block_hashes + [BlockHash(b"z")], num_tokens=3 * B + 1)
    fake = SimpleNamespace(hybrid_pool=pool, waiting=[waiting])
    pool.hybrid.mirror.lookahead = lambda: scheduler._HybridMixin._hy_waiting_paths(fake)
    pool.get_new_blocks(4)
    pool.hy_check_integrity()
    assert all(cached(pool, a, i, KV) for i in range(3)) and cached(pool, a, 2, STATE)
    assert not cached(pool, b, 2, KV)
    assert pool.hybrid.mirror.stats.wanted_units >= 1 and pool.hybrid.fallback_pages == 0


def test_waiting_paths_are_keys_at_block_ends_up_to_the_last_token() -> None:
    """Hash blocks of half a block: every second hash; the block holding the last token (which
    vLLM always computes) is left out."""
    mirror = SimpleNamespace(block_tokens=8)
    pool = SimpleNamespace(hybrid=SimpleNamespace(mirror=mirror), hash_block_size=4)
    hashes = [f"h{i}" for i in range(6)]  # 24 tokens
    reqs = [SimpleNamespace(block_hashes=hashes, num_tokens=n) for n in (24, 25, 7)]
    fake = SimpleNamespace(hybrid_pool=pool, waiting=reqs)
    got = list(scheduler._HybridMixin._hy_waiting_paths(fake))
    assert got == [["h1", "h3"], ["h1", "h3", "h5"], []]
