"""What a hybrid prefix cache holds and drops, as monotonic totals, and the metrics made of them.

Engine-agnostic (stdlib only). The engine side keeps totals that only grow (:class:`PageCounts`,
``core/feed.py``'s ``FeedCounters``, the pool's eviction counters) and ships one flat snapshot
of them per stats tick (:func:`engine_totals`, keys = :data:`METRICS` keys). The exporter side
turns successive snapshots into counter increments (:class:`CounterDeltas`) and sets gauges.
Shipping totals rather than increments keeps the exporter right when a stats message is dropped
or merged, and lets it check ``cached - evicted == held`` at any time.

Pages are the engine's pool pages (vLLM: block ids). A page holds either KV (an attention
group) or a state snapshot (a Mamba group), never both at once.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from vllm_hybrid.core.feed import FeedCounters

PREFIX = "vllm_hybrid:"
KV: Final = "kv"
SNAPSHOT: Final = "snapshot"
Kind = Literal["kv", "snapshot"]


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: ``key`` in the totals, exported as ``PREFIX + key`` (counters get
    the ``_total`` suffix from the Prometheus client)."""

    key: str
    kind: Literal["counter", "gauge"]
    doc: str


def _c(key: str, doc: str) -> MetricSpec:
    return MetricSpec(key, "counter", doc)


def _g(key: str, doc: str) -> MetricSpec:
    return MetricSpec(key, "gauge", doc)


METRICS: tuple[MetricSpec, ...] = (
    _c("requests", "Requests started with the hybrid cache on (counted when first scheduled)."),
    _c("prompt_tokens", "Prompt tokens of the started requests."),
    _c("hit_tokens", "Prompt tokens served from the cache (KV and a state at the same position)."),
    _c("snapshot_hits", "Started requests that resumed from a cached state snapshot."),
    _c("snapshot_misses", "Started requests that found no state snapshot to resume from."),
    _c("junction_tokens", "Cached KV tokens past the state hit (recomputed: no state there)."),
    _c("prefill_flops", "Prefill FLOPs of the started prompts without caching (cost model)."),
    _c("prefill_flops_saved", "Prefill FLOPs the hits saved (cost model)."),
    _c("kv_pages_cached", "KV pages that entered the prefix cache."),
    _c("kv_pages_evicted", "KV pages that left the prefix cache (eviction or reset)."),
    _c("snapshot_pages_cached", "State snapshot pages that entered the prefix cache (taken)."),
    _c("snapshot_pages_evicted", "State snapshot pages that left the prefix cache."),
    _c("policy_evicted_pages", "Cached pages the eviction policy chose as victims."),
    _c("lru_fallback_pages", "Cached pages reused in LRU order (the policy freed too few)."),
    _c("eviction_batches", "Times the policy was asked for victims."),
    _c(
        "snapshot_budget_evicted_pages",
        "Cached pages dropped to keep free snapshots within max_snapshot_fraction of the pool.",
    ),
    _g("kv_pages", "KV pages held in the prefix cache now."),
    _g("snapshot_pages", "State snapshot pages held in the prefix cache now."),
    _g("kv_bytes", "Device bytes of the KV pages held in the prefix cache now."),
    _g("snapshot_bytes", "Device bytes of the state snapshot pages held now."),
    # Pins and breakpoints (core/pins.py, adapters/vllm/cache_control.py; docs/serving.md).
    _g("pins", "Prefixes pinned now (prewarm / cache_pin_ttl_s)."),
    _g("pinned_pages", "Pool pages (KV and state) held by pins now."),
    _g("pin_limit_pages", "Most pages pins may hold at once (max_pinned_fraction of the pool)."),
    _g("pin_ttl_left_seconds_max", "Seconds until the last pin expires (0: no pin)."),
    _g("pin_ttl_left_seconds_min", "Seconds until the next pin expires (0: no pin)."),
    _c("pins_taken", "Pins taken."),
    _c("pins_extended", "Pins whose TTL a repeated pin of the same prefix extended."),
    _c("pins_refused", "Pins refused (over the limit, TTL too long, nothing cached)."),
    _c("pins_expired", "Pins released at the end of their TTL."),
    _c("breakpoint_stops", "Prefill chunks ended at a request's cache breakpoint."),
    _c(
        "sibling_waits",
        "Scheduler steps a waiting request waited for a running one to keep the state where "
        "their prompts diverge (sibling_wait).",
    ),
    # End-of-output states (adapters/vllm/output_states.py::OutputStates; docs/block_manager.md).
    _c("output_states_kept", "States kept at the end of an answer (block boundary or exact end)."),
    _c("output_states_dropped", "Kept answer-end states dropped when the answer went on."),
    # The host tier (core/host_ledger.py; docs/host_tier.md); 0 while it is off.
    _c("host_demotes", "State snapshots copied to the host tier (evicted alone, KV kept)."),
    _c("host_promotes", "Host snapshots copied back for a waiting request (host hits)."),
    _c("host_drops", "Host snapshots dropped: host full, KV gone, or state cached again."),
    _g("host_snapshots", "State snapshots on the host tier now."),
    _g("host_bytes", "Host memory bytes of the snapshots on the host tier now."),
)
COUNTERS: frozenset[str] = frozenset(m.key for m in METRICS if m.kind == "counter")


