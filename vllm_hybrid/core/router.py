"""The router's decision across replicas: which replica serves a request (stdlib only).

Engine-agnostic: the simulator (``sim/cluster.py``) and a live router give it, per replica,
what that replica's prefix index says the request would resume from and the replica's load,
and it picks one. The derivation of the score is in docs/cluster.md; in short:

* A hybrid model resumes a prompt only where a replica holds the KV below a position *and* a
  recurrent-state snapshot exactly there (``PrefixIndex.match``'s ``hit_tokens``). The work
  the request still costs on replica ``r`` is the prefill of ``[hit_r, prompt)``:
  ``CostModel.span_flops(hit_r, prompt)`` FLOPs, i.e. that divided by the replica's throughput
  in seconds.
* A replica serves prefills first in, first out, so the request waits for the prefill work
  already queued there: ``queued_prefill_flops / throughput`` seconds.
* Estimated time to first token: ``ttft_r = queued_prefill_flops_r / X + span_flops(hit_r,
  prompt) / X``; the router picks the replica with the lowest. Hit depth and load are in one
  unit (seconds), so no weight is tuned. Ties (equal to ``tie_s``) go to the longer KV prefix
  (vLLM's align mode takes a junction state where the KV hit passes the state hit, so a later
  request of the same prefix hits there), then to fewer queued FLOPs, fewer ongoing requests,
  more free pages, then at random (seeded).
* Sessions: a request of a session the router has routed before goes back to the replica that
  served its previous turn (which holds its state), unless that replica is *overloaded*: its
  queue ahead is more than ``overload_wait_s`` seconds longer than the shortest queue ahead
  and another replica's estimated TTFT is lower. Then the score decides and the decision is
  logged (logger ``vllm_hybrid.router``, and :attr:`StateRouter.overloads`).
* A replica whose index the router does not have or holds as stale (``hit_tokens`` None) is
  scored as if it had no hit; when no replica's index is known the router falls back to the
  power of two choices on queued prefill work (two replicas drawn at random, the lighter one).

Nothing here touches an index: the caller queries each replica's index read-only (a
``match`` does not change LRU order, ghosts or statistics) and passes the answers in.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from vllm_hybrid.core.cost import CostModel

LOG = logging.getLogger("vllm_hybrid.router")

#: Reasons a :class:`RouteDecision` gives.
SCORE, SESSION, OVERLOAD, FALLBACK = "score", "session", "overload", "fallback"


@dataclass(frozen=True)
class ReplicaLoad:
    """What a replica reports of its load: requests waiting for (or in) prefill, their prompt
    tokens and the prefill FLOPs left after each one's hit (what is left of the prefill running
    now included), requests decoding, and free pages of its pool."""

    queued_requests: int = 0
    queued_prefill_tokens: int = 0
    queued_prefill_flops: float = 0.0
    running: int = 0
    free_pages: int = 0
    #: tokens of KV the replica's requests hold now (prompts waiting or running, and what
    #: the running ones generated): Dynamo's "active blocks" times the block size
    active_tokens: int = 0

    @property
    def ongoing(self) -> int:
        """Requests on the replica not finished yet: what a queue-length router counts."""
        return self.queued_requests + self.running


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the router sees it for one request: ``hit_tokens`` is the deepest
    state-bearing hit its index gives (None: index absent or stale), ``kv_tokens`` the longest
    cached KV prefix (a tie-breaker)."""

    replica: int
    load: ReplicaLoad
    hit_tokens: int | None
    kv_tokens: int = 0


@dataclass(frozen=True)
class RouteDecision:
    """The chosen replica, why (:data:`SCORE`, :data:`SESSION`, :data:`OVERLOAD`,
    :data:`FALLBACK`), its estimated TTFT in seconds (None on the fallback) and the hit it
    was chosen for."""

    replica: int
    reason: str
    ttft_s: float | None
    hit_tokens: int


