"""The router's decision (core/router.py): oracle cases a wrong score, tie-break, session or
fallback rule fails."""

import logging
import random

import pytest

from vllm_hybrid.core import (
    CostModel,
    ReplicaLoad,
    ReplicaView,
    StateRouter,
    load_shape,
    power_of_two,
)
from vllm_hybrid.core.router import FALLBACK, OVERLOAD, SCORE, SESSION

COST = CostModel(load_shape("marconi-7b"), 512)
X = 4e14
IDLE = ReplicaLoad()


def view(r: int, hit: int | None, kv: int = 0, load: ReplicaLoad = IDLE) -> ReplicaView:
    return ReplicaView(r, load, hit, kv)


def queued(seconds: float) -> ReplicaLoad:
    return ReplicaLoad(
        queued_requests=1, queued_prefill_tokens=1000, queued_prefill_flops=seconds * X
    )


def test_picks_the_replica_holding_the_state() -> None:
    router = StateRouter(COST, X)
    d = router.choose(8000, [view(0, 0), view(1, 4096, 4096), view(2, 512, 512)])
    assert (d.replica, d.reason, d.hit_tokens) == (1, SCORE, 4096)
    assert d.ttft_s == pytest.approx(COST.span_flops(4096, 8000) / X)


def test_long_kv_without_a_state_is_not_preferred() -> None:
    """Replica 0 holds the KV of 7,680 tokens but no state on it; replica 1 a state at 2,048."""
    router = StateRouter(COST, X)
    assert router.choose(8000, [view(0, 0, 7680), view(1, 2048, 2048)]).replica == 1


def test_kv_breaks_ties_between_equal_hits() -> None:
    router = StateRouter(COST, X)
    assert router.choose(8000, [view(0, 1024, 1024), view(1, 1024, 6144)]).replica == 1


def test_queue_ahead_outweighs_a_hit_in_seconds() -> None:
    """The hit on replica 1 saves 4,096 tokens of prefill (~0.14 s), its queue costs 5 s."""
    router = StateRouter(COST, X)
    loaded = view(1, 4096, 4096, queued(5.0))
    d = router.choose(8000, [view(0, 0), loaded])
    assert d.replica == 0
    assert router.estimate_ttft(8000, loaded) == pytest.approx(
        5.0 + COST.span_flops(4096, 8000) / X
    )
    # a short queue does not outweigh it
    assert router.choose(8000, [view(0, 0), view(1, 4096, 4096, queued(0.01))]).replica == 1


def test_sessions_follow_their_replica_unless_it_is_overloaded(caplog) -> None:
    router = StateRouter(COST, X, overload_wait_s=2.0)
    assert router.choose(3000, [view(0, 0), view(1, 0)], session="s").replica in (0, 1)
    home = router.sessions["s"]
    other = 1 - home
    # the other replica looks a little better (a deeper hit, 1 s of queue at home): stays
    views = [None, None]
    views[home] = view(home, 2048, 2048, queued(1.0))
    views[other] = view(other, 2560, 2560)
    d = router.choose(6000, views, session="s")
    assert (d.replica, d.reason) == (home, SESSION)
    # home's queue is 3 s longer than the shortest (> 2 s): overloaded, moved and logged
    views[home] = view(home, 2048, 2048, queued(3.0))
    with caplog.at_level(logging.INFO, logger="vllm_hybrid.router"):
        d = router.choose(6000, views, session="s")
    assert (d.replica, d.reason) == (other, OVERLOAD)
    assert router.overloads == [("s", home, other)]
    assert "overloaded" in caplog.text
    assert router.sessions["s"] == other  # the session now follows its new state
    assert router.counts[OVERLOAD] == 1


def test_an_overloaded_home_with_the_best_estimate_is_kept() -> None:
    """A long queue at home moves the session only if another replica is estimated faster."""
    router = StateRouter(COST, X, overload_wait_s=0.5)
    router.sessions["s"] = 0
    d = router.choose(60000, [view(0, 59904, 59904, queued(1.0)), view(1, 0)], session="s")
    assert (d.replica, d.reason) == (0, SESSION)


def test_a_gone_replica_is_forgotten() -> None:
    router = StateRouter(COST, X)
    router.sessions.update(a=3, b=1)
    router.forget_replica(3)
    assert router.sessions == {"b": 1}
    d = router.choose(3000, [view(0, 0), view(1, 1024)], session="a")
    assert (d.replica, d.reason) == (1, SCORE)


def test_power_of_two_fallback_without_any_index() -> None:
    router = StateRouter(COST, X, seed=3)
    d = router.choose(3000, [view(0, None, load=queued(4.0)), view(1, None)])
    assert (d.replica, d.reason, d.ttft_s) == (1, FALLBACK, None)
    # a stale replica counts as holding nothing, the others are scored
    d = router.choose(3000, [view(0, None), view(1, 2048, 2048)])
    assert (d.replica, d.reason) == (1, SCORE)


def test_power_of_two_counts_ongoing_requests() -> None:
    busy = ReplicaLoad(queued_requests=2, running=3)
    light = ReplicaLoad(running=1)
    for seed in range(20):
        assert (
            power_of_two([view(0, None, load=busy), view(1, None, load=light)], random.Random(seed))
            == 1
        )
    picks = {power_of_two([view(r, None) for r in range(8)], random.Random(s)) for s in range(50)}
    assert len(picks) > 4  # two random candidates, not always the same replica


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="throughput"):
        StateRouter(COST, 0)
    router = StateRouter(COST, X)
    with pytest.raises(ValueError, match="no replica"):
        router.choose(100, [])
    with pytest.raises(ValueError, match="prompt_tokens"):
        router.choose(0, [view(0, 0)])