class PageCounts:
    """Pages cached and evicted per kind, from the engine's hash-map changes.

    Invariants (:meth:`check_integrity`):

    1. ``evicted[k] <= cached[k]`` for each kind; ``held(k) = cached[k] - evicted[k]``.
    2. Every counted group is one of the KV or state groups given at construction.
    """

    def __init__(self, kv_groups: Collection[int], state_groups: Collection[int]) -> None:
        self._kind: dict[int, Kind] = {g: KV for g in kv_groups}
        self._kind.update({g: SNAPSHOT for g in state_groups})
        self.cached: dict[Kind, int] = {KV: 0, SNAPSHOT: 0}
        self.evicted: dict[Kind, int] = {KV: 0, SNAPSHOT: 0}

    def kind_of(self, group: int) -> Kind:
        kind = self._kind.get(group)
        if kind is None:
            raise ValueError(f"group {group} is neither a KV nor a state group")
        return kind

    def on_cached(self, group: int) -> None:
        """A page of ``group`` that held nothing became cached."""
        self.cached[self.kind_of(group)] += 1

    def on_dropped(self, group: int) -> None:
        """A cached page of ``group`` lost its last hash."""
        self.evicted[self.kind_of(group)] += 1

    def on_reset(self) -> None:
        """The engine dropped every cached page at once: all count as evicted."""
        self.evicted.update(self.cached)

    def held(self, kind: Kind) -> int:
        return self.cached[kind] - self.evicted[kind]

    def check_integrity(self) -> None:
        for kind in (KV, SNAPSHOT):
            assert 0 <= self.evicted[kind] <= self.cached[kind], f"inv 1: {kind} {self!r}"

    def __repr__(self) -> str:
        return f"PageCounts(cached={self.cached}, evicted={self.evicted})"


def engine_totals(
    feed: FeedCounters | None,
    pages: PageCounts,
    *,
    page_bytes: int,
    policy_pages: int,
    fallback_pages: int,
    eviction_batches: int,
    budget_pages: int = 0,
) -> dict[str, float]:
    """One snapshot of every :data:`METRICS` key (``page_bytes``: device bytes of one page;
    0 where the engine did not say, then the byte gauges read 0)."""
    f = feed if feed is not None else FeedCounters()
    return {
        "requests": f.requests,
        "prompt_tokens": f.prompt_tokens,
        "hit_tokens": f.hit_tokens,
        "snapshot_hits": f.state_hits,
        "snapshot_misses": f.state_misses,
        "junction_tokens": f.junction_tokens,
        "prefill_flops": f.flops_total,
        "prefill_flops_saved": f.flops_saved,
        "kv_pages_cached": pages.cached[KV],
        "kv_pages_evicted": pages.evicted[KV],
        "snapshot_pages_cached": pages.cached[SNAPSHOT],
        "snapshot_pages_evicted": pages.evicted[SNAPSHOT],
        "policy_evicted_pages": policy_pages,
        "lru_fallback_pages": fallback_pages,
        "eviction_batches": eviction_batches,
        "snapshot_budget_evicted_pages": budget_pages,
        "kv_pages": pages.held(KV),
        "snapshot_pages": pages.held(SNAPSHOT),
        "kv_bytes": pages.held(KV) * page_bytes,
        "snapshot_bytes": pages.held(SNAPSHOT) * page_bytes,
    }


class CounterDeltas:
    """Per engine, the increment of each counter since the last snapshot. A total below the
    last one means the engine restarted: its new total is the increment."""

    def __init__(self) -> None:
        self._last: dict[int, dict[str, float]] = {}

    def update(self, engine: int, totals: Mapping[str, float]) -> dict[str, float]:
        last = self._last.setdefault(engine, {})
        out: dict[str, float] = {}
        for key in COUNTERS:
            value = float(totals.get(key, 0.0))
            before = last.get(key, 0.0)
            out[key] = value - before if value >= before else value
            last[key] = value
        return out
