"""The cluster simulation (sim/cluster.py, sim/routers.py) and its CLI."""

import pytest

from vllm_hybrid.core import POLICIES, CostModel, load_shape
from vllm_hybrid.sim.cli import main
from vllm_hybrid.sim.cluster import ClusterConfig, Replica, run_cluster, session_ids
from vllm_hybrid.sim.generators import gen_agent, gen_chat
from vllm_hybrid.sim.replay import replay
from vllm_hybrid.sim.routers import ROUTERS, make_router
from vllm_hybrid.sim.trace import KeyedRequest, SimRequest, load_mooncake

B = 128
COST = CostModel(load_shape("marconi-7b"), B)
X = 4e14
MOONCAKE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"


def keyed(reqs):
    return [KeyedRequest(r, B) for r in reqs]


def _fill(rep: Replica, kr: KeyedRequest, n_blocks: int, snapshots: set[int]) -> None:
    """Cache ``kr``'s first ``n_blocks`` blocks on ``rep``, states at the given block ends."""
    pool = rep.pool
    h = pool.lock(pool.root)
    for i in range(n_blocks):
        node = pool.insert_block(h, kr.keys[i])
        assert node is not None
        if i + 1 in snapshots:
            assert pool.admit_snapshot(h, node)
    pool.unlock(h)


def test_state_router_skips_kv_without_state_and_kv_prefix_does_not() -> None:
    """Replica 0 holds 12 blocks of the prompt's KV with no state on them; replica 1 holds 4
    blocks with a state at the 4th. ``state`` must pick 1, ``kv-prefix`` (states ignored) 0."""
    req = SimRequest(0.0, ((7, 16 * B),), 16 * B, 10)
    kr = KeyedRequest(req, B)
    cfg = ClusterConfig(2, int(1e12), "flop")
    reps = [Replica(0, COST, cfg), Replica(1, COST, cfg)]
    _fill(reps[0], kr, 12, set())
    _fill(reps[1], kr, 4, {4})
    views = [rep.view(kr, 0.0, True) for rep in reps]
    assert [(v.kv_tokens, v.hit_tokens) for v in views] == [(12 * B, 0), (4 * B, 4 * B)]
    state = make_router("state", 2, COST, X)
    kv = make_router("kv-prefix", 2, COST, X)
    prompt_keys = kr.keys[:16]
    assert state.route(prompt_keys, req.prompt_tokens, None, views) == 1
    assert kv.route(prompt_keys, req.prompt_tokens, None, views) == 0
    for rep in reps:  # the views were queries: nothing changed
        rep.pool.check_integrity()
        assert rep.pool.match(kr.keys, 16 * B - 1).hit_tokens == views[rep.rid].hit_tokens


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("policy", ["flop", "vllm"])
def test_every_router_keeps_every_replica_sound(router: str, policy: str) -> None:
    reqs = keyed(gen_agent(n_sessions=12, seed=1))
    budget = int(0.05e9)
    cfg = ClusterConfig(3, budget, policy)
    stats, reps, _ = run_cluster(reqs, COST, cfg, router, check_every=7)
    for rep in reps:
        rep.pool.check_integrity()
        assert rep.pool.peak_bytes <= budget
        assert rep.pool.used_bytes <= budget
    assert sum(stats.requests_per_replica) == stats.requests == len(reqs)
    assert stats.prompt_tokens == sum(r.req.prompt_tokens for r in reqs)
    assert 0 <= stats.hit_tokens <= stats.prompt_tokens
    assert sum(rep.stats.hit_tokens for rep in reps) == stats.hit_tokens
    assert len(stats.ttft_s) == len(reqs) and min(stats.ttft_s) > 0
    assert stats.imbalance >= 1.0
    assert stats.session_requests == len(reqs) - 12  # every later step of the 12 sessions


def test_one_replica_is_the_single_engine_replay() -> None:
    """N = 1: the cluster's hits are the replay's, request for request totals."""
    reqs = keyed(gen_chat(n_sessions=40, seed=2))
    budget = int(0.2e9)
    for policy in ("flop", "vllm"):
        stats, _, _ = run_cluster(reqs, COST, ClusterConfig(1, budget, policy), "state")
        single = replay(reqs, COST, POLICIES[policy](COST), budget)
        assert (stats.hit_tokens, stats.flops_saved) == (single.hit_tokens, single.flops_saved)
        assert stats.ttft_s == single.ttft_s  # one service model (sim/service.py)


