"""The replay loop with requests in flight (``in_flight``, ``visible_after``, ``running_bytes``).

``in_flight=1`` must be the one-request-at-a-time loop, bit for bit; with more, the pages of the
requests in flight are held (never evicted, counted in the budget) and what they inserted is
hidden from the requests that overlap them until ``visible_after``.
"""

from __future__ import annotations

import pytest

from vllm_hybrid.bench.predict import PoolLayout, sim_requests
from vllm_hybrid.bench.workload import BenchRequest, build_workload, iter_source
from vllm_hybrid.core.policies import POLICIES
from vllm_hybrid.sim.replay import RunStats, replay
from vllm_hybrid.sim.trace import KeyedRequest

B = 16
PAGE = 4096
# A KV block is one page, a snapshot three.
LAYOUT = PoolLayout(64, B, PAGE, 1, 3, "zamba2")
COST = LAYOUT.cost_model()
A = list(range(100, 150))  # 3 full blocks + 2 tokens: a repeat hits 48 tokens
OTHER = list(range(300, 350))


def _keyed(prompts: list[list[int]], block_tokens: int = B) -> list[KeyedRequest]:
    reqs = [BenchRequest(i, float(i), tuple(ids), 4) for i, ids in enumerate(prompts)]
    return [KeyedRequest(r, block_tokens) for r in sim_requests(reqs, block_tokens)]


def _run(
    prompts: list[list[int]],
    pages: int = 64,
    policy: str = "vllm",
    hold_snapshots: bool = True,
    **kw: int,
) -> RunStats:
    policy_ = POLICIES[policy](COST)
    return replay(_keyed(prompts), COST, policy_, pages * PAGE, hold_snapshots=hold_snapshots, **kw)


def _stats(s: RunStats) -> dict[str, object]:
    out = s.to_dict()
    out.pop("seconds")
    return out


@pytest.fixture(scope="module")
def chat() -> list[KeyedRequest]:
    reqs = build_workload(iter_source("gen:chat", 0), 40, 0.25, 4096, 4)
    return [KeyedRequest(r, 128) for r in sim_requests(reqs, 128)]


def test_one_in_flight_is_the_old_loop(chat: list[KeyedRequest]) -> None:
    layout = PoolLayout(48, 128, 1572864, 1, 6, "zamba2")
    cost = layout.cost_model()
    budget = 48 * layout.page_bytes
    for name in ("vllm", "flop", "learned", "marconi", "sglang", "lru-dense"):
        old = _stats(replay(chat, cost, POLICIES[name](cost), budget))
        new = replay(chat, cost, POLICIES[name](cost), budget, in_flight=1, running_bytes=0)
        assert _stats(new) == old, name
    # Pinned from the loop before in_flight existed (commit 7a15e0b), for vLLM's own policy.
    stock = replay(chat, cost, POLICIES["vllm"](cost), budget, in_flight=1)
    assert (stock.hit_tokens, stock.prompt_tokens, stock.evicted_kv_blocks) == (15360, 26411, 49)
    assert stock.snapshots_taken == 28


def test_nothing_hidden_and_room_to_spare_is_the_old_loop(chat: list[KeyedRequest]) -> None:
    layout = PoolLayout(100_000, 128, 1572864, 1, 6, "zamba2")
    cost = layout.cost_model()
    budget = layout.blocks * layout.page_bytes
    for name in ("vllm", "flop"):
        old = replay(chat, cost, POLICIES[name](cost), budget)
        new = replay(chat, cost, POLICIES[name](cost), budget, in_flight=4, visible_after=1)
        assert old.evicted_kv_blocks == new.evicted_kv_blocks == 0
        assert (new.hit_tokens, new.snapshots_taken) == (old.hit_tokens, old.snapshots_taken)