@dataclass
class StateRouter:
    """Routes by estimated time to first token from state-bearing hits (module docstring).

    ``throughput_flops``: the prefill FLOP/s one replica sustains (a stated device figure);
    ``overload_wait_s``: how much longer than the shortest queue ahead a session's replica's
    queue may be before the session is moved; ``tie_s``: TTFTs this close are tied."""

    cost: CostModel
    throughput_flops: float
    overload_wait_s: float = 2.0
    tie_s: float = 1e-3
    seed: int = 0
    sessions: dict[Hashable, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    overloads: list[tuple[Hashable, int, int]] = field(default_factory=list)
    max_logged: int = 1000

    def __post_init__(self) -> None:
        if not self.throughput_flops > 0:
            raise ValueError(f"throughput_flops must be > 0, got {self.throughput_flops}")
        if self.overload_wait_s < 0 or self.tie_s < 0:
            raise ValueError("overload_wait_s and tie_s must be >= 0")
        self._rng = random.Random(self.seed)
        for reason in (SCORE, SESSION, OVERLOAD, FALLBACK):
            self.counts.setdefault(reason, 0)

    # ----------------------------------------------------------------- estimates
    def wait_s(self, load: ReplicaLoad) -> float:
        """Seconds of prefill queued ahead of a new request on a replica with ``load``."""
        return max(load.queued_prefill_flops, 0.0) / self.throughput_flops

    def prefill_s(self, prompt_tokens: int, hit_tokens: int) -> float:
        """Seconds to prefill ``[hit_tokens, prompt_tokens)``."""
        hit = min(max(hit_tokens, 0), prompt_tokens)
        return self.cost.span_flops(hit, prompt_tokens) / self.throughput_flops

    def estimate_ttft(self, prompt_tokens: int, view: ReplicaView) -> float:
        """``wait + prefill after the hit`` on ``view``'s replica (no hit if unknown)."""
        hit = view.hit_tokens or 0
        return self.wait_s(view.load) + self.prefill_s(prompt_tokens, hit)

    # ----------------------------------------------------------------- decision
    def choose(
        self,
        prompt_tokens: int,
        views: Sequence[ReplicaView],
        session: Hashable | None = None,
    ) -> RouteDecision:
        """The replica for a request of ``prompt_tokens`` (module docstring); ``session``: the
        conversation it belongs to (None: none known). Remembers the session's replica."""
        if not views:
            raise ValueError("no replica to route to")
        if prompt_tokens <= 0:
            raise ValueError(f"prompt_tokens must be > 0, got {prompt_tokens}")
        if all(v.hit_tokens is None for v in views):
            decision = self._power_of_two(views)
        else:
            decision = self._by_score(prompt_tokens, views, session)
        self.counts[decision.reason] += 1
        if session is not None:
            self.sessions[session] = decision.replica
        return decision

    def forget_replica(self, replica: int) -> None:
        """A replica left (died, drained): no session follows it any more."""
        for key in [k for k, r in self.sessions.items() if r == replica]:
            del self.sessions[key]

    def _by_score(
        self, prompt_tokens: int, views: Sequence[ReplicaView], session: Hashable | None
    ) -> RouteDecision:
        scored = [(self.estimate_ttft(prompt_tokens, v), v) for v in views]
        best_s = min(s for s, _ in scored)
        tied = [(s, v) for s, v in scored if s <= best_s + self.tie_s]
        salt = self._rng.random()
        ttft, best = min(
            tied,
            key=lambda sv: (
                -sv[1].kv_tokens,
                sv[1].load.queued_prefill_flops,
                sv[1].load.ongoing,
                -sv[1].load.free_pages,
                (sv[1].replica * 0.6180339887 + salt) % 1.0,  # a random rotation
            ),
        )
        home = None if session is None else self.sessions.get(session)
        if home is None:
            return RouteDecision(best.replica, SCORE, ttft, best.hit_tokens or 0)
        if home == best.replica:
            return RouteDecision(home, SESSION, ttft, best.hit_tokens or 0)
        mine = next(((s, v) for s, v in scored if v.replica == home), None)
        if mine is None:  # the session's replica is gone
            return RouteDecision(best.replica, SCORE, ttft, best.hit_tokens or 0)
        shortest = min(self.wait_s(v.load) for v in views)
        if self.wait_s(mine[1].load) - shortest <= self.overload_wait_s or mine[0] <= ttft:
            return RouteDecision(home, SESSION, mine[0], mine[1].hit_tokens or 0)
        if len(self.overloads) < self.max_logged:
            self.overloads.append((session, home, best.replica))
        LOG.info(
            "session %r: replica %d overloaded (queue %.2f s, shortest %.2f s, threshold "
            "%.2f s); routed to replica %d (est. TTFT %.2f s against %.2f s)",
            session,
            home,
            self.wait_s(mine[1].load),
            shortest,
            self.overload_wait_s,
            best.replica,
            ttft,
            mine[0],
        )
        return RouteDecision(best.replica, OVERLOAD, ttft, best.hit_tokens or 0)

    def _power_of_two(self, views: Sequence[ReplicaView]) -> RouteDecision:
        picks = self._rng.sample(list(views), min(2, len(views)))
        best = min(picks, key=lambda v: (v.load.queued_prefill_flops, v.load.running, v.replica))
        return RouteDecision(best.replica, FALLBACK, None, 0)


def power_of_two(views: Sequence[ReplicaView], rng: random.Random) -> int:
    """The power of two choices on ongoing requests (running + waiting): two replicas drawn
    at random, the one with fewer (ties: fewer queued prefill tokens, lower id)."""
    if not views:
        raise ValueError("no replica to route to")
    picks = rng.sample(list(views), min(2, len(views)))
    best = min(
        picks,
        key=lambda v: (
            v.load.ongoing,
            v.load.queued_prefill_tokens,
            v.replica,
        ),
    )
    return best.replica
