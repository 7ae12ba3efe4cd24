"""The simulator's service-time model: an engine's prefills, first in first out, at a stated
device throughput, so a hit rate becomes the time to first token it implies.

A request arrives at ``arrival_s`` (the trace's), starts its prefill at ``max(arrival, the
previous prefill's end)`` and takes ``flops / throughput`` seconds for the prefill FLOPs its hit
did not save (``CostModel.span_flops(hit, prompt)``), plus ``extra_s`` (a host-tier hit's
transfer back to the device, which the prefill waits for). TTFT = the prefill's end - arrival,
queueing included: requests overlap in time as an engine's do, and a hit shortens the wait of
every request queued behind it. Decode is not modelled here (batched, it overlaps the prefills,
as chunked prefill mixes them; the cluster simulation adds its time to a request's stay).
Used by the single-engine replay (``sim/replay.py``) and by each replica of the cluster
simulation (``sim/cluster.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: prefill FLOP/s one engine sustains: H100-class, ~40% of its dense bf16 peak
DEFAULT_THROUGHPUT = 4e14
#: seconds per generated token of one request (50 tokens/s; the cluster simulation)
DEFAULT_DECODE_S = 0.02


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``values`` by nearest rank (0.0 when empty)."""
    if not values:
        return 0.0
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


class PrefillQueue:
    """One engine's prefill server: FIFO at ``throughput_flops`` FLOP/s."""

    def __init__(self, throughput_flops: float = DEFAULT_THROUGHPUT) -> None:
        if not throughput_flops > 0:
            raise ValueError(f"the prefill throughput must be > 0 FLOP/s, got {throughput_flops}")
        self.throughput_flops = throughput_flops
        self.free_at = 0.0  # when the prefill before the next one ends
        self.busy_s = 0.0  # prefill time served so far

    def serve(self, arrival_s: float, flops: float, extra_s: float = 0.0) -> float:
        """Queue one prefill of ``flops`` (plus ``extra_s`` of transfer); returns its TTFT."""
        took = flops / self.throughput_flops + extra_s
        self.free_at = max(arrival_s, self.free_at) + took
        self.busy_s += took
        return self.free_at - arrival_s

    def backlog_flops(self, now_s: float) -> float:
        """Prefill work queued ahead of a request arriving at ``now_s``, in FLOPs."""
        return max(0.0, self.free_at - now_s) * self.throughput_flops