def test_inserts_of_a_request_in_flight_are_hidden_from_its_overlap() -> None:
    assert _run([A, A]).hit_tokens == 48  # one at a time: the repeat hits
    assert _run([A, A], in_flight=2).hit_tokens == 48  # visible to the next request (default)
    assert _run([A, A], in_flight=2, visible_after=2).hit_tokens == 0  # hidden while in flight
    # Request 0 leaves the window when request 2 is admitted: request 2 sees it, request 1 not.
    assert _run([A, A, A], in_flight=2, visible_after=2).hit_tokens == 48
    assert _run([A, A, A], in_flight=3, visible_after=3).hit_tokens == 0
    assert _run([A, A, A, A], in_flight=3, visible_after=3).hit_tokens == 48
    for name in ("flop", "marconi"):  # the same for a policy that places its own snapshots
        assert _run([A, A], policy=name, in_flight=2, visible_after=2).hit_tokens == 0


def test_a_snapshot_added_by_a_request_in_flight_is_hidden_too() -> None:
    # Request 0 caches 4 blocks and its state at 64; request 1 (A, a prefix of them) adds a
    # state at 48 on a block request 0 created. Request 2 (A again) hits it only once request 1
    # is visible to it: the block is old enough, the snapshot is not.
    longer = A[:48] + list(range(500, 530))  # 4 full blocks + 14 tokens
    prompts = [longer, A, A]
    assert _run(prompts, in_flight=3, visible_after=1).hit_tokens == 48
    assert _run(prompts, in_flight=3, visible_after=2).hit_tokens == 0


def test_requests_in_flight_hold_their_pages() -> None:
    # 8 pages: A takes 6 (3 KV + a 3-page state), so OTHER can only be cached by evicting A.
    assert _run([A, OTHER, A], pages=8).hit_tokens == 0  # one at a time: A was evicted
    held = _run([A, OTHER, A], pages=8, in_flight=2)
    assert held.hit_tokens == 48  # A was held while OTHER ran: OTHER was not cached instead
    assert held.evicted_kv_blocks == 0


def test_without_hold_snapshots_a_state_in_flight_can_go_while_its_kv_stays() -> None:
    # vLLM's align mode: request 1 (A again, a hit at 48) still runs while OTHER is cached, but
    # it holds only A's KV; the state at 48 it hit is in the free queue. 10 pages: A's 3 KV +
    # state take 6, OTHER needs 6, so OTHER's state evicts A's (held: OTHER's is not kept).
    # Request 3 (A) then finds A's KV but no state: no hit, as in the engine.
    prompts = [A, A, OTHER, A]
    held = _run(prompts, pages=10, in_flight=3)
    assert held.hit_tokens == 96 and held.evicted_snapshots == 0
    freed = _run(prompts, pages=10, in_flight=3, hold_snapshots=False)
    assert freed.hit_tokens == 48
    assert freed.evicted_snapshots >= 1 and freed.evicted_kv_blocks == 0  # the KV is held
    # Nothing in flight, room to spare: the option changes nothing.
    assert _run(prompts, hold_snapshots=False).hit_tokens == _run(prompts).hit_tokens == 96


def test_the_budget_holds_without_hold_snapshots(chat: list[KeyedRequest]) -> None:
    layout = PoolLayout(48, 128, 1572864, 1, 6, "zamba2")
    cost = layout.cost_model()
    budget, running = 48 * layout.page_bytes, 7 * layout.page_bytes
    for name in ("vllm", "flop"):
        s = replay(
            chat,
            cost,
            POLICIES[name](cost),
            budget,
            in_flight=3,
            running_bytes=running,
            hold_snapshots=False,
            check_every=1,
        )
        assert s.peak_bytes <= budget - 3 * running and s.requests == len(chat)


def test_the_budget_holds_with_requests_in_flight(chat: list[KeyedRequest]) -> None:
    layout = PoolLayout(48, 128, 1572864, 1, 6, "zamba2")
    cost = layout.cost_model()
    budget = 48 * layout.page_bytes
    running = 7 * layout.page_bytes
    for name in ("vllm", "flop"):
        for n, v in ((2, 1), (4, 1), (4, 4)):
            s = replay(
                chat,
                cost,
                POLICIES[name](cost),
                budget,
                in_flight=n,
                visible_after=v,
                running_bytes=running,
                check_every=1,  # the index's invariants after every request
            )
            assert s.peak_bytes <= budget - n * running
            assert s.requests == len(chat) and s.budget_bytes == budget


