"""Simulated hit lengths equal a brute-force reference on small random traces.

The reference keeps, per key a request created, the token prefix it stands for, asks the pool
only which keys still hold a page (KV, state, or a state on the host tier), and finds the longest
cached snapshot that is a prefix of the prompt by comparing tokens, with no trie and no hashing.
With a host tier, a snapshot on the host counts as cached (the reference does not care which tier
holds it), and both budgets are checked after every request.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.layers import AttentionLayers, Mamba2Layers
from vllm_hybrid.core.policies import POLICIES, InfinitePolicy, SglangPolicy
from vllm_hybrid.core.policy import AdmitContext
from vllm_hybrid.core.shapes import ModelShape
from vllm_hybrid.sim import replay as rp
from vllm_hybrid.sim.pool import KV_GROUP, STATE_GROUP, SimPool
from vllm_hybrid.sim.trace import KeyedRequest, SimRequest

B = 3
COST = CostModel(
    ModelShape(
        "tiny",
        (
            AttentionLayers(1, 1, 1, 1, 1, 1, kv_dtype_bytes=1),
            Mamba2Layers(1, 1, 1, 1, 1, 1, conv_kernel=2, state_dtype_bytes=1),
        ),
    ),
    B,
)

PREFIXES = [(1, 2, 3, 4, 5, 6, 7), (1, 2, 3, 9, 9), (4, 4, 4, 4, 4, 4, 4, 4, 4)]


@st.composite
def traces(draw):
    reqs = []
    for _ in range(draw(st.integers(1, 14))):
        base = list(PREFIXES[draw(st.integers(0, 2))])
        if reqs and draw(st.booleans()):
            base = list(reqs[draw(st.integers(0, len(reqs) - 1))][0])  # a later turn
        base = base[: draw(st.integers(1, len(base)))]
        tokens = base + draw(st.lists(st.integers(0, 4), max_size=6))
        out = draw(st.integers(0, 4))
        reqs.append((tuple(tokens) + tuple(range(50, 50 + out)), len(tokens)))
    return reqs


def _brute_hit(pool, prefixes, tokens, max_tokens):
    """(longest cached snapshot, longest cached KV) that are prefixes of ``tokens``: by token
    comparison over every key ever created, cached = the pool holds its page."""
    best_snap = best_kv = 0
    kv, states = pool._pages[KV_GROUP], pool._pages[STATE_GROUP]
    for key, prefix in prefixes.items():
        n = len(prefix)
        if key not in kv or n > max_tokens or tuple(tokens[:n]) != prefix:
            continue
        node = pool.node_of(key)
        if key in states or pool.on_host(node):
            best_snap = max(best_snap, n)
        if n % B == 0:
            best_kv = max(best_kv, n)
    return best_snap, best_kv


def _run(trace, policy, budget, host_budget=0):
    pool = SimPool(
        block_tokens=B,
        kv_bytes_per_token=1,
        snapshot_bytes=2,
        budget_bytes=budget,
        policy=policy,
        host_bytes=host_budget,
        host_bandwidth=4e14,  # 1 FLOP per byte moved
    )
    prefixes = {}
    for t, (content, prompt) in enumerate(trace):
        req = SimRequest(float(t), tuple((tok, 1) for tok in content), prompt, 0, True)
        kr = KeyedRequest(req, B)
        pool.now = t
        m = pool.match(kr.keys, prompt - 1, kr.probe)
        assert (m.hit_tokens, m.kv_tokens) == _brute_hit(pool, prefixes, content, prompt - 1)
        h = pool.lock(m.kv_nodes[-1] if m.kv_nodes else pool.root)
        pool.touch(h, m)
        on_host = pool.on_host(m.hit_node)
        assert pool.promote(h, m) == on_host
        if on_host:
            assert m.hit_node.has_snapshot or pool.on_host(m.hit_node)  # kept on one tier
        ctx = AdmitContext(
            t, prompt, len(content), m.hit_tokens, m.kv_tokens, False, B, True, kr.key_at
        )
        positions = policy.snapshot_positions(ctx)
        kv_end = getattr(policy, "kv_end_tokens", None)
        cut = None if kv_end is None else kv_end(ctx, positions)
        rp._commit(pool, kr, m, h, positions, t, None, cut)
        pool.unlock(h)
        for pos in range(1, len(content) + 1):
            key = kr.key_at(pos)
            if key is not None:
                prefixes[key] = tuple(content[:pos])
        pool.check_integrity()
        assert pool.used_bytes <= budget
        if pool.host is not None:
            assert pool.host.tier.used_bytes <= host_budget


@settings(max_examples=120, deadline=None)
@given(trace=traces(), name=st.sampled_from(sorted(POLICIES)), budget=st.integers(0, 60))
def test_hits_equal_bruteforce(trace, name, budget) -> None:
    _run(trace, POLICIES[name](COST), budget)


@settings(max_examples=120, deadline=None)
@given(
    trace=traces(),
    name=st.sampled_from(sorted(POLICIES)),
    budget=st.integers(0, 40),
    host_budget=st.integers(1, 12),
)
def test_hits_equal_bruteforce_with_host_tier(trace, name, budget, host_budget) -> None:
    _run(trace, POLICIES[name](COST), budget, host_budget)


@settings(max_examples=120, deadline=None)
@given(trace=traces(), budget=st.integers(0, 60), chunk=st.sampled_from([3, 6, 9]))
def test_hits_equal_bruteforce_sglang_on_a_block_grid(trace, budget, chunk) -> None:
    """``sglang`` with its grid at the block (SGLang's default grid of 64 never fires on these
    short traces): chunk and decode-track states, the KV cut at the last one."""
    _run(trace, SglangPolicy(COST, chunk, B, 2 * B), budget)


@settings(max_examples=60, deadline=None)
@given(trace=traces())
def test_hits_equal_bruteforce_unbounded(trace) -> None:
    _run(trace, InfinitePolicy(COST), 10**9)


def test_reference_sees_a_real_hit() -> None:
    # turn 2 extends turn 1: with dense snapshots, it resumes at turn 1's exact end (7 tokens).
    trace = [((1, 2, 3, 4, 5, 6, 7), 7), ((1, 2, 3, 4, 5, 6, 7, 8, 9), 9)]
    mirror_hits = []
    pool = SimPool(
        block_tokens=B,
        kv_bytes_per_token=1,
        snapshot_bytes=2,
        budget_bytes=10**6,
        policy=InfinitePolicy(COST),
    )
    for t, (content, prompt) in enumerate(trace):
        kr = KeyedRequest(SimRequest(0.0, tuple((x, 1) for x in content), prompt, 0), B)
        m = pool.match(kr.keys, prompt - 1, kr.probe)
        mirror_hits.append(m.hit_tokens)
        h = pool.lock(m.kv_nodes[-1] if m.kv_nodes else pool.root)
        ctx = AdmitContext(
            t, prompt, len(content), m.hit_tokens, m.kv_tokens, False, B, True, kr.key_at
        )
        rp._commit(pool, kr, m, h, InfinitePolicy(COST).snapshot_positions(ctx), t)
        pool.unlock(h)
    assert mirror_hits == [0, 7]
