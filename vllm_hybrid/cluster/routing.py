"""The live cluster router's bookkeeping (standard library + core; no Ray, no vLLM).

:class:`ClusterRouter` is what the Ray Serve ``RequestRouter`` (``serve_router.py``) runs per
request; everything Ray-specific stays there. Per replica it holds:

* the replica's last **digest** (``adapters/vllm/compat/cluster.py``): the 8-byte keys of every
  prefix its engine holds a recurrent state for, and of its KV blocks, pushed through Ray
  Serve's routing stats (``record_routing_stats``) every ``request_routing_stats_period_s``;
* **speculative entries**: when a request is routed, the keys of its prompt (a state at the
  prompt's end and at its ``state_positions``, the system-prompt breakpoint the replica's
  middleware will add; KV at its block boundaries) are credited to the chosen replica at
  once, so the next turn of a conversation finds them before the replica's next digest says
  so. An entry is dropped once a digest taken after its request completed arrives (that digest is
  authoritative: it has the state or the state was evicted), or after ``spec_ttl_s``;
* its **in-flight requests** (routed, not completed), which make its load: queued requests and
  prefill tokens, and the prefill FLOPs left after each one's hit (``CostModel.span_flops``).

Per request the keys of the prompt (one per ``hash_block_size`` boundary, hashed as the engine
hashes, cache salt included) are matched against each live replica's digest + speculative
entries: ``hit_tokens`` = the deepest boundary whose key the replica holds a state for,
``kv_tokens`` = the deepest block boundary it holds KV for. Those views go to the policy:
``state`` is the core's :class:`~vllm_hybrid.core.StateRouter` unchanged; the baselines are
the simulator's routers (``sim/routers.py``). A replica that leaves (``sync_replicas``: Ray's
replica set changed or an actor died) loses its digest, speculative entries, in-flight
requests and sessions at once, and only live replicas are ever scored, so the router never
routes by a dead replica's entries.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_hybrid.core import CostModel, ReplicaLoad, ReplicaView, StateRouter
from vllm_hybrid.sim.routers import ROUTERS, Router, check_routers, make_router

#: (token ids, cache salt, hash_block_size, algorithm) -> one key per hash_block_size boundary.
Hasher = Callable[[Sequence[int], "str | None", int, str], list[int]]
#: Tokens per node of the text-prefix baselines' tree (Ray's holds characters; see sim/routers).
TEXT_UNIT = 16


@dataclass(frozen=True)
class RouteRequest:
    """What the ingress hands the router with each request (the first handle argument)."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    session: Hashable | None = None
    #: positions where the replica will keep a state besides the prompt's end (the chat's
    #: system-prompt breakpoint the replica's middleware adds), credited speculatively
    state_positions: tuple[int, ...] = ()


@dataclass(frozen=True)
class Digest:
    """One replica's report (``compat/cluster.py::_route_digest``), as received."""

    taken_at: float
    hash_block_size: int
    block_size: int
    hash_algo: str
    none_hash: str | None
    states: frozenset[int]
    kv: frozenset[int]
    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    free_pages: int = 0
    received_at: float = 0.0
    #: the replica's pool as the simulator needs it (``adapters/vllm/config.py::pool_layout``)
    layout: dict[str, Any] | None = None

    @classmethod
    def parse(cls, raw: dict[str, Any], received_at: float) -> Digest:
        return cls(
            taken_at=float(raw["taken_at"]),
            hash_block_size=int(raw["hash_block_size"]),
            block_size=int(raw["block_size"]),
            hash_algo=str(raw["hash_algo"]),
            none_hash=raw.get("none_hash"),
            states=frozenset(raw.get("states", ())),
            kv=frozenset(raw.get("kv", ())),
            waiting=int(raw.get("waiting", 0)),
            running=int(raw.get("running", 0)),
            queued_prefill_tokens=int(raw.get("queued_prefill_tokens", 0)),
            free_pages=int(raw.get("free_pages", 0)),
            received_at=received_at,
            layout=raw.get("layout"),
        )


