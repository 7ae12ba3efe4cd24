"""PoolMirror: unit tests and a hypothesis property test against a tiny model of an engine pool."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.layers import AttentionLayers, Mamba2Layers
from vllm_hybrid.core.policies import POLICIES
from vllm_hybrid.core.pool_mirror import PoolMirror
from vllm_hybrid.core.shapes import ModelShape

B = 4
KV, S1, S2 = 0, 1, 2  # one attention group, two state groups
SHAPE = ModelShape(
    "tiny",
    (
        AttentionLayers(1, 1, 1, 1, 1, 1, kv_dtype_bytes=1),
        Mamba2Layers(1, 1, 1, 1, 1, 1, conv_kernel=2, state_dtype_bytes=1),
    ),
)
COST = CostModel(SHAPE, B)


def make(policy: str = "vllm") -> PoolMirror:
    return PoolMirror(
        block_tokens=B, kv_groups=[KV], state_groups=[S1, S2], policy=POLICIES[policy](COST)
    )


class Pool:
    """Pages with ref counts; caches chains of keys like vLLM (one page per (key, group))."""

    def __init__(self, mirror: PoolMirror) -> None:
        self.mirror = mirror
        self.next_page = 0
        self.in_use: set[int] = set()

    def cache(self, chain: str, snap_at: set[int] = frozenset(), used: bool = False) -> dict:
        """Cache KV for every prefix of ``chain`` (one char per block) and states at ``snap_at``
        (block counts); returns {(prefix, group): page}."""
        out = {}
        for i in range(1, len(chain) + 1):
            groups = [KV] + ([S1, S2] if i in snap_at else [])
            for g in groups:
                page = self.next_page
                self.next_page += 1
                parent = chain[: i - 1] or None
                self.mirror.add(page, chain[:i], g, i * B, parent)
                out[chain[:i], g] = page
                if used:
                    self.in_use.add(page)
        return out

    def is_free(self, page: int) -> bool:
        return page not in self.in_use

    def evict(self, n: int) -> list[int]:
        victims = self.mirror.pick_victims(n, self.is_free)
        for page in victims:
            self.mirror.drop_page(page)
        self.mirror.check_integrity()
        return victims


def test_rejects_bad_groups() -> None:
    with pytest.raises(ValueError):
        PoolMirror(block_tokens=B, kv_groups=[0], state_groups=[0], policy=POLICIES["vllm"](COST))
    with pytest.raises(ValueError):
        make().add(0, "a", 7, B, None)


def test_lru_leaf_first_and_snapshot_pages_go_with_their_kv() -> None:
    mirror = make("vllm")
    pool = Pool(mirror)
    old = pool.cache("ab", snap_at={2})
    mirror.tick()
    new = pool.cache("cd", snap_at={2})
    victims = pool.evict(1)
    # the least recently used block is evicted (deepest first on a tie in time)
    assert old["ab", KV] in victims or old["ab", S1] in victims
    assert all(p not in victims for p in new.values())
    mirror.check_integrity()


def test_kv_unit_takes_subtree_with_its_snapshots() -> None:
    mirror = make("flop")
    pool = Pool(mirror)
    pages = pool.cache("abc", snap_at={3})
    victims = pool.evict(len(pages))
    assert sorted(victims) == sorted(pages.values())
    assert len(mirror) == 0 and mirror.cached_pages() == []
    assert mirror.stats.pages == len(pages)


def test_pages_in_use_are_never_victims() -> None:
    mirror = make("vllm")
    pool = Pool(mirror)
    used = pool.cache("ab", snap_at={2}, used=True)
    assert pool.evict(10) == []
    free = pool.cache("x", snap_at={1})
    victims = pool.evict(10)
    assert sorted(victims) == sorted(free.values())
    assert all(mirror.keys_of(p) for p in used.values())


def test_snapshot_of_a_running_path_can_go_alone() -> None:
    mirror = make("vllm")
    pool = Pool(mirror)
    pages = pool.cache("ab", snap_at={1})
    pool.in_use.add(pages["ab", KV])  # a request still holds the deeper KV block
    victims = pool.evict(2)
    assert sorted(victims) == sorted([pages["a", S1], pages["a", S2]])
    assert mirror.keys_of(pages["a", KV]) == {("a", KV)}


def test_dead_pages_first_after_the_engine_drops_an_interior_block() -> None:
    mirror = make("flop")
    pool = Pool(mirror)
    pages = pool.cache("abc", snap_at={3})
    other = pool.cache("z", snap_at={1})
    mirror.drop_page(pages["ab", KV])  # the engine evicted an interior block on its own
    mirror.check_integrity()
    victims = pool.evict(1)
    dead = {pages["abc", KV], pages["abc", S1], pages["abc", S2]}
    assert set(victims) == dead
    assert mirror.stats.dead_pages == 3
    assert all(mirror.keys_of(p) for p in other.values())


def test_free_duplicates_go_before_policy_units() -> None:
    mirror = make("vllm")
    pool = Pool(mirror)
    pages = pool.cache("a")
    mirror.add(100, "a", KV, B, None)  # a second page holding the same block
    pool.in_use.add(pages["a", KV])
    assert pool.evict(1) == [100]
    assert mirror.stats.duplicate_pages == 1


def test_move_page_and_clear() -> None:
    mirror = make()
    pool = Pool(mirror)
    pages = pool.cache("a", snap_at={1})
    mirror.move_page(pages["a", S1], 50)
    mirror.check_integrity()
    assert mirror.keys_of(50) == {("a", S1)} and mirror.keys_of(pages["a", S1]) == set()
    mirror.clear()
    mirror.check_integrity()
    assert len(mirror) == 0


def test_touch_counts_hits_once_per_key_and_kind() -> None:
    mirror = make()
    pool = Pool(mirror)
    pages = pool.cache("a", snap_at={1})
    mirror.tick()
    mirror.touch_pages(pages.values())
    node = mirror._entries["a"].node
    assert (node.hits, node.snap_hits, node.last_access, node.snap_access) == (1, 1, 1, 1)


def test_integrity_catches_a_broken_inverse_map() -> None:
    mirror = make()
    Pool(mirror).cache("a")
    mirror._page_keys[99] = {("a", KV)}
    with pytest.raises(AssertionError, match="inv 1"):
        mirror.check_integrity()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["cache", "drop", "use", "release", "evict", "move", "touch"]),
        st.text("abc", min_size=1, max_size=4),
        st.integers(0, 60),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from(sorted(POLICIES)))
def test_random_operations_keep_invariants(ops: list, policy: str) -> None:
    mirror = make(policy)
    pool = Pool(mirror)
    for op, chain, x in ops:
        mirror.tick()
        cached = mirror.cached_pages()
        page = cached[x % len(cached)] if cached else None
        if op == "cache":
            pool.cache(chain, snap_at={x % (len(chain) + 1)})
        elif op == "drop" and page is not None:
            mirror.drop_page(page)
        elif op == "use" and page is not None:
            pool.in_use.add(page)
        elif op == "release":
            pool.in_use.discard(page)
        elif op == "move" and page is not None:
            mirror.move_page(page, 1000 + pool.next_page)
            pool.next_page += 1
        elif op == "touch":
            mirror.touch_pages(cached[: x % 5])
        elif op == "evict":
            before = set(cached)
            victims = pool.evict(x % 6)
            assert len(set(victims)) == len(victims) and set(victims) <= before
            assert not set(victims) & pool.in_use
            if not pool.in_use & before:  # all free: every policy frees what was asked
                assert len(victims) >= min(x % 6, len(before))
        mirror.check_integrity()


def test_optional_on_evicted_hook_is_called_before_the_unit_goes() -> None:
    mirror = make("vllm")
    seen: list[tuple[str, bool, bool]] = []
    mirror.policy.on_evicted = lambda node, snap, n: seen.append(  # type: ignore[attr-defined]
        (node.key, snap, node.has_snapshot)
    )
    pool = Pool(mirror)
    pool.cache("a", snap_at={1})
    pool.evict(3)
    assert seen and all(has for _, _, has in seen)