def test_fifo_prefill_times() -> None:
    """Two requests at once on one replica, no hits: the second waits for the first."""
    a = SimRequest(1000.0, ((1, 1000),), 1000, 5)
    b = SimRequest(1000.0, ((2, 3000),), 3000, 5)
    c = SimRequest(60000.0, ((3, 500),), 500, 5)
    stats, reps, _ = run_cluster(keyed([a, b, c]), COST, ClusterConfig(1, int(1e12)), "state")
    fa, fb, fc = (COST.span_flops(0, n) / X for n in (1000, 3000, 500))
    assert stats.ttft_s == pytest.approx([fa, fa + fb, fc])
    assert reps[0].prefill.busy_s == pytest.approx(fa + fb + fc)


def _moves(reqs, stats):
    """(session, from, to) for each later turn not on its previous turn's replica."""
    last, moves = {}, []
    for sid, r in zip(session_ids(reqs), stats.assignments, strict=True):
        if sid in last and last[sid] != r:
            moves.append((sid, last[sid], r))
        last[sid] = r
    return moves


@pytest.mark.parametrize("throughput, overloads", [(X, False), (3e12, True)])
def test_sessions_follow_their_state_unless_overloaded(throughput, overloads) -> None:
    """gen:chat on 4 replicas: every later turn lands on the replica of its previous turn
    unless an overload decision was logged for it; at 3 TFLOP/s the queues grow long enough
    that some are (each move is one logged decision, in order)."""
    reqs = sorted(gen_chat(n_sessions=60, seed=3), key=lambda r: r.arrival_ms)
    cfg = ClusterConfig(4, int(0.3e9), throughput_flops=throughput, overload_wait_s=1.0)
    stats, _, router = run_cluster(keyed(reqs), COST, cfg, "state")
    core = router.core  # type: ignore[attr-defined]
    assert core.counts["session"] + core.counts["overload"] == stats.session_requests > 0
    assert _moves(reqs, stats) == core.overloads
    assert bool(core.overloads) == overloads


def test_session_ids() -> None:
    chat = gen_chat(n_sessions=5, seed=0)
    sids = session_ids(chat)
    assert len(set(sids)) == 5
    first = {}
    for r, s in zip(chat, sids, strict=True):
        first.setdefault(s, r)
        assert r.segments[:2] == first[s].segments[:2]  # the same system prompt and opening
    assert set(session_ids(load_mooncake(MOONCAKE, 50))) == {None}


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="replicas"):
        ClusterConfig(0, 100)
    with pytest.raises(ValueError, match="unknown policy"):
        ClusterConfig(2, 100, "nope")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--replicas", "0"], "--replicas needs integers >= 1"),
        (["--replicas", "two"], "--replicas must be comma-separated integers"),
        (["--replicas", "2", "--router", "state,magic"], "unknown router 'magic'; known: "),
        (["--router", "state"], "--router needs --replicas"),
        (["--replicas", "2", "--throughput-tflops", "0"], "--throughput-tflops must be > 0"),
        (["--throughput-tflops", "-1"], "--throughput-tflops must be > 0"),
    ],
)
def test_cli_errors(argv, message, capsys) -> None:
    assert main(["simulate", "--trace", "gen:chat", "--limit", "5", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "unknown router" in message:
        assert ", ".join(ROUTERS) in err


def test_cli_runs_a_small_cluster(tmp_path, capsys) -> None:
    out = tmp_path / "c.json"
    argv = ["simulate", "--trace", "gen:chat", "--limit", "60", "--model", "marconi-7b"]
    argv += ["--budget-gb", "0.1", "--block-tokens", "128", "--replicas", "1,3"]
    argv += ["--router", "round-robin,state", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "round-robin" in text and "state" in text and "TTFT p50" in text
    import json

    rows = json.loads(out.read_text())["rows"]
    assert {(r["replicas"], r["router"]) for r in rows} == {
        (n, r) for n in (1, 3) for r in ("round-robin", "state")
    }
    one = [r for r in rows if r["replicas"] == 1]
    assert one[0]["hit_tokens"] == one[1]["hit_tokens"]  # one replica: the router is moot
