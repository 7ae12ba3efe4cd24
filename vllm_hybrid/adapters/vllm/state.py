"""``HybridState``: everything the hybrid cache keeps for one engine, in one object.

:func:`~vllm_hybrid.adapters.vllm.block_pool.install` creates it and puts it on the swapped
pool as ``pool.hybrid``; the scheduler's ``activate()`` fills in what it builds (the feed, the
host tier, the byte size of a page, the debug flag, the extra counters). Stdlib and core only;
nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_hybrid.core import HostLedger, PageCounts, PrefixIndex, RequestFeed


@dataclass(slots=True, eq=False)
class HybridState:
    """One engine's hybrid cache. Who writes what:

    * the pool (``block_pool.py``): ``mirror`` (through its methods), ``pages`` and the four
      counters, ``request``/``quiet``/``promoted`` while one of its calls runs;
    * the scheduler (``scheduler.py``): ``origin`` (its requests' feed indexes) and, once at
      activation, ``feed``, ``debug``, ``block_bytes``, ``host`` and ``extra_totals``;
    * ``metrics.py`` reads it for ``/metrics``.
    """

    #: the core's index of the pool's cached pages (the policy ranks its units)
    mirror: PrefixIndex
    #: pages cached / evicted by kind (KV, snapshot), for the metrics
    pages: PageCounts
    #: the last 4 bytes of a ``BlockHashWithGroupId`` -> group id (a faster ``get_group_id``)
    group_of: dict[bytes, int]
    #: the policy's learning from started requests
    feed: RequestFeed | None = None
    #: the host tier (``host_tier_gb > 0``), else None
    host: HostLedger | None = None
    #: integrity checks after every step (``debug`` setting)
    debug: bool = False
    #: bytes of one block in all groups (for the byte gauges)
    block_bytes: int = 0
    #: the cache control's and end-of-output states' counters for ``/metrics``
    extra_totals: list[Callable[[], dict[str, float]]] = field(default_factory=list)
    #: pages evicted in the policy's order, from vLLM's LRU head (fallback), eviction calls,
    #: pages dropped for the snapshot budget (``max_snapshot_fraction``)
    policy_pages: int = 0
    fallback_pages: int = 0
    evict_calls: int = 0
    budget_pages: int = 0
    #: request id -> its index in the feed, while it runs
    origin: dict[str, int] = field(default_factory=dict)
    #: blocks of this step's host promotions, held until the step's copies are shipped
    promoted: list[Any] = field(default_factory=list)
    #: the request whose blocks ``cache_full_blocks``/``cache_partial_block`` cache right now
    request: Any = None
    #: True while ``move_block_hashes`` re-points keys (the mirror moves the page at once)
    quiet: bool = False

    def totals_extra(self) -> dict[str, float]:
        """The extra counters merged (``metrics.hybrid_totals``)."""
        return {key: value for totals in self.extra_totals for key, value in totals().items()}