def test_bad_window_arguments() -> None:
    with pytest.raises(ValueError, match="in_flight"):
        _run([A], in_flight=0)
    with pytest.raises(ValueError, match="visible_after"):
        _run([A], in_flight=2, visible_after=3)
    with pytest.raises(ValueError, match="running_bytes"):
        _run([A], pages=8, in_flight=3, running_bytes=3 * PAGE)


C = list(range(600, 650))


@pytest.mark.parametrize("policy", ["vllm", "flop"])
def test_lookahead_keeps_what_a_waiting_request_would_hit(policy: str) -> None:
    # 12 pages hold A and C (6 each); OTHER needs 6, so one of them goes. A is older: without
    # lookahead it goes and the last request (A) misses; with request 3 waiting while OTHER is
    # served, A's units are passed over and C goes instead (the engine's PrefixIndex.lookahead).
    prompts = [A, C, OTHER, A]
    assert _run(prompts, pages=12, policy=policy).hit_tokens == 0
    assert _run(prompts, pages=12, policy=policy, waiting=[0, 0, 0, 0]).hit_tokens == 0
    ahead = _run(prompts, pages=12, policy=policy, waiting=[3, 2, 1, 0])
    assert ahead.hit_tokens == 48
    # Only the waiting requests count: with request 3 not yet arrived when OTHER is served,
    # A goes as without lookahead.
    assert _run(prompts, pages=12, policy=policy, waiting=[1, 1, 0, 0]).hit_tokens == 0


def test_lookahead_wants_one_count_per_request() -> None:
    with pytest.raises(ValueError, match="waiting has 2 counts for 3 requests"):
        _run([A, C, A], waiting=[1, 0])


def test_the_policy_learns_of_a_request_once_its_blocks_are_cached() -> None:
    # The engine feeds a request to the policy after vLLM's allocate_slots cached its blocks
    # (HybridScheduler._hy_feed_started runs after Scheduler.schedule); the simulator does the
    # same, so what the policy learns (e.g. flop's branch-point counts) is the engine's.
    # Request 1 hits A's state at 48 and continues with a block of its own: when the policy
    # hears of it, that block is already the hit node's child.
    seen: list[tuple[int, int]] = []

    class Recording(POLICIES["flop"]):  # type: ignore[misc, valid-type]
        def observe(self, ctx, hit_node):  # type: ignore[no-untyped-def]
            seen.append((ctx.hit_tokens, hit_node.n_children))
            super().observe(ctx, hit_node)

    prompts = [A, A[:48] + list(range(700, 730))]
    replay(_keyed(prompts), COST, Recording(COST), 64 * PAGE)
    assert seen == [(0, 1), (48, 1)]


@pytest.mark.parametrize("in_flight", [1, 3])
def test_vllm_queue_keeps_its_invariants(chat: list[KeyedRequest], in_flight: int) -> None:
    """vLLM's free queue (``vllm_queue``, the ``stock`` row's pool) under eviction: the pool's
    and the index's invariants after every request (P4: every free page is queued once, no
    page in use is, orphan bytes add up), the budget kept, pages evicted one at a time (stale
    copies and a snapshot's leftover pages among them), and hits only where vLLM's align mode
    keeps states (the replay boundary, junctions)."""
    layout = PoolLayout(40, 128, 1572864, 1, 6, "zamba2")
    cost = layout.cost_model()
    hits: list[int] = []
    stats = replay(
        chat,
        cost,
        POLICIES["vllm"](cost),
        39 * layout.page_bytes,
        in_flight=in_flight,
        running_bytes=7 * layout.page_bytes,
        hold_snapshots=False,
        check_every=1,
        vllm_queue=6,
        hits_out=hits,
    )
    assert len(hits) == len(chat) and sum(hits) == stats.hit_tokens > 0
    assert stats.evicted_kv_blocks > 0 and stats.evicted_snapshots > 0
    assert all(h % 128 == 0 for h in hits)