@dataclass
class _Speculative:
    request_id: str
    states: frozenset[int]
    kv: frozenset[int]
    routed_at: float
    done_at: float | None = None


@dataclass
class _InFlight:
    replica: str
    prompt_tokens: int
    flops: float


@dataclass
class RouteRecord:
    """One decision, for logs, tests and the benchmark."""

    request_id: str
    replica: str
    reason: str
    hit_tokens: int
    session: Hashable | None
    digest_age_s: float | None


def text_keys(token_ids: Sequence[int], salt: str | None = None) -> list[bytes]:
    """Chained keys of ``token_ids`` every :data:`TEXT_UNIT` tokens (the text routers' tree;
    no salt: Ray's and SGLang's routers do not know it)."""
    keys, h = [], b""
    for i in range(TEXT_UNIT, len(token_ids) + 1, TEXT_UNIT):
        h = hashlib.blake2b(
            h + repr(tuple(token_ids[i - TEXT_UNIT : i])).encode(), digest_size=8
        ).digest()
        keys.append(h)
    return keys


@dataclass
class ClusterRouter:
    """The live router's state and decision (module docstring)."""

    policy: str
    cost: CostModel
    throughput_flops: float
    hasher: Hasher
    local_none_hash: Callable[[str], str | None] = lambda algo: None
    overload_wait_s: float = 2.0
    spec_ttl_s: float = 120.0
    seed: int = 0
    clock: Callable[[], float] = time.time
    max_records: int = 10000
    digests: dict[str, Digest] = field(default_factory=dict)
    speculative: dict[str, list[_Speculative]] = field(default_factory=dict)
    inflight: dict[str, _InFlight] = field(default_factory=dict)
    records: list[RouteRecord] = field(default_factory=list)
    digest_ages: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: each replica's last ``/metrics`` text (from its routing stats)
    last_stats: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_routers([self.policy])
        self._ids: dict[str, int] = {}
        self._live: tuple[str, ...] = ()
        self._core = StateRouter(
            self.cost, self.throughput_flops, overload_wait_s=self.overload_wait_s, seed=self.seed
        )
        self._baseline: Router | None = None
        self._baseline_for: tuple[str, ...] = ()
        self._hash_cache: dict[tuple[Any, ...], list[int]] = {}

    # ------------------------------------------------------------------ replicas
    @property
    def core(self) -> StateRouter:
        return self._core

    def replica_number(self, replica: str) -> int:
        """A stable int for a replica id (never reused), what the core router keys on."""
        if replica not in self._ids:
            self._ids[replica] = len(self._ids)
        return self._ids[replica]

    def sync_replicas(self, live: Sequence[str]) -> list[str]:
        """The replica set is ``live`` now: forget everything of the others. Returns those
        forgotten."""
        alive = set(live)
        gone = [
            r for r in set(self.digests) | set(self.speculative) | set(self._ids) if r not in alive
        ]
        gone += [f.replica for f in self.inflight.values() if f.replica not in alive]
        gone = sorted(set(gone))
        for replica in gone:
            self.digests.pop(replica, None)
            self.last_stats.pop(replica, None)
            self.speculative.pop(replica, None)
            if replica in self._ids:
                self._core.forget_replica(self._ids[replica])
        for rid in [k for k, f in self.inflight.items() if f.replica not in alive]:
            del self.inflight[rid]
        self._live = tuple(sorted(alive))
        return gone

    def update_digest(self, replica: str, raw: dict[str, Any] | None) -> None:
        """A replica's routing stats arrived (``raw``: its digest, or None)."""
        if not raw:
            return
        old = self.digests.get(replica)
        if old is not None and float(raw.get("taken_at", 0.0)) <= old.taken_at:
            return
        now = self.clock()
        digest = Digest.parse(raw, now)
        mine = self.local_none_hash(digest.hash_algo)
        if mine is not None and digest.none_hash is not None and mine != digest.none_hash:
            message = (
                f"replica {replica}: its block hashes are seeded differently from the router's "
                "(NONE_HASH differs); set the same PYTHONHASHSEED for every process or use "
                "--prefix-caching-hash-algo sha256. Its digest is ignored."
            )
            if message not in self.warnings:
                self.warnings.append(message)
            return
        self.digests[replica] = digest
        self.digest_ages.append(max(now - digest.taken_at, 0.0))
        del self.digest_ages[:-1000]
        kept = [
            s
            for s in self.speculative.get(replica, [])
            if (s.done_at is None or s.done_at >= digest.taken_at)
            and now - s.routed_at <= self.spec_ttl_s
        ]
        self.speculative[replica] = kept

    # ------------------------------------------------------------------ matching
    def _keys(self, request: RouteRequest, hbs: int, algo: str) -> list[int]:
        cache_key = (request.request_id, request.cache_salt, len(request.token_ids), hbs, algo)
        keys = self._hash_cache.get(cache_key)
        if keys is None:
            keys = self.hasher(request.token_ids, request.cache_salt, hbs, algo)
            if len(self._hash_cache) > 256:
                self._hash_cache.clear()
            self._hash_cache[cache_key] = keys
        return keys

    def _geometry(self) -> tuple[int, int, str] | None:
        for digest in self.digests.values():
            return digest.hash_block_size, digest.block_size, digest.hash_algo
        return None

    def hits(self, request: RouteRequest, replica: str) -> tuple[int | None, int]:
        """(state-bearing hit tokens or None when nothing is known of ``replica``, KV tokens)."""
        geometry = self._geometry()
        digest = self.digests.get(replica)
        spec = self.speculative.get(replica, [])
        if geometry is None or (digest is None and not spec) or not request.token_ids:
            return None, 0
        hbs, block, algo = geometry
        keys = self._keys(request, hbs, algo)
        states = set(digest.states if digest else ())
        kv = set(digest.kv if digest else ())
        for s in spec:
            states |= s.states
            kv |= s.kv
        hit = 0
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in states:
                hit = (i + 1) * hbs
                break
        kv_tokens = 0
        step = max(block // hbs, 1)
        for i in range(step - 1, len(keys), step):
            if keys[i] not in kv:
                break
            kv_tokens = (i + 1) * hbs
        # a hit must leave one token to compute (vLLM recomputes the last prompt token)
        return min(hit, max(len(request.token_ids) - 1, 0)), kv_tokens

    def load(self, replica: str) -> ReplicaLoad:
        mine = [f for f in self.inflight.values() if f.replica == replica]
        digest = self.digests.get(replica)
        return ReplicaLoad(
            queued_requests=len(mine),
            queued_prefill_tokens=sum(f.prompt_tokens for f in mine),
            queued_prefill_flops=sum(f.flops for f in mine),
            running=0,
            free_pages=digest.free_pages if digest else 0,
            active_tokens=sum(f.prompt_tokens for f in mine),
        )

    # ------------------------------------------------------------------ decision
    def choose(self, request: RouteRequest, live: Sequence[str]) -> RouteRecord:
        """The replica (one of ``live``) for ``request``; records it as in flight there and
        credits its prompt to that replica speculatively."""
        if not live:
            raise ValueError("no live replica to route to")
        order = sorted(live)
        prompt = max(len(request.token_ids), 1)
        views = []
        for replica in order:
            hit, kv_tokens = self.hits(request, replica)
            views.append(
                ReplicaView(self.replica_number(replica), self.load(replica), hit, kv_tokens)
            )
        if self.policy == "state":
            decision = self._core.choose(prompt, views, request.session)
            chosen = next(r for r in order if self._ids[r] == decision.replica)
            reason, hit = decision.reason, decision.hit_tokens
        else:
            if self._baseline is None or self._baseline_for != tuple(order):
                self._baseline_for = tuple(order)  # they index replicas 0..N-1: rebuilt
                self._baseline = make_router(
                    self.policy, len(order), self.cost, self.throughput_flops, seed=self.seed
                )
            local = [ReplicaView(i, v.load, v.hit_tokens, v.kv_tokens) for i, v in enumerate(views)]
            keys = text_keys(request.token_ids)
            pick = self._baseline.route(keys, prompt, request.session, local)
            self._baseline.routed(keys, prompt, pick)
            chosen, reason, hit = order[pick], self.policy, views[pick].hit_tokens or 0
        self._credit(request, chosen, hit)
        digest = self.digests.get(chosen)
        record = RouteRecord(
            request.request_id,
            chosen,
            reason,
            hit,
            request.session,
            None if digest is None else self.clock() - digest.taken_at,
        )
        if len(self.records) < self.max_records:
            self.records.append(record)
        return record

    def _credit(self, request: RouteRequest, replica: str, hit: int) -> None:
        prompt = len(request.token_ids)
        self.inflight[request.request_id] = _InFlight(
            replica, prompt, self.cost.span_flops(min(hit, prompt), prompt) if prompt else 0.0
        )
        geometry = self._geometry()
        if geometry is None or not prompt:
            return
        hbs, block, algo = geometry
        keys = self._keys(request, hbs, algo)
        if not keys:
            return
        step = max(block // hbs, 1)
        states = {keys[-1]} | {
            keys[p // hbs - 1] for p in request.state_positions if hbs <= p < prompt
        }
        spec = _Speculative(
            request.request_id,
            frozenset(states),
            frozenset(keys[step - 1 :: step]),
            self.clock(),
        )
        self.speculative.setdefault(replica, []).append(spec)

    def retract(self, request_id: str) -> None:
        """The request did not go where it was routed (Ray routes it again): its in-flight
        record and speculative entries are dropped."""
        self.inflight.pop(request_id, None)
        for replica, entries in self.speculative.items():
            self.speculative[replica] = [s for s in entries if s.request_id != request_id]

    def completed(self, request_id: str) -> None:
        """The request finished (or failed) on its replica."""
        self.inflight.pop(request_id, None)
        now = self.clock()
        for entries in self.speculative.values():
            for s in entries:
                if s.request_id == request_id and s.done_at is None:
                    s.done_at = now

    def state(self) -> dict[str, Any]:
        """A JSON-able summary (``GET /v1/hybrid/cluster``)."""
        ages = sorted(self.digest_ages)
        return {
            "policy": self.policy,
            "live": list(self._live),
            "counts": dict(self._core.counts),
            "overloads": [list(map(str, o)) for o in self._core.overloads],
            "inflight": {
                r: sum(f.replica == r for f in self.inflight.values()) for r in self._live
            },
            "digests": {
                r: {
                    "taken_at": d.taken_at,
                    "states": len(d.states),
                    "kv": len(d.kv),
                    "free_pages": d.free_pages,
                    "layout": d.layout,
                }
                for r, d in self.digests.items()
            },
            "speculative": {r: len(s) for r, s in self.speculative.items()},
            "digest_age_s": {
                "n": len(ages),
                "p50": ages[len(ages) // 2] if ages else None,
                "max": ages[-1] if ages else None,
            },
            "warnings": list(self.warnings),
            "records": [
                {
                    "request_id": r.request_id,
                    "replica": r.replica,
                    "reason": r.reason,
                    "hit_tokens": r.hit_tokens,
                    "session": None if r.session is None else str(r.session),
                }
                for r in self.records
            ],
        }


#: The routers Ray built in this process, by app name (``serve_router.py`` says why here).
_LIVE: dict[str, ClusterRouter] = {}


def register_router(app_name: str, router: ClusterRouter) -> None:
    _LIVE[app_name] = router


def live_router(app_name: str) -> ClusterRouter | None:
    """The router of ``app_name``'s engine handle in this process (the ingress), if built."""
    return _LIVE.get(app_name)


__all__ = [
    "ROUTERS",
    "ClusterRouter",
    "Digest",
    "RouteRecord",
    "RouteRequest",
    "live_router",
    "register_router",
    "text_keys",
]
