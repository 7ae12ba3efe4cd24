"""The live router's bookkeeping without Ray or vLLM (``cluster/routing.py``): digests and
speculative entries give each replica's state-bearing hit, turns follow their state, a dead
replica's entries are never used, mis-seeded digests are refused, the baselines run."""

from __future__ import annotations

import hashlib

import pytest

from vllm_hybrid.cluster.routing import ClusterRouter, RouteRequest
from vllm_hybrid.core import CostModel
from vllm_hybrid.core.shapes import load_shape

HBS, BLOCK = 1, 16


def fake_hasher(ids, salt, hbs, algo):
    keys, h = [], hashlib.sha256(repr(salt).encode()).digest()
    for i in range(hbs, len(ids) + 1, hbs):
        h = hashlib.sha256(h + repr(tuple(ids[i - hbs : i])).encode()).digest()
        keys.append(int.from_bytes(h[:8], "little"))
    return keys


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make(policy="state", **kw):
    clock = Clock()
    router = ClusterRouter(
        policy=policy,
        cost=CostModel(load_shape("zamba2-2.7b"), BLOCK),
        throughput_flops=5e10,
        hasher=fake_hasher,
        local_none_hash=lambda algo: "seed",
        clock=clock,
        **kw,
    )
    return router, clock


def digest(clock, states=(), kv=(), none_hash="seed", taken_at=None):
    return {
        "taken_at": clock.t if taken_at is None else taken_at,
        "hash_block_size": HBS,
        "block_size": BLOCK,
        "hash_algo": "sha256",
        "none_hash": none_hash,
        "states": sorted(states),
        "kv": sorted(kv),
        "free_pages": 100,
    }


PROMPT = tuple(range(100, 200))


def test_state_hit_beats_a_longer_kv_match():
    router, clock = make()
    keys = fake_hasher(PROMPT, None, HBS, "sha256")
    # a: state at 40 tokens; b: KV for 96 tokens (every block) and no state
    router.update_digest("a", digest(clock, states=[keys[39]]))
    router.update_digest("b", digest(clock, kv=[keys[i] for i in range(15, 96, 16)]))
    assert router.hits(RouteRequest("q", PROMPT), "a") == (40, 0)
    assert router.hits(RouteRequest("q", PROMPT), "b") == (0, 96)
    assert router.choose(RouteRequest("q", PROMPT), ["a", "b"]).replica == "a"


def test_salt_separates_tenants():
    router, clock = make()
    keys = fake_hasher(PROMPT, "t0", HBS, "sha256")
    router.update_digest("a", digest(clock, states=[keys[49]]))
    router.update_digest("b", digest(clock))
    assert router.hits(RouteRequest("q", PROMPT, "t0"), "a")[0] == 50
    assert router.hits(RouteRequest("q", PROMPT, "t1"), "a")[0] == 0


def test_next_turn_follows_the_speculative_state_before_any_digest_has_it():
    router, clock = make()
    router.update_digest("a", digest(clock))
    router.update_digest("b", digest(clock))
    first = router.choose(RouteRequest("t1", PROMPT, session="s"), ["a", "b"])
    router.completed("t1")
    turn2 = PROMPT + tuple(range(300, 340))
    assert router.hits(RouteRequest("t2", turn2), first.replica)[0] == len(PROMPT)
    second = router.choose(RouteRequest("t2", turn2, session="s"), ["a", "b"])
    assert second.replica == first.replica and second.hit_tokens == len(PROMPT)
    # without a session the score alone finds it too
    other, _ = make()
    other.update_digest("a", digest(clock))
    other.update_digest("b", digest(clock))
    r1 = other.choose(RouteRequest("u1", PROMPT), ["a", "b"])
    other.completed("u1")
    assert other.choose(RouteRequest("u2", turn2), ["a", "b"]).replica == r1.replica


def test_a_digest_after_completion_replaces_the_speculative_entries():
    router, clock = make()
    router.update_digest("a", digest(clock))
    router.choose(RouteRequest("t1", PROMPT), ["a"])
    clock.t += 1
    router.update_digest("a", digest(clock))  # taken before completion: entries kept
    assert router.hits(RouteRequest("x", PROMPT), "a")[0] == len(PROMPT) - 1
    router.completed("t1")
    clock.t += 1
    router.update_digest("a", digest(clock))  # after: authoritative (the state was evicted)
    assert router.hits(RouteRequest("x", PROMPT), "a")[0] == 0
    assert router.digest_ages and router.state()["digest_age_s"]["n"] == 3


