"""The hybrid cache's metrics on vLLM's stats path, exported on ``/metrics`` (vLLM 0.32.0).

How scheduler numbers reach ``/metrics`` in vLLM 0.32.0, and where we hook in:

1. Engine core: ``Scheduler.make_stats`` (``vllm/v1/core/sched/scheduler.py``) builds a
   ``SchedulerStats`` each step; our scheduler's ``make_stats`` calls
   :func:`attach_hybrid_stats`, which stores the pool's totals (``core/cache_stats.py``) in
   ``stats.vllm_hybrid``.
2. Transport: the stats ride in ``EngineCoreOutputs.scheduler_stats`` (``vllm/v1/engine/
   __init__.py``), msgpack-encoded by ``vllm/v1/serial_utils.py`` when the engine core is
   another process. msgspec encodes a dataclass's declared fields only, so an extra attribute
   would be lost: :func:`carry_hybrid_stats` declares the one optional field ``vllm_hybrid``
   on ``SchedulerStats`` (``vllm/v1/metrics/stats.py``). It must run before the frontend
   builds its decoder (``MsgpackDecoder(EngineCoreOutputs)`` in ``core_client.py``), so the
   general plugin's ``register()`` runs it in every process. A side without the field ignores
   it (stats are encoded as a map), so mixed versions cannot break the stats path.
3. Frontend: ``AsyncLLM`` (``vllm serve``) loads the ``vllm.stat_logger_plugins`` entry points
   (``vllm/v1/metrics/loggers.py::load_stat_logger_plugin_factories``) and hands every
   ``SchedulerStats`` to each logger's ``record``; :class:`HybridStatLogger` is ours. It
   registers ``vllm_hybrid:*`` metrics in prometheus_client's default registry, which the API
   server's ``/metrics`` serves next to vLLM's own. The offline ``LLMEngine`` takes it as
   ``stat_loggers=[HybridStatLogger]``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from vllm_hybrid.adapters.vllm.compat.patches import declare_scheduler_stats_field
from vllm_hybrid.core import METRICS, PREFIX, CounterDeltas, engine_totals

logger = logging.getLogger("vllm_hybrid")

#: The field of vLLM's ``SchedulerStats`` that carries our totals.
FIELD = "vllm_hybrid"


def carry_hybrid_stats() -> bool:
    """Declare ``SchedulerStats.vllm_hybrid`` (``dict[str, float] | None``, default None, not
    an ``__init__`` argument; ``compat.declare_scheduler_stats_field``) so that msgspec carries
    it from the engine core to the frontend. Idempotent; refused on another vLLM version. Call
    it before any engine is built."""
    return declare_scheduler_stats_field(FIELD)


def block_bytes(kv_cache_config: Any) -> int:
    """Device bytes one pool page (block id) holds, whichever group (KV or snapshot) uses it.

    In vLLM 0.32.0 every group's ``KVCacheTensor`` spans the same buffer from byte 0
    (``vllm/v1/core/kv_cache_utils.py::get_kv_cache_config_from_groups``: ``size =
    bytes_per_block * num_blocks`` for each, aliased), so one tensor's size over
    ``num_blocks`` is the bytes of a block: the page size of a group's layers summed, padded.
    """
    sizes = [t.size for t in kv_cache_config.kv_cache_tensors]
    return int(max(sizes, default=0) // max(1, kv_cache_config.num_blocks))


def hybrid_totals(pool: Any) -> dict[str, float]:
    """The totals of one ``HybridBlockPool`` (``block_pool.py``; its ``HybridState``), keys =
    ``METRICS`` keys, with the pins', breakpoints' and end-of-output states'
    (``HybridState.extra_totals``, set by the scheduler) where present."""
    state = pool.hybrid
    return {**_pool_totals(state), **host_totals(state.host), **state.totals_extra()}


def host_totals(ledger: Any) -> dict[str, float]:
    """The host tier's counters (``host_ledger.HostLedger``; zeros while the tier is off)."""
    if ledger is None:
        keys = ("host_demotes", "host_promotes", "host_drops", "host_snapshots", "host_bytes")
        return dict.fromkeys(keys, 0.0)
    tier = ledger.tier
    return {
        "host_demotes": tier.demoted,
        "host_promotes": tier.promoted,
        "host_drops": tier.dropped + tier.invalidated + tier.superseded,
        "host_snapshots": len(tier),
        "host_bytes": tier.used_bytes,
    }


def _pool_totals(state: Any) -> dict[str, float]:
    feed = state.feed
    return engine_totals(
        feed.counters if feed is not None else None,
        state.pages,
        page_bytes=state.block_bytes,
        policy_pages=state.policy_pages,
        fallback_pages=state.fallback_pages,
        eviction_batches=state.evict_calls,
        budget_pages=state.budget_pages,
    )


def attach_hybrid_stats(pool: Any, stats: Any) -> None:
    """Put ``pool``'s totals on one ``SchedulerStats`` (from ``_HybridMixin.make_stats``)."""
    setattr(stats, FIELD, hybrid_totals(pool))


def hybrid_stats_of(scheduler_stats: Any) -> Mapping[str, float] | None:
    """Our totals on a ``SchedulerStats`` (None: a stock engine or an older message)."""
    return getattr(scheduler_stats, FIELD, None)


#: The collectors our loggers registered in prometheus_client's default registry.
_COLLECTORS: list[Any] = []


def unregister_hybrid_metrics() -> None:
    """Drop the ``vllm_hybrid:`` collectors registered before, as ``vllm/v1/metrics/
    prometheus.py::unregister_vllm_metrics`` does for ``vllm:`` (a new logger per engine in one
    process). We keep our own list rather than read the registry's private map."""
    while _COLLECTORS:
        collector = _COLLECTORS.pop()
        try:
            REGISTRY.unregister(collector)
        except KeyError:  # unregistered by someone else already
            pass


class HybridStatLogger(AggregateStatLoggerBase):
    """Exports the hybrid cache's totals as Prometheus metrics labelled like vLLM's
    (``model_name``, ``engine``); entry point ``vllm.stat_logger_plugins: vllm_hybrid``."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        self.engine_indexes = engine_indexes if engine_indexes is not None else [0]
        model_name = vllm_config.model_config.served_model_name
        unregister_hybrid_metrics()
        self.deltas = CounterDeltas()
        self.counters: dict[str, dict[int, Any]] = {}
        self.gauges: dict[str, dict[int, Any]] = {}
        labels = ["model_name", "engine"]
        for spec in METRICS:
            name = PREFIX + spec.key
            if spec.kind == "counter":
                metric: Any = Counter(name, spec.doc, labels)
                target = self.counters
            else:
                metric = Gauge(name, spec.doc, labels, multiprocess_mode="mostrecent")
                target = self.gauges
            _COLLECTORS.append(metric)
            target[spec.key] = {
                i: metric.labels(model_name=model_name, engine=str(i)) for i in self.engine_indexes
            }
        self.last: dict[int, Mapping[str, float]] = {}

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        totals = hybrid_stats_of(scheduler_stats)
        if totals is None or engine_idx not in self.engine_indexes:
            return
        self.last[engine_idx] = totals
        for key, delta in self.deltas.update(engine_idx, totals).items():
            if delta:
                self.counters[key][engine_idx].inc(delta)
        for key, gauge in self.gauges.items():
            gauge[engine_idx].set(totals.get(key, 0.0))

    def log_engine_initialized(self) -> None:
        """Nothing to print: the metrics are scraped, not logged."""
