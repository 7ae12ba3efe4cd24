"""Tenant isolation at the index level: the same tokens under two ``cache_salt`` values never
share an entry, a page, a node or a snapshot, in the prefix index as the engine adapter feeds
it and as the simulator's pool drives it; an eviction of one tenant leaves the other intact.

vLLM keys every cached page by a chained block hash and mixes ``cache_salt`` into the hash of
block 0 only (``vllm/v1/core/kv_cache_utils.py``: ``generate_block_hash_extra_keys`` adds
``("cache_salt", salt)`` when ``start_token_idx == 0``; ``hash_block_tokens`` hashes
``(parent, tokens, extra)``), so the salt reaches every later block through the chain. The
core tests use a stand-in of that chain (SHA-256 over the pickled triple, as vLLM's default
``sha256``); the last test checks the real one (vLLM's request block hasher and ``BlockPool``
with our mirror installed), skipped where vLLM is not installed.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Hashable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hybrid.core import PrefixIndex
from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.layers import AttentionLayers, Mamba2Layers
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policies import POLICIES
from vllm_hybrid.core.shapes import ModelShape
from vllm_hybrid.sim.pool import SimPool

B = 4
KV, STATE = 0, 1
SHAPE = ModelShape(
    "tiny",
    (
        AttentionLayers(1, 1, 1, 1, 1, 1, kv_dtype_bytes=1),
        Mamba2Layers(1, 1, 1, 1, 1, 1, conv_kernel=2, state_dtype_bytes=1),
    ),
)
COST = CostModel(SHAPE, B)
NONE_HASH = hashlib.sha256(b"vllm-none-hash").digest()


def chain(tokens: Sequence[int], salt: str | None) -> list[bytes]:
    """Block hashes of the full blocks of ``tokens``, chained as vLLM chains them."""
    out: list[bytes] = []
    parent = NONE_HASH
    for i in range(len(tokens) // B):
        extra = (("cache_salt", salt),) if i == 0 and salt else None
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[i * B : (i + 1) * B]), extra)))
        parent = parent.digest()
        out.append(parent)
    return out


def path_keys(node: Node) -> list[Hashable]:
    """Keys from ``node`` up to (not including) the root; a detached node has none above it."""
    keys: list[Hashable] = []
    walk: Node | None = node
    while walk is not None and walk.key is not None:
        keys.append(walk.key)
        walk = walk.parent
    return keys


def test_salt_changes_every_block_hash() -> None:
    tokens = list(range(10, 10 + 7 * B))
    plain, a, b = chain(tokens, None), chain(tokens, "tenant-a"), chain(tokens, "tenant-b")
    assert len(plain) == len(a) == len(b) == 7
    for i in range(7):  # the salt is hashed into block 0 only; the chain carries it on
        assert len({plain[i], a[i], b[i]}) == 3, f"block {i} shared between tenants"
    assert chain(tokens, "tenant-a") == a  # deterministic: the same tenant hits itself


# ------------------------------------------------------------------------- the pool mirror
class Tenant:
    """Feeds one tenant's prompt into a mirror as vLLM's managers cache it: a KV page for every
    full block, a state page at the blocks in ``snap_at``; returns the pages it used."""

    next_page = 0

    def __init__(self, mirror: PrefixIndex, tokens: Sequence[int], salt: str | None) -> None:
        self.keys = chain(tokens, salt)
        self.pages: list[int] = []
        self.mirror = mirror

    def cache(self, snap_at: set[int]) -> None:
        for i, key in enumerate(self.keys):
            parent = self.keys[i - 1] if i else None
            for group in [KV] + ([STATE] if i + 1 in snap_at else []):
                page = Tenant.next_page
                Tenant.next_page += 1
                self.mirror.add(page, key, group, (i + 1) * B, parent)
                self.pages.append(page)


def make_mirror(policy: str = "flop") -> PrefixIndex:
    return PrefixIndex(
        block_tokens=B, kv_groups=[KV], state_groups=[STATE], policy=POLICIES[policy](COST)
    )


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_mirror_never_shares_between_salts(policy: str) -> None:
    mirror = make_mirror(policy)
    tokens = list(range(100, 100 + 6 * B))
    tenants = {
        "a": Tenant(mirror, tokens, "tenant-a"),
        "b": Tenant(mirror, tokens, "tenant-b"),
        "none": Tenant(mirror, tokens, None),
    }
    for t in tenants.values():
        t.cache(snap_at={2, 6})
    free = lambda page: True  # noqa: E731  (every request finished)
    mirror.check_integrity(free)
    assert len(mirror) == 3 * 6  # one entry per (tenant, block): nothing merged

    owner = {k: name for name, t in tenants.items() for k in t.keys}
    for page in mirror.cached_pages():  # a page holds keys of one tenant only
        assert len({owner[k] for k, _ in mirror.keys_of(page)}) == 1
    nodes = {name: [mirror.node_of(k) for k in t.keys] for name, t in tenants.items()}
    ids = [id(n) for ns in nodes.values() for n in ns]
    assert len(ids) == len(set(ids)), "a node is shared between tenants"
    for name, ns in nodes.items():
        for node in ns:
            assert node is not None and node.alive
            # the live trie: a tenant's node hangs under its own chain only, down to the root
            assert {owner[k] for k in path_keys(node)} == {name}
        assert [n.has_snapshot for n in ns] == [i + 1 in {2, 6} for i in range(6)]

    # the engine evicts all of tenant a: b and the unsalted prompt keep every entry, live
    for page in tenants["a"].pages:
        mirror.drop_page(page)
    mirror.check_integrity(free)
    assert all(mirror.node_of(k) is None for k in tenants["a"].keys)
    for name in ("b", "none"):
        for i, node in enumerate(nodes[name]):
            assert node is not None and node.alive and len(path_keys(node)) == i + 1
            assert node.has_snapshot == (i + 1 in {2, 6})

    # policy victims: pages of b only while a's prompt is back and in use
    in_use = set()
    tenants["a"] = Tenant(mirror, tokens, "tenant-a")
    tenants["a"].cache(snap_at={6})
    in_use.update(tenants["a"].pages)
    victims = mirror.pick_victims(4, lambda page: page not in in_use)
    assert victims and not set(victims) & in_use
    mirror.check_integrity(lambda page: page not in in_use)


# ------------------------------------------------------------------------- the simulator's pool
def make_index(budget: int, policy: str = "flop") -> SimPool:
    return SimPool(
        block_tokens=B,
        kv_bytes_per_token=1,
        snapshot_bytes=3,
        budget_bytes=budget,
        policy=POLICIES[policy](COST),
    )


def serve(index: SimPool, keys: list[bytes], tenant: int, now: int) -> tuple[list[Node], int]:
    """One request as the simulator drives its pool: match, lock, insert the rest, snapshot at
    the end, unlock. Returns the nodes the match served and the tokens hit."""
    index.now = now
    m = index.match(keys, max_tokens=len(keys) * B)
    served = [*m.kv_nodes, m.hit_node] if m.hit_tokens else list(m.kv_nodes)
    handle = index.lock(m.kv_nodes[-1] if m.kv_nodes else index.root)
    index.touch(handle, m)
    for key in keys[len(m.kv_nodes) :]:
        if index.insert_block(handle, key, origin=tenant) is None:
            break
    if handle.node is not index.root:
        index.admit_snapshot(handle, handle.node)
    index.unlock(handle)
    index.check_integrity()
    return served, m.hit_tokens


def test_index_same_tokens_two_salts() -> None:
    index = make_index(budget=10**6)
    tokens = list(range(7, 7 + 5 * B))
    a, b = chain(tokens, "tenant-a"), chain(tokens, "tenant-b")
    served, hit = serve(index, a, tenant=1, now=1)
    assert (served, hit) == ([], 0)
    served, hit = serve(index, b, tenant=2, now=2)  # same tokens, other tenant: a miss
    assert (served, hit) == ([], 0)
    served, hit = serve(index, a, tenant=1, now=3)  # the same tenant: a full hit
    assert hit == 5 * B and {n.origin for n in served} == {1}
    assert not {id(index.node_of(k)) for k in a} & {id(index.node_of(k)) for k in b}


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(0, 2),  # tenant (0, 1: salted; 2: no salt)
            st.integers(0, 2),  # which shared prompt
            st.integers(1, 6),  # blocks of it
        ),
        min_size=1,
        max_size=30,
    ),
    budget=st.integers(8, 80),
    policy=st.sampled_from(sorted(POLICIES)),
)
def test_index_hits_come_from_the_same_tenant(requests, budget, policy) -> None:
    """Random tenants on the same three prompts under a small budget (constant eviction):
    every node a request is served from was inserted by that tenant."""
    index = make_index(budget, policy)
    prompts = [list(range(p * 1000, p * 1000 + 6 * B)) for p in range(3)]
    salts = ["tenant-0", "tenant-1", None]
    for now, (tenant, prompt, n_blocks) in enumerate(requests, start=1):
        keys = chain(prompts[prompt][: n_blocks * B], salts[tenant])
        served, _ = serve(index, keys, tenant, now)
        assert {n.origin for n in served} <= {tenant}, "served from another tenant's entry"


# ------------------------------------------------------------------------- vLLM's real hashes
def test_vllm_hashes_and_pool_keep_salts_apart() -> None:
    """vLLM's request block hasher differs at block 0 and so at every block; a real
    ``BlockPool`` with our mirror installed serves tenant b nothing of tenant a's pages."""
    pytest.importorskip("vllm", reason="needs the cpu extra")
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from vllm_hybrid.adapters.vllm.block_pool import install

    init_none_hash(sha256)
    hasher = get_request_block_hasher(B, sha256)
    tokens = list(range(50, 50 + 5 * B))

    def request(name: str, salt: str | None) -> Request:
        params = SamplingParams(max_tokens=1)
        return Request(name, tokens, params, None, cache_salt=salt, block_hasher=hasher)

    a, b, plain = request("a", "tenant-a"), request("b", "tenant-b"), request("p", None)
    assert len(a.block_hashes) == len(b.block_hashes) == len(plain.block_hashes) == 5
    for i in range(5):
        assert len({a.block_hashes[i], b.block_hashes[i], plain.block_hashes[i]}) == 3

    pool = install(
        BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=B), make_mirror()
    )
    kv = pool.get_new_blocks(5)
    pool.cache_full_blocks(a, kv, 0, 5, B, KV)
    state = pool.get_new_blocks(5)
    pool.cache_full_blocks(a, state, 0, 5, B, STATE, block_mask=[i == 4 for i in range(5)])
    pool.free_blocks(reversed(state[:-1]))
    pool.free_blocks(reversed(kv + state[-1:]))
    pool.hy_check_integrity()
    assert all(pool.get_cached_block(h, [KV]) for h in a.block_hashes)  # a hits itself
    assert pool.get_cached_block(a.block_hashes[4], [STATE])
    for other in (b, plain):
        assert not any(pool.get_cached_block(h, [KV]) for h in other.block_hashes)
        assert not any(pool.get_cached_block(h, [STATE]) for h in other.block_hashes)
