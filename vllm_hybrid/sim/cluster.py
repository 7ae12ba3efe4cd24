"""The cluster simulation: N replicas, each its own page pool under the one index, a router.

``vllm-hybrid simulate --replicas N --router R`` (docs/cluster.md). Each replica is a
:class:`~vllm_hybrid.sim.pool.SimPool` with its own byte budget and its own policy object
(``flop``, or stock ``vllm`` as the second axis), served by the single-engine replay's step
(``sim/replay.py``): match, lock, admit snapshots, insert, observe, unlock.

The service model (time in seconds, requests overlap):

* arrivals are the trace's (``arrival_ms``), in order; the router decides at arrival, from
  each replica's index (queried read-only: ``PrefixIndex.match`` changes nothing) and load;
* a replica runs prefills one at a time, first in first out (``sim/service.py``): a request
  starts at ``max(arrival, previous prefill's end)`` and its prefill takes ``span_flops(hit,
  prompt) / throughput`` (the stated device FLOP/s); TTFT = its prefill's end - arrival;
* decode is batched and overlaps the prefills (as chunked prefill mixes them): a request
  decodes ``output_tokens * decode_s_per_token`` after its prefill, taking no prefill time; it
  counts as running (and its KV as active) until then;
* a replica's cache is updated when the request is routed: its lookup and inserts run then, in
  routing order, which is the order its FIFO queue starts them, so the hit is the one the
  serial order gives. Simplifications: the router sees the blocks of requests still queued
  (as a router's speculative insert at routing time would); pages of running requests are not
  held past their lookup (the replay's default, ``in_flight=1``); an output's KV and state
  (where a later turn extends it) are there before the decode has produced them.
* busy time of a replica = the sum of its prefill times; load imbalance = max / mean.

Sessions: a request whose content extends a previous request's whole content (prompt +
output, the generated chat and agent workloads' later turns) belongs to that request's
session; the Mooncake trace has no such requests (its outputs are not part of later prompts),
so there no session is known.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from vllm_hybrid.core import POLICIES, CostModel, EngineAdmission, ReplicaLoad, ReplicaView
from vllm_hybrid.sim.pool import SimPool
from vllm_hybrid.sim.replay import BudgetViolation, RunStats, _Run, _serve
from vllm_hybrid.sim.routers import Router, StateAwareRouter, make_router
from vllm_hybrid.sim.service import DEFAULT_DECODE_S, DEFAULT_THROUGHPUT, PrefillQueue, quantile
from vllm_hybrid.sim.trace import KeyedRequest, SimRequest


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int
    budget_bytes: int  # per replica
    policy: str = "flop"
    throughput_flops: float = DEFAULT_THROUGHPUT
    decode_s_per_token: float = DEFAULT_DECODE_S
    overload_wait_s: float = 2.0
    seed: int = 0
    #: snapshots where the engine takes them (``core.EngineAdmission``: vLLM's align mode),
    #: not where the policy would: how ``bench replay --replicas`` predicts a live cluster
    engine_admission: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if not self.throughput_flops > 0 or self.decode_s_per_token < 0:
            raise ValueError("throughput must be > 0 and the decode time >= 0")
        if self.budget_bytes <= 0:
            raise ValueError(f"the per-replica budget must be > 0, got {self.budget_bytes}")


@dataclass
class ClusterStats:
    """One (router, policy, N, budget) run; rates and percentiles are properties."""

    router: str
    policy: str
    replicas: int
    budget_bytes: int
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    flops_total: float = 0.0
    flops_saved: float = 0.0
    ttft_s: list[float] = field(default_factory=list, repr=False)
    busy_s: list[float] = field(default_factory=list)
    requests_per_replica: list[int] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)
    session_requests: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    #: the replica of each request, in arrival order (tests check where sessions went)
    assignments: list[int] = field(default_factory=list, repr=False)
    seconds: float = 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)

    @property
    def flops_saved_rate(self) -> float:
        return self.flops_saved / max(self.flops_total, 1.0)

    def ttft(self, q: float) -> float:
        """The ``q``-quantile of TTFT (nearest rank), seconds."""
        return quantile(self.ttft_s, q)

    @property
    def imbalance(self) -> float:
        """Max / mean busy time over the replicas (1.0: even)."""
        mean = sum(self.busy_s) / max(len(self.busy_s), 1)
        return max(self.busy_s) / mean if mean > 0 else 1.0

    def to_dict(self) -> dict[str, object]:
        return {
            "router": self.router,
            "policy": self.policy,
            "replicas": self.replicas,
            "budget_bytes": self.budget_bytes,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_rate": self.token_hit_rate,
            "flops_total": self.flops_total,
            "flops_saved": self.flops_saved,
            "flops_saved_rate": self.flops_saved_rate,
            "ttft_p50_s": self.ttft(0.5),
            "ttft_p95_s": self.ttft(0.95),
            "imbalance": self.imbalance,
            "busy_s": self.busy_s,
            "requests_per_replica": self.requests_per_replica,
            "peak_bytes": self.peak_bytes,
            "session_requests": self.session_requests,
            "decisions": self.decisions,
            "seconds": self.seconds,
        }


class Replica:
    """One replica: its pool and policy (the replay's step) and its FIFO prefill server."""

    def __init__(self, rid: int, cost: CostModel, cfg: ClusterConfig) -> None:
        self.rid = rid
        self.cost = cost
        self.cfg = cfg
        policy = POLICIES[cfg.policy](cost)
        self.pool = SimPool(
            block_tokens=cost.block_tokens,
            kv_bytes_per_token=cost.kv_bytes_per_token,
            snapshot_bytes=cost.snapshot_bytes,
            budget_bytes=cfg.budget_bytes,
            policy=policy,
        )
        self.stats = RunStats(f"{cfg.policy}@{rid}", cfg.budget_bytes)
        admission = EngineAdmission(policy, cost.block_tokens) if cfg.engine_admission else policy
        self.run = _Run(self.pool, policy, admission, cost, self.stats, None, None)
        self.prefill = PrefillQueue(cfg.throughput_flops)
        self._prefills: deque[tuple[float, int, int]] = deque()  # (end, prompt, output tokens)
        self._decodes: list[tuple[float, int]] = []  # heap of (finish, tokens held)
        self._queued_tokens = self._running_tokens = 0

    def _advance(self, now: float) -> None:
        while self._prefills and self._prefills[0][0] <= now:
            end, prompt, output = self._prefills.popleft()
            self._queued_tokens -= prompt
            held = prompt + output
            heapq.heappush(self._decodes, (end + output * self.cfg.decode_s_per_token, held))
            self._running_tokens += held
        while self._decodes and self._decodes[0][0] <= now:
            self._running_tokens -= heapq.heappop(self._decodes)[1]

    def load(self, now: float) -> ReplicaLoad:
        self._advance(now)
        page = max(self.pool.kv_bytes_per_block, 1)
        return ReplicaLoad(
            queued_requests=len(self._prefills),
            queued_prefill_tokens=self._queued_tokens,
            queued_prefill_flops=self.prefill.backlog_flops(now),
            running=len(self._decodes),
            free_pages=self.pool.free_bytes // page,
            active_tokens=self._queued_tokens + self._running_tokens,
        )

    def view(self, kr: KeyedRequest, now: float, with_index: bool) -> ReplicaView:
        load = self.load(now)
        if not with_index:
            return ReplicaView(self.rid, load, None)
        m = self.pool.match(kr.keys, kr.req.prompt_tokens - 1, kr.probe)
        return ReplicaView(self.rid, load, m.hit_tokens, m.kv_tokens)

    def serve(self, kr: KeyedRequest, t: int, now: float) -> tuple[int, float]:
        """Run request ``t`` (the replay's step) and queue its prefill; (hit, TTFT)."""
        before = self.stats.hit_tokens
        _serve(self.run, kr, t)
        if self.pool.peak_bytes > self.cfg.budget_bytes:
            raise BudgetViolation(
                f"replica {self.rid}: peak {self.pool.peak_bytes} > {self.cfg.budget_bytes}"
            )
        hit = self.stats.hit_tokens - before
        prompt = kr.req.prompt_tokens
        ttft = self.prefill.serve(now, self.cost.span_flops(hit, prompt))
        self._prefills.append((self.prefill.free_at, prompt, kr.req.output_tokens))
        self._queued_tokens += prompt
        return hit, ttft


def session_ids(requests: Sequence[SimRequest]) -> list[Hashable | None]:
    """Each request's session: that of the earlier request whose whole content (segments)
    this one's content starts with plus one turn (two segments: message, output); None where
    no session is known (no such request, or content without an exact end: Mooncake)."""
    by_content: dict[tuple[tuple[int, int], ...], int] = {}
    out: list[Hashable | None] = []
    for i, req in enumerate(requests):
        if not req.exact_end:
            out.append(None)
            continue
        sid = by_content.get(req.segments[:-2]) if len(req.segments) > 2 else None
        sid = i if sid is None else sid
        by_content[req.segments] = sid
        out.append(sid)
    return out


ProgressFn = Callable[[int, int], None]


def run_cluster(
    requests: Sequence[KeyedRequest],
    cost: CostModel,
    cfg: ClusterConfig,
    router_name: str,
    *,
    sessions: Sequence[Hashable | None] | None = None,
    check_every: int = 0,
    progress: ProgressFn | None = None,
) -> tuple[ClusterStats, list[Replica], Router]:
    """Replay ``requests`` (in arrival order) on ``cfg.replicas`` replicas behind
    ``router_name``; ``check_every`` > 0 runs every replica's ``check_integrity`` that often
    (slow). Returns the totals, the replicas and the router (tests look inside)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].req.arrival_ms)
    if sessions is None:
        sessions = session_ids([requests[i].req for i in order])
    else:
        sessions = [sessions[i] for i in order]
    router = make_router(
        router_name,
        cfg.replicas,
        cost,
        cfg.throughput_flops,
        seed=cfg.seed,
        overload_wait_s=cfg.overload_wait_s,
    )
    reps = [Replica(r, cost, cfg) for r in range(cfg.replicas)]
    stats = ClusterStats(router_name, cfg.policy, cfg.replicas, cfg.budget_bytes)
    started = time.perf_counter()
    counts = [0] * cfg.replicas
    seen: set[Hashable] = set()
    for t, i in enumerate(order):
        kr = requests[i]
        req, now = kr.req, kr.req.arrival_ms / 1000.0
        views = [rep.view(kr, now, router.needs_index) for rep in reps]
        prompt_keys = kr.keys[: req.prompt_tokens // cost.block_tokens]
        r = router.route(prompt_keys, req.prompt_tokens, sessions[t], views)
        if not 0 <= r < cfg.replicas:
            raise RuntimeError(f"{router_name} routed to replica {r} of {cfg.replicas}")
        hit, ttft = reps[r].serve(kr, t, now)
        router.routed(prompt_keys, req.prompt_tokens, r)
        counts[r] += 1
        stats.assignments.append(r)
        stats.requests += 1
        stats.prompt_tokens += req.prompt_tokens
        stats.hit_tokens += hit
        stats.flops_total += cost.span_flops(0, req.prompt_tokens)
        stats.flops_saved += cost.span_flops(0, hit)
        stats.ttft_s.append(ttft)
        sid = sessions[t]
        if sid is not None:
            stats.session_requests += sid in seen
            seen.add(sid)
        if check_every and t % check_every == 0:
            for rep in reps:
                rep.pool.check_integrity()
        if progress is not None:
            progress(t + 1, len(order))
    stats.seconds = time.perf_counter() - started
    stats.busy_s = [rep.prefill.busy_s for rep in reps]
    stats.requests_per_replica = counts
    stats.peak_bytes = [rep.pool.peak_bytes for rep in reps]
    if isinstance(router, StateAwareRouter):
        stats.decisions = dict(router.core.counts)
    return stats, reps, router


def run_grid(
    requests: Sequence[SimRequest],
    cost: CostModel,
    replicas: Sequence[int],
    routers: Sequence[str],
    policies: Sequence[str],
    budgets: Sequence[int],
    *,
    throughput_flops: float = DEFAULT_THROUGHPUT,
    decode_s_per_token: float = DEFAULT_DECODE_S,
    overload_wait_s: float = 2.0,
    seed: int = 0,
    progress: Callable[[str], ProgressFn | None] = lambda _: None,
) -> list[ClusterStats]:
    """Every (budget, policy, N, router) combination on one workload."""
    keyed = [KeyedRequest(r, cost.block_tokens) for r in requests]
    sessions = session_ids(requests)
    rows = []
    for budget in budgets:
        for policy in policies:
            for n in replicas:
                cfg = ClusterConfig(
                    n,
                    budget,
                    policy,
                    throughput_flops,
                    decode_s_per_token,
                    overload_wait_s,
                    seed,
                )
                for name in routers:
                    label = f"{name} N={n}"
                    stats, _, _ = run_cluster(
                        keyed, cost, cfg, name, sessions=sessions, progress=progress(label)
                    )
                    rows.append(stats)
    return rows
