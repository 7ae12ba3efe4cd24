"""Simulated hit lengths equal a brute-force reference on small random traces.

The reference keeps, per cached entry, the token prefix it stands for (mirrored from what each
request left and what the index reports as evicted) and finds the longest cached snapshot that is
a prefix of the prompt by comparing tokens, with no trie and no hashing. With a host tier, a
snapshot on the host counts as cached (the reference does not care which tier holds it), and
both budgets are checked after every request.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.host_tier import HostTier
from vllm_hybrid.core.index import PrefixIndex
from vllm_hybrid.core.layers import AttentionLayers, Mamba2Layers
from vllm_hybrid.core.policies import POLICIES, InfinitePolicy
from vllm_hybrid.core.policy import AdmitContext
from vllm_hybrid.core.shapes import ModelShape
from vllm_hybrid.sim import replay as rp
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


def _brute_hit(mirror, tokens, max_tokens):
    best_snap = best_kv = 0
    for prefix, snap in mirror.values():
        n = len(prefix)
        if n <= max_tokens and tuple(tokens[:n]) == prefix:
            if snap:
                best_snap = max(best_snap, n)
            if n % B == 0:
                best_kv = max(best_kv, n)
    return best_snap, best_kv


def _run(trace, policy, budget, host_budget=0):
    host = HostTier(host_budget, 4e14) if host_budget else None  # 1 FLOP per byte moved
    index = PrefixIndex(
        block_tokens=B,
        kv_bytes_per_token=1,
        snapshot_bytes=2,
        budget_bytes=budget,
        policy=policy,
        record_evictions=True,
        host=host,
    )
    mirror = {}
    for t, (content, prompt) in enumerate(trace):
        req = SimRequest(float(t), tuple((tok, 1) for tok in content), prompt, 0, True)
        kr = KeyedRequest(req, B)
        m = index.match(kr.keys, prompt - 1, kr.probe)
        assert (m.hit_tokens, m.kv_tokens) == _brute_hit(mirror, content, prompt - 1)
        h = index.lock(m.kv_nodes[-1] if m.kv_nodes else index.root)
        index.touch(m, t)
        on_host = index.on_host(m.hit_node)
        assert index.promote(m, t) == on_host
        if on_host:
            assert m.hit_node.has_snapshot or index.on_host(m.hit_node)  # kept on one tier
        ctx = AdmitContext(
            t, prompt, len(content), m.hit_tokens, m.kv_tokens, False, B, True, kr.key_at
        )
        rp._commit(index, kr, m, h, policy.snapshot_positions(ctx), t)
        index.unlock(h)
        ev = index.pop_evictions()
        for key in ev.kv_keys:
            mirror.pop(key, None)
        for key in ev.snapshot_keys:
            if key in mirror:
                mirror[key] = (mirror[key][0], False)
        for pos in range(1, len(content) + 1):
            key = kr.key_at(pos)
            node = index.get(key) if key is not None else None
            if node is not None:
                mirror[key] = (tuple(content[:pos]), node.has_snapshot or index.on_host(node))
        if host is not None:  # the eviction log reports device frees: demoted states stay
            for key, (prefix, _) in list(mirror.items()):  # usable, dropped host ones do not
                node = index.get(key)
                if node is not None:
                    mirror[key] = (prefix, node.has_snapshot or index.on_host(node))
        index.check_integrity()
        assert index.used_bytes <= budget
        if host is not None:
            assert host.used_bytes <= host_budget


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


@settings(max_examples=60, deadline=None)
@given(trace=traces())
def test_hits_equal_bruteforce_unbounded(trace) -> None:
    _run(trace, InfinitePolicy(COST), 10**9)


def test_reference_sees_a_real_hit() -> None:
    # turn 2 extends turn 1: with dense snapshots, it resumes at turn 1's exact end (7 tokens).
    trace = [((1, 2, 3, 4, 5, 6, 7), 7), ((1, 2, 3, 4, 5, 6, 7, 8, 9), 9)]
    mirror_hits = []
    index = PrefixIndex(
        block_tokens=B,
        kv_bytes_per_token=1,
        snapshot_bytes=2,
        budget_bytes=10**6,
        policy=InfinitePolicy(COST),
    )
    for t, (content, prompt) in enumerate(trace):
        kr = KeyedRequest(SimRequest(0.0, tuple((x, 1) for x in content), prompt, 0), B)
        m = index.match(kr.keys, prompt - 1, kr.probe)
        mirror_hits.append(m.hit_tokens)
        h = index.lock(m.kv_nodes[-1] if m.kv_nodes else index.root)
        ctx = AdmitContext(
            t, prompt, len(content), m.hit_tokens, m.kv_tokens, False, B, True, kr.key_at
        )
        rp._commit(index, kr, m, h, InfinitePolicy(COST).snapshot_positions(ctx), t)
        index.unlock(h)
    assert mirror_hits == [0, 7]