def test_a_dead_replica_is_forgotten_and_never_chosen():
    router, clock = make()
    keys = fake_hasher(PROMPT, None, HBS, "sha256")
    router.update_digest("a", digest(clock, states=[keys[89]]))
    router.update_digest("b", digest(clock))
    first = router.choose(RouteRequest("t1", PROMPT, session="s"), ["a", "b"])
    assert first.replica == "a"
    gone = router.sync_replicas(["b"])
    assert gone == ["a"]
    assert "a" not in router.digests and "a" not in router.speculative
    assert all(f.replica != "a" for f in router.inflight.values())
    assert router.hits(RouteRequest("q", PROMPT), "a") == (None, 0)
    again = router.choose(RouteRequest("t2", PROMPT + (1, 2, 3), session="s"), ["b"])
    assert again.replica == "b"
    # a digest arriving late from the dead replica is stored but only live replicas are scored
    router.update_digest("a", digest(clock, states=keys))
    assert router.choose(RouteRequest("t3", PROMPT), ["b"]).replica == "b"
    router.sync_replicas(["b"])
    assert "a" not in router.digests


def test_differently_seeded_hashes_are_refused_with_the_fix():
    router, clock = make()
    router.update_digest("a", digest(clock, none_hash="other"))
    assert "a" not in router.digests
    assert "PYTHONHASHSEED" in router.warnings[0]


def test_no_digest_anywhere_falls_back_to_power_of_two():
    router, _ = make()
    record = router.choose(RouteRequest("q", PROMPT), ["a", "b"])
    assert record.reason == "fallback"


def test_overloaded_home_moves_the_session_and_logs_it():
    router, clock = make(overload_wait_s=0.0)
    keys = fake_hasher(PROMPT, None, HBS, "sha256")
    router.update_digest("a", digest(clock, states=[keys[10]]))
    router.update_digest("b", digest(clock))
    assert router.choose(RouteRequest("t1", PROMPT, session="s"), ["a", "b"]).replica == "a"
    for i in range(20):  # a's queue grows with other work
        router.choose(RouteRequest(f"x{i}", tuple(range(5000, 5400)), session=f"o{i}"), ["a"])
    moved = router.choose(RouteRequest("t2", PROMPT + (7,), session="s"), ["a", "b"])
    assert moved.replica == "b" and moved.reason == "overload"
    assert router.core.overloads


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "text-prefix", "kv-prefix"])
def test_baselines_route_and_rebuild_on_a_new_replica_set(policy):
    router, clock = make(policy)
    router.update_digest("a", digest(clock))
    router.update_digest("b", digest(clock))
    picks = [router.choose(RouteRequest(f"r{i}", PROMPT), ["a", "b"]).replica for i in range(4)]
    assert set(picks) <= {"a", "b"}
    if policy == "round-robin":
        assert picks[0] != picks[1]
    if policy == "text-prefix":
        assert len(set(picks)) == 1  # the same prompt follows its tree node
    router.sync_replicas(["b"])
    assert router.choose(RouteRequest("z", PROMPT), ["b"]).replica == "b"


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="known: round-robin"):
        make("nope")


def test_a_retracted_choice_leaves_no_credit():
    router, clock = make()
    router.update_digest("a", digest(clock))
    router.update_digest("b", digest(clock))
    first = router.choose(RouteRequest("t1", PROMPT), ["a", "b"])
    router.retract("t1")
    assert "t1" not in router.inflight
    assert router.hits(RouteRequest("x", PROMPT), first.replica)[0] == 0


def test_a_predicted_breakpoint_state_is_credited_for_the_next_conversation():
    router, clock = make()
    router.update_digest("a", digest(clock))
    router.update_digest("b", digest(clock))
    system = PROMPT[:60]
    first = router.choose(RouteRequest("c1", PROMPT, state_positions=(60,)), ["a", "b"])
    other = system + tuple(range(900, 950))  # another chat, same system prompt
    assert router.hits(RouteRequest("c2", other), first.replica)[0] == 60
    assert router.hits(RouteRequest("c2", other), "b" if first.replica == "a" else "a")[0] == 0
