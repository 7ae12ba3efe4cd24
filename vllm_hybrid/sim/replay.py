"""The replay loop: requests in arrival order against one pool, one policy, one budget.

The pool is the simulator's page pool (``sim/pool.py``) under the engine's prefix index
(``core/index/``): what is kept, hit and evicted is decided by the code the engine runs.

Each request: match its prompt (a hit must leave the last prompt token to compute, so at most
``prompt_tokens - 1``), lock the matched path, let the policy choose snapshot positions, insert
the blocks it leaves behind (prompt, plus output where a later turn extends it; an admission
with ``kv_end_tokens`` keeps fewer, ``core/policy.py``) with snapshots where chosen, unlock.
The cache serves requests one at a time, in arrival order; the budget is checked after every
request and the pool raises if any step would exceed it.

Time to first token: each request's prefill of what its hit did not save (plus a host-tier
hit's transfer) is queued, at its arrival, on one FIFO prefill server of ``throughput_flops``
(``sim/service.py``), so requests overlap in time and wait for each other as on an engine, and
``RunStats`` holds each request's TTFT (queueing included).

With a host tier (``host_bytes > 0``), snapshots the policy evicts alone are demoted to host
memory; a request whose hit ends on a host snapshot counts as a hit (its prefix is skipped, the
FLOPs are saved) and pays ``snapshot_bytes / host_bandwidth`` seconds of transfer
(``promote_seconds``), the price of the tier.

Requests in flight (``in_flight > 1``, off by default): an engine serving N requests at once
holds every running request's pages and only registers a block's hash once it is computed. The
loop models this as a sliding window, with the arrival order as admission order: request ``t``
keeps its path, its new blocks and snapshots locked (held, counted in the budget, never evicted)
until request ``t + in_flight - 1`` has been admitted, i.e. it is released just before request
``t + in_flight`` is served. What request ``t`` inserted (blocks it created, snapshots it added,
partial states) becomes visible to lookups from request ``t + visible_after`` on: 1 (the
default) makes it visible to the next request, ``in_flight`` hides everything a request still in
flight inserted. vLLM registers a block's hash once the step that computed it has run, and a
prefill that fits the step's token budget completes in the step that admits it, so only
requests admitted in the same step miss each other's blocks; against the engine
(docs/bench_replay.md) 1 is the closest. A request that cannot see a block recomputes it and
shares the cached copy (the engine holds a duplicate page while both run; the pool keeps one
copy per key). ``running_bytes``: what each request in flight holds outside the cache for its
whole stay (in vLLM's align mode its running state, a page per Mamba group, and its last
partial KV block); the window is always full, so the pool's budget is ``budget_bytes -
in_flight * running_bytes``. ``in_flight=1`` with ``running_bytes=0`` (the defaults) is the
one-request-at-a-time loop above, unchanged.

Lookahead (``waiting``, off by default): the engine's scheduler tells the index which block
keys its waiting requests would hit (``PrefixIndex.lookahead``: the first ``lookahead_paths``
waiting requests, refreshed once per scheduler step), and the units they would hit are evicted
last. ``waiting[i]`` is how many of the requests after request ``i`` are waiting when it is
served (all of them when every request arrives at once); each such request's prompt path, up to
the last block a hit may end on, is passed to the same index hook, refreshed before each
request.

Sibling stops (``sibling_slots`` > 0, with ``waiting``; 0 by default): an engine with
``sibling_wait`` on ends a request's prefill chunk where one of the waiting requests that can
start beside it (as many as its free running slots, ``sibling_slots``) diverges from it, and
keeps its state there (``core/siblings.py``, the same :func:`~vllm_hybrid.core.sibling_stops`);
the loop gives those stops to the admission (``AdmitContext.stops``). Not modelled: a waiting
request that waits for a running one (requests in flight are admitted in arrival order here).

``hold_snapshots=False`` (off by default): what a request holds protects its KV only, not the
state snapshots on its path, as in vLLM's align mode, where a running request keeps its KV
blocks referenced until it finishes but frees a state block (the one it hit, a junction or
replay-boundary state it wrote) to the free queue as soon as it has computed past it
(``MambaManager.remove_skipped_blocks``). Under pool pressure vLLM's LRU then evicts the states
of a prefix while its KV is still held, and the KV alone cannot serve a hit (docs/block_manager.md,
the agent row). With the default what a request holds protects both.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

from vllm_hybrid.core import AdmitContext, BeladyOracle, CostModel, Match, Node, sibling_stops
from vllm_hybrid.sim.pool import LockHandle, SimPool
from vllm_hybrid.sim.service import DEFAULT_THROUGHPUT, PrefillQueue, quantile
from vllm_hybrid.sim.trace import KeyedRequest

ProgressFn = Callable[[int, int], None]


@dataclass
class RunStats:
    """Totals of one (policy, budget) run; rates are properties."""

    policy: str
    budget_bytes: int
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    flops_total: float = 0.0
    flops_saved: float = 0.0
    state_hits: int = 0
    snapshots_taken: int = 0
    snapshots_kept: int = 0
    evicted_kv_blocks: int = 0
    evicted_snapshots: int = 0
    peak_bytes: int = 0
    seconds: float = 0.0
    # host tier (all 0 without one)
    host_budget_bytes: int = 0
    host_hits: int = 0
    host_hit_tokens: int = 0
    host_flops_saved: float = 0.0
    demoted: int = 0
    host_dropped: int = 0
    host_invalidated: int = 0
    host_peak_bytes: int = 0
    promote_seconds: float = 0.0
    # the TTFT model (sim/service.py): its prefill FLOP/s, and each request's TTFT in seconds,
    # in serving order
    throughput_flops: float = DEFAULT_THROUGHPUT
    ttft_s: list[float] = field(default_factory=list, repr=False)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)

    def ttft(self, q: float) -> float:
        """The ``q``-quantile of TTFT (nearest rank), seconds."""
        return quantile(self.ttft_s, q)

    @property
    def ttft_mean(self) -> float:
        return sum(self.ttft_s) / max(len(self.ttft_s), 1)

    @property
    def flops_saved_rate(self) -> float:
        return self.flops_saved / max(self.flops_total, 1.0)

    @property
    def state_hit_rate(self) -> float:
        return self.state_hits / max(self.requests, 1)

    def to_dict(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = dict(asdict(self))
        del out["ttft_s"]  # one value per request: summarised below
        out.update(
            token_hit_rate=self.token_hit_rate,
            flops_saved_rate=self.flops_saved_rate,
            state_hit_rate=self.state_hit_rate,
            ttft_mean_s=self.ttft_mean,
            ttft_p50_s=self.ttft(0.5),
            ttft_p95_s=self.ttft(0.95),
        )
        return out


class BudgetViolation(RuntimeError):
    """The loop saw more bytes held than the budget (a policy, pool or index bug)."""


def _commit(
    pool: SimPool,
    kr: KeyedRequest,
    m: Match,
    h: LockHandle,
    positions: list[int],
    t: int,
    window: _Window | None = None,
    kv_end_tokens: int | None = None,
    sub_block: bool = False,
) -> None:
    b = pool.block_tokens
    wanted = set(positions)
    n_blocks = _kept_blocks(kr, kv_end_tokens)
    if pool.vllm_queue:  # cached blocks it recomputes past its KV match (the last token's)
        for i in range(len(m.kv_nodes), n_blocks):
            node = pool.index.live_node(kr.keys[i])
            if node is None:
                break
            pool.recompute_block(h, node)
    pool.make_room(*_new_bytes(pool, kr, m, wanted, n_blocks))  # at once, as engines allocate
    for pos in sorted(p for p in wanted if p % b == 0 and 0 < p <= m.kv_tokens):
        _admit_snapshot(pool, h, m.kv_nodes[pos // b - 1], t, window)
    end = kr.req.cacheable_tokens
    inner = sorted(p for p in wanted if p % b and p < end) if sub_block else []
    _admit_partials(pool, kr, h, inner, t)
    for i in range(len(m.kv_nodes), n_blocks):
        node = pool.insert_block(h, kr.keys[i], origin=t)
        if node is None:
            return  # budget full of held pages: the rest is not cached
        if node.end_tokens in wanted:
            _admit_snapshot(pool, h, node, t, window)
        _admit_partials(pool, kr, h, inner, t)
    tail = kr.tail_key
    if end in wanted and end % b and tail is not None and h.node.end_tokens == end // b * b:
        partial = pool.admit_partial(h, tail, end % b, origin=t)
        if window is not None and partial is not None:
            window.extra.append(pool.lock(partial))  # the request's state: held while it runs


def _admit_partials(
    pool: SimPool, kr: KeyedRequest, h: LockHandle, positions: list[int], t: int
) -> None:
    """Keep the exact-position states of ``positions`` (sorted, inside the content, not block
    ends) that lie in the block after the handle's node: its first ``p % B`` tokens' KV and
    the state at ``p`` (an exact prompt end, junction). Positions the handle has passed go."""
    b, at = pool.block_tokens, h.node.end_tokens
    while positions and positions[0] < at + b:
        pos = positions.pop(0)
        if pos > at:
            pool.admit_partial(h, kr.probe(at // b, pos - at), pos - at, origin=t)


def _kept_blocks(kr: KeyedRequest, kv_end_tokens: int | None) -> int:
    """The full blocks of ``kr``'s content whose KV it leaves in the cache: all of them, or
    those within what its admission keeps (``kv_end_tokens``, e.g. ``sglang``: up to its last
    state; the exact end's partial block only when that is all of the content)."""
    if kv_end_tokens is None or kv_end_tokens >= kr.req.cacheable_tokens:
        return len(kr.keys)
    return min(len(kr.keys), max(kv_end_tokens, 0) // kr.block_tokens)


def _new_bytes(
    pool: SimPool, kr: KeyedRequest, m: Match, wanted: set[int], n_blocks: int
) -> tuple[int, int]:
    """The (KV, state) bytes :func:`_commit` will take: the blocks past the KV hit not cached
    yet (of the first ``n_blocks``), the snapshots at ``wanted`` block ends not held yet, and
    an exact end's partial block. Room for all of them is made in one go, as vLLM's
    ``KVCacheManager.allocate_slots`` takes a prefill's blocks in one
    ``BlockPool.get_new_blocks`` call (fewer, larger evictions; the same victims, since the
    request's own pages are held)."""
    b, node_of = pool.block_tokens, pool.node_of
    keys = kr.keys
    blocks = sum(node_of(keys[i]) is None for i in range(len(m.kv_nodes), n_blocks))
    states = 0
    for pos in wanted:
        if pos % b or pos <= 0 or pos > max(n_blocks, len(m.kv_nodes)) * b:
            continue
        node = node_of(keys[pos // b - 1])
        states += node is None or not node.has_snapshot
    end, n_bytes = kr.req.cacheable_tokens, blocks * pool.kv_bytes_per_block
    if end in wanted and end % b and kr.tail_key is not None and node_of(kr.tail_key) is None:
        n_bytes += (end % b) * pool.kv_bytes_per_token
        states += 1
    return n_bytes, states * pool.snapshot_bytes


def _admit_snapshot(
    pool: SimPool, h: LockHandle, node: Node, t: int, window: _Window | None
) -> None:
    if window is None or node.has_snapshot:
        pool.admit_snapshot(h, node)
    elif pool.admit_snapshot(h, node):
        window.new_snapshot(node, t)


@dataclass
class _Window:
    """The requests in flight (``in_flight > 1``): their lock handles, held until they leave the
    window, and the snapshots they added to existing nodes, hidden until ``visible_after``."""

    in_flight: int
    visible_after: int
    held: deque[tuple[int, list[LockHandle]]] = field(default_factory=deque)
    snap_by: dict[Node, int] = field(default_factory=dict)
    snaps: deque[tuple[int, Node]] = field(default_factory=deque)
    extra: list[LockHandle] = field(default_factory=list)

    def admit(self, pool: SimPool, t: int) -> None:
        """Before request ``t``: release the request that leaves the window (its slot is
        ``t``'s) and forget the snapshots that became visible."""
        self._release(pool, t - self.in_flight)
        while self.snaps and self.snaps[0][0] <= t - self.visible_after:
            j, node = self.snaps.popleft()
            if self.snap_by.get(node) == j:
                del self.snap_by[node]

    def new_snapshot(self, node: Node, t: int) -> None:
        self.snap_by[node] = t
        self.snaps.append((t, node))

    def hold(self, t: int, h: LockHandle) -> None:
        self.held.append((t, [h, *self.extra]))
        self.extra = []

    def release_all(self, pool: SimPool) -> None:
        self._release(pool, math.inf)

    def _release(self, pool: SimPool, last: float) -> None:
        """Unlock what the requests up to index ``last`` hold."""
        while self.held and self.held[0][0] <= last:
            for h in self.held.popleft()[1]:
                pool.unlock(h)

    def hidden_from(self, t: int) -> Callable[[Node, bool], bool]:
        """``PrefixIndex.match``'s ``hidden`` for request ``t``: a block a request still hidden
        from ``t`` created, or a snapshot such a request added (``snapshot`` True)."""
        first_hidden = t - self.visible_after + 1

        def hidden(node: Node, snapshot: bool) -> bool:
            return node.origin >= first_hidden or (
                snapshot and self.snap_by.get(node, -1) >= first_hidden
            )

        return hidden


@dataclass
class _Run:
    """What every request of one replay is served with."""

    pool: SimPool
    policy: object  # ranks (the index asks it) and learns (observe)
    admission: object  # chooses snapshot positions (snapshot_positions)
    cost: CostModel
    stats: RunStats
    oracle: BeladyOracle | None
    window: _Window | None
    hits_out: list[int] | None = None
    #: the sibling stops of request ``t`` given its hit (``sibling_slots``, module docstring)
    siblings: Callable[[int, int], tuple[int, ...]] | None = None


def _serve(run: _Run, kr: KeyedRequest, t: int) -> None:
    pool, req, window = run.pool, kr.req, run.window
    pool.now = t
    if window is None:
        m = pool.match(kr.keys, req.prompt_tokens - 1, kr.probe)
    else:
        window.admit(pool, t)
        pool.flush_free()
        m = pool.match(kr.keys, req.prompt_tokens - 1, kr.probe, window.hidden_from(t))
    saved = _count(run, req.prompt_tokens, m)
    if run.oracle is not None:
        target = m.hit_node.key if m.hit_tokens else None
        run.oracle.record(t, [n.key for n in m.kv_nodes], target)
    tip = m.kv_nodes[-1] if m.kv_nodes else pool.root
    if pool.vllm_queue:
        pool.before_hit(m)
    h = pool.lock(tip)
    pool.touch(h, m)
    if pool.promote(h, m):
        run.stats.host_hits += 1
        run.stats.host_hit_tokens += m.hit_tokens
        run.stats.host_flops_saved += saved
    ctx = AdmitContext(
        t,
        req.prompt_tokens,
        req.cacheable_tokens,
        m.hit_tokens,
        m.kv_tokens,
        not tip.is_leaf,
        pool.block_tokens,
        req.exact_end,
        kr.key_at,
        kr.probe,
        () if run.siblings is None else run.siblings(t, m.hit_tokens),
    )
    positions = run.admission.snapshot_positions(ctx)  # type: ignore[attr-defined]
    kv_end = getattr(run.admission, "kv_end_tokens", None)
    # an engine's admission at a match unit below the block keeps exact states inside the
    # content too (EngineAdmission: a prompt's P - 1, a block boundary after a sub-block hit)
    sub_block = getattr(run.admission, "unit_tokens", pool.block_tokens) < pool.block_tokens
    kv_end_tokens = None if kv_end is None else kv_end(ctx, positions)
    _commit(pool, kr, m, h, positions, t, window, kv_end_tokens, sub_block and req.exact_end)
    if req.output_tokens > 1:  # its first decode step frees the states it computed past
        pool.flush_free()
    # The engine learns of a request once vLLM's allocate_slots has cached its blocks
    # (adapters/vllm/scheduler.py::_hy_feed_started runs after Scheduler.schedule): so here.
    run.policy.observe(ctx, m.hit_node)  # type: ignore[attr-defined]
    if window is None:
        pool.unlock(h)
    else:
        window.hold(t, h)
    pool.flush_free()  # what it released (vLLM's free when it finishes)


def _count(run: _Run, prompt_tokens: int, m: Match) -> float:
    """Add a request's lookup to the totals; returns the FLOPs its hit saves."""
    stats, cost = run.stats, run.cost
    if run.hits_out is not None:
        run.hits_out.append(m.hit_tokens)
    stats.requests += 1
    stats.prompt_tokens += prompt_tokens
    stats.hit_tokens += m.hit_tokens
    stats.state_hits += m.hit_tokens > 0
    stats.flops_total += cost.span_flops(0, prompt_tokens)
    saved = cost.span_flops(0, m.hit_tokens)
    stats.flops_saved += saved
    return saved


def _sibling_stops(
    requests: Sequence[KeyedRequest],
    waiting: Sequence[int],
    first_index: int,
    admission: object,
    slots: int,
) -> Callable[[int, int], tuple[int, ...]]:
    """Request ``t``'s sibling stops given its hit: :func:`~vllm_hybrid.core.sibling_stops`
    over the first ``slots`` requests waiting behind it, at the admission's unit
    (``unit_tokens``, else the block), as the engine's ``CacheControl.on_lookup`` takes them."""

    def stops(t: int, hit_tokens: int) -> tuple[int, ...]:
        i = t - first_index
        kr = requests[i]
        block = kr.block_tokens
        unit = getattr(admission, "unit_tokens", block)
        behind = range(i + 1, min(i + 1 + waiting[i], len(requests)))  # sibling_stops caps
        consumers = (
            (kr.req.shared_prompt_tokens(requests[j].req), requests[j].req.prompt_tokens)
            for j in behind
        )
        found = sibling_stops(hit_tokens, kr.req.prompt_tokens, consumers, unit, block, slots)
        return tuple(found)

    return stops


def _waiting_paths(
    requests: Sequence[KeyedRequest], i: int, n: int
) -> Iterator[Sequence[Hashable]]:
    """The prompt paths of the ``n`` requests after request ``i``, each up to the last block a
    hit may end on (a hit leaves the last prompt token to compute), as the engine's scheduler
    gives its waiting requests' (``adapters/vllm/scheduler.py::_hy_waiting_paths``)."""
    for kr in requests[i + 1 : i + 1 + n]:
        yield kr.keys[: (kr.req.prompt_tokens - 1) // kr.block_tokens]


def replay(
    requests: Sequence[KeyedRequest],
    cost: CostModel,
    policy: object,
    budget_bytes: int,
    *,
    name: str | None = None,
    oracle: BeladyOracle | None = None,
    check_every: int = 0,
    progress: ProgressFn | None = None,
    host_bytes: int = 0,
    host_bandwidth: float = 25e9,
    in_flight: int = 1,
    visible_after: int = 1,
    running_bytes: int = 0,
    hold_snapshots: bool = True,
    admission: object | None = None,
    first_index: int = 0,
    waiting: Sequence[int] | None = None,
    state_budget_bytes: int | None = None,
    vllm_queue: int = 0,
    hits_out: list[int] | None = None,
    throughput_flops: float = DEFAULT_THROUGHPUT,
    sibling_slots: int = 0,
) -> RunStats:
    """Replay ``requests``; ``oracle`` (if given) records future uses for a Belady run;
    ``check_every`` > 0 runs ``check_integrity()`` every that many requests (slow);
    ``host_bytes`` > 0 adds a host tier of that size, ``host_bandwidth`` bytes/s each way;
    ``in_flight`` > 1 keeps that many requests in flight, ``visible_after`` (1..in_flight)
    sets when a request's inserts become visible, ``running_bytes`` is what each request in
    flight holds outside the cache, ``hold_snapshots=False`` lets what a request holds protect
    its KV only, not its snapshots (vLLM's align mode; module docstring); ``admission``: the
    policy that chooses where snapshots are taken (default ``policy``; e.g. an engine that
    ranks by ``policy`` but keeps states where vLLM's align mode does); ``first_index``: the
    first request's index (its clock), for a policy that served requests before;
    ``waiting``: per request, how many of the next requests are waiting when it is served
    (lookahead, module docstring; None: none); ``state_budget_bytes``: that much of the
    budget is a pool of its own for states (SGLang's Mamba pool, ``sim/pool.py``);
    ``vllm_queue``: N > 0 evicts as vLLM's own pool does, page by page from its free queue, a
    snapshot N pages, a recomputed block's old page kept (``sim/pool.py``; the ``stock`` row);
    ``hits_out``: each request's hit tokens are appended to it, in order;
    ``throughput_flops``: the prefill FLOP/s of the TTFT model (module docstring);
    ``sibling_slots``: the engine's stops for that many waiting siblings (module docstring;
    needs ``waiting``)."""
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    if not 1 <= visible_after <= in_flight:
        raise ValueError(f"visible_after must be in 1..{in_flight}, got {visible_after}")
    pool_budget = budget_bytes - in_flight * running_bytes
    if running_bytes < 0 or pool_budget < 0:
        raise ValueError(f"running_bytes {running_bytes} x {in_flight} outside 0..budget")
    if state_budget_bytes is not None and running_bytes:
        raise ValueError("a state pool and running_bytes (vLLM's running pages) do not mix")
    window = _Window(in_flight, visible_after) if in_flight > 1 else None
    pool = SimPool(
        block_tokens=cost.block_tokens,
        kv_bytes_per_token=cost.kv_bytes_per_token,
        snapshot_bytes=cost.snapshot_bytes,
        budget_bytes=pool_budget,
        policy=policy,  # type: ignore[arg-type]
        host_bytes=host_bytes,
        host_bandwidth=host_bandwidth,
        hold_snapshots=hold_snapshots,
        state_budget_bytes=state_budget_bytes,
        vllm_queue=vllm_queue,
    )
    host = None if pool.host is None else pool.host.tier
    stats = RunStats(
        name or getattr(policy, "name", "?"),
        budget_bytes,
        host_budget_bytes=host_bytes,
        throughput_flops=throughput_flops,
    )
    prefill = PrefillQueue(throughput_flops)
    started = time.perf_counter()
    run = _Run(pool, policy, admission or policy, cost, stats, oracle, window, hits_out)
    if waiting is not None and len(waiting) != len(requests):
        raise ValueError(f"waiting has {len(waiting)} counts for {len(requests)} requests")
    if sibling_slots and waiting is None:
        raise ValueError("sibling_slots needs waiting (the requests behind each one)")
    if sibling_slots > 0:
        run.siblings = _sibling_stops(
            requests, waiting, first_index, admission or policy, sibling_slots
        )
    cursor = [0]
    if waiting:
        pool.set_lookahead(lambda: _waiting_paths(requests, cursor[0], waiting[cursor[0]]))
    for t, kr in enumerate(requests, start=first_index):
        if waiting:
            cursor[0] = t - first_index
            pool.refresh_lookahead()
        hit, moved = stats.hit_tokens, 0.0 if host is None else host.promote_seconds
        _serve(run, kr, t)
        hit = stats.hit_tokens - hit
        moved = 0.0 if host is None else host.promote_seconds - moved
        flops = cost.span_flops(hit, kr.req.prompt_tokens)
        stats.ttft_s.append(prefill.serve(kr.req.arrival_ms / 1000.0, flops, moved))
        if pool.peak_bytes > pool_budget:
            raise BudgetViolation(f"{stats.policy}: peak {pool.peak_bytes} > {pool_budget}")
        if host is not None and host.peak_bytes > host_bytes:
            raise BudgetViolation(f"{stats.policy}: host peak {host.peak_bytes} > {host_bytes}")
        if check_every and t % check_every == 0:
            pool.check_integrity()
        if progress is not None:
            progress(t + 1 - first_index, len(requests))
    if window is not None:
        window.release_all(pool)
    stats.seconds = time.perf_counter() - started
    stats.snapshots_taken = pool.snapshots_admitted
    stats.snapshots_kept = pool.n_snapshots
    stats.evicted_kv_blocks = pool.evicted_kv_blocks
    stats.evicted_snapshots = pool.evicted_snapshots
    stats.peak_bytes = pool.peak_bytes
    if host is not None:
        stats.demoted = host.demoted
        stats.host_dropped = host.dropped
        stats.host_invalidated = host.invalidated
        stats.host_peak_bytes = host.peak_bytes
        stats.promote_seconds = host.promote_seconds
    return stats
