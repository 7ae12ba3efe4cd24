"""A second tier for state snapshots: host memory (DRAM), behind the device's prefix index.

A state snapshot is tens of MB on a 7B hybrid model, and device memory is what the cache runs
short of. When the policy evicts a snapshot *alone* (its KV stays on the device because other
entries below it still use that KV: an interior checkpoint, a branch point), the snapshot is not
lost but **demoted**: copied to the host tier, off the critical path (a side stream on CUDA).
A later request whose longest usable prefix ends on a host snapshot gets a **host hit**: the state
is copied back (**promoted**, on the critical path: ``snapshot_bytes / bandwidth`` seconds) and
the prefix is skipped as for a device hit.

What the tier holds, and why only that:

* only snapshots whose KV is still in the device index. A hybrid model resumes from a state *and*
  the attention KV of the whole prefix; a host state whose KV was evicted is useless, so when the
  index evicts a block's KV it also drops the host copy (``invalidated``);
* a node's state is in one tier at a time: promotion removes the host copy, and a fresh device
  snapshot of the same node (a later request takes it again) supersedes it.

Which host snapshot goes when the host budget is full: the one the device policy ranked lowest
when it evicted it (the same compute-saved-per-byte priority; entries the policy saw as less
valuable leave the host first). The tier never holds more than ``budget_bytes`` (checked by
:meth:`check`, not even transiently: room is made before a demotion is accepted).

Pure Python, no torch and no vLLM: the simulator runs it, an engine adapter would move the bytes.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_hybrid.core.node import Node


class HostTierError(AssertionError):
    """An invariant of the host tier does not hold (a bug, never bad user input)."""


class HostTier:
    """Snapshots demoted from the device index, under their own byte budget."""

    def __init__(
        self, budget_bytes: int, bandwidth_bytes_per_s: float, device_flops: float = 4e14
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host budget must be >= 0 bytes, got {budget_bytes}")
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"host bandwidth must be > 0 bytes/s, got {bandwidth_bytes_per_s}")
        if not device_flops > 0:
            raise ValueError(f"device FLOP/s must be > 0, got {device_flops}")
        self.budget_bytes = budget_bytes
        self.bandwidth = float(bandwidth_bytes_per_s)
        #: The exchange rate between the tiers: prefill FLOPs the device does while one byte
        #: crosses the link. A device state that has a place on the host is worth this per
        #: byte (the transfer a hit would otherwise wait for); a policy compares it with the
        #: FLOPs per byte of KV it would otherwise evict.
        self.device_flops_per_byte = device_flops / self.bandwidth
        self.snapshot_bytes = 0  # set by the index that owns the tier (attach)
        self.used_bytes = 0
        self.peak_bytes = 0
        # key -> (node, priority, seq); the heap holds (priority, seq, key), stale ones skipped
        self._held: dict[Hashable, tuple[Node, float, int]] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = 0
        self.demoted = 0  # snapshots copied device -> host
        self.promoted = 0  # host hits copied back host -> device (on the critical path)
        self.dropped = 0  # host snapshots evicted to make room in the host budget
        self.invalidated = 0  # host snapshots dropped because their KV left the device
        self.superseded = 0  # host snapshots dropped because the device took the state again

    def attach(self, snapshot_bytes: int) -> None:
        """Called by the owning index: every snapshot it holds has this size."""
        if snapshot_bytes < 0:
            raise ValueError("snapshot_bytes must be >= 0")
        self.snapshot_bytes = snapshot_bytes

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._held)

    def holds(self, node: Node) -> bool:
        entry = self._held.get(node.key)
        return entry is not None and entry[0] is node

    @property
    def promoted_bytes(self) -> int:
        return self.promoted * self.snapshot_bytes

    @property
    def demoted_bytes(self) -> int:
        return self.demoted * self.snapshot_bytes

    @property
    def promote_seconds(self) -> float:
        """Transfer time of every promotion so far (each is on a request's critical path)."""
        return self.promoted_bytes / self.bandwidth

    def transfer_seconds(self, n_snapshots: int = 1) -> float:
        return n_snapshots * self.snapshot_bytes / self.bandwidth

    # ----------------------------------------------------------------- commits
    def demote(self, node: Node, priority: float) -> bool:
        """Keep ``node``'s state, just evicted from the device alone (its KV stays). Makes room
        by dropping the lowest-priority host snapshots; False if it cannot fit at all."""
        if self.snapshot_bytes > self.budget_bytes:
            return False
        if node.key in self._held:
            raise ValueError(f"{node!r} is already on the host")
        while self.used_bytes + self.snapshot_bytes > self.budget_bytes:
            self._drop_lowest()
        self._seq += 1
        self._held[node.key] = (node, priority, self._seq)
        heapq.heappush(self._heap, (priority, self._seq, node.key))
        self.used_bytes += self.snapshot_bytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        self.demoted += 1
        return True

    def take(self, node: Node) -> float:
        """A host hit: the state goes back to the device (the caller admits it there).
        Returns the priority it was demoted with (to demote it again if the device is full)."""
        priority = self._held[node.key][1]
        self._remove(node.key)
        self.promoted += 1
        return priority

    def discard(self, key: Hashable, *, superseded: bool = False) -> bool:
        """Drop the host copy of ``key`` if held (its KV left the device, or the device holds
        the state again); returns whether one was held."""
        if key not in self._held:
            return False
        self._remove(key)
        if superseded:
            self.superseded += 1
        else:
            self.invalidated += 1
        return True

    def _remove(self, key: Hashable) -> None:
        del self._held[key]  # its heap entry goes stale (seq no longer matches)
        self.used_bytes -= self.snapshot_bytes
        if len(self._heap) > 4 * (len(self._held) + 64):
            self._heap = [(p, s, k) for p, s, k in self._heap if self._live(k, s)]
            heapq.heapify(self._heap)

    def _live(self, key: Hashable, seq: int) -> bool:
        entry = self._held.get(key)
        return entry is not None and entry[2] == seq

    def _drop_lowest(self) -> None:
        while self._heap:
            _, seq, key = heapq.heappop(self._heap)
            if self._live(key, seq):
                self._remove(key)
                self.dropped += 1
                return
        raise HostTierError("host tier over budget with nothing to drop")

    # ----------------------------------------------------------------- integrity
    def check(self, by_key: dict[Hashable, Node], block_tokens: int) -> None:
        """Host invariants, given the device index's live key map:

        H1. every host snapshot belongs to a live, full-block node of the index that holds no
            device snapshot (one tier at a time; its KV, and its whole prefix's, is on device);
        H2. ``used_bytes == len * snapshot_bytes <= peak_bytes <= budget_bytes``.
        """
        for key, (node, _, _) in self._held.items():
            ok = by_key.get(key) is node and node.alive and not node.has_snapshot
            if not ok or node.n_tokens != block_tokens:
                raise HostTierError(f"invariant H1 violated: host holds {node!r}")
        used = len(self._held) * self.snapshot_bytes
        if used != self.used_bytes or not used <= self.peak_bytes <= self.budget_bytes:
            raise HostTierError(
                f"invariant H2 violated: used {self.used_bytes} (held {used}), "
                f"peak {self.peak_bytes}, budget {self.budget_bytes}"
            )
