"""The scheduler side of the engine's host tier: which snapshot sits in which host slot, and
the copies the worker must make this step (docs/host_tier_engine.md).

Pure Python (no torch, no vLLM), so it lives in ``core/`` and is tested without an engine. The
engine glue is in ``adapters/vllm/block_pool.py`` (:meth:`HybridBlockPool.hy_promote`, which
allocates and caches the blocks a promoted snapshot goes to) and
``adapters/vllm/host_connector.py`` (which ships :meth:`HostLedger.take_ops` to the worker in
the connector metadata, and whose worker half copies the bytes).

What it decides, through the :class:`~vllm_hybrid.core.index.PrefixIndex` hooks:

* **demote**: the policy evicts a full-block snapshot *alone* (its KV stays on the device):
  the state's pages are copied to a free host slot before the step reuses them. The
  :class:`~vllm_hybrid.core.host_tier.HostTier` makes room first by dropping the host
  snapshots the policy ranked lowest;
* **discard**: the engine no longer holds any page under the key (its KV left the device), or
  the device caches the state again (superseded): the host copy is dropped, its slot freed;
* **promote**: a waiting request whose usable prefix ends deeper on a host snapshot than on
  any device one gets the snapshot copied back into fresh blocks (see ``block_pool.py``).

The copies are one ordered list per step (:data:`DEMOTE` / :data:`PROMOTE`, slot, one block per
Mamba group). The worker runs them in this order, before the step writes any block
(``handle_preemptions``), so every order reads what it must: a demote reads its block before
this step's zeroing or forward overwrites it; a promote from a slot that a demote of the same
step filled runs after that demote; a slot freed by a promote and refilled later in the same
step is refilled after the promote read it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from vllm_hybrid.core.host_tier import HostTier, HostTierError

if TYPE_CHECKING:
    from vllm_hybrid.core.index import PrefixIndex
    from vllm_hybrid.core.node import Node

DEMOTE, PROMOTE = 0, 1
#: (DEMOTE or PROMOTE, host slot, one block id per Mamba group in group order)
HostOp = tuple[int, int, tuple[int, ...]]

#: Host <-> device bandwidth the policy assumes when it ranks states that have a host place
#: (``HostTier.device_flops_per_byte``); the simulator's default (docs/host_tier.md).
DEFAULT_HOST_BANDWIDTH = 25e9


def host_slots(budget_bytes: int, snapshot_bytes: int) -> int:
    """How many snapshots of ``snapshot_bytes`` (all Mamba layers) a host budget holds."""
    if snapshot_bytes <= 0:
        raise ValueError(f"snapshot_bytes must be > 0, got {snapshot_bytes}")
    return max(0, budget_bytes // snapshot_bytes)


class SlottedHostTier(HostTier):
    """A :class:`HostTier` whose every snapshot occupies one slot of the worker's buffers."""

    def __init__(self, num_slots: int, snapshot_bytes: int, bandwidth: float) -> None:
        if num_slots <= 0:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        super().__init__(num_slots * snapshot_bytes, bandwidth)
        self.attach(snapshot_bytes)
        self.num_slots = num_slots
        self.slot_of: dict[Hashable, int] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first

    def demote(self, node: Node, priority: float) -> bool:
        if not super().demote(node, priority):  # drops the lowest first (their slots free)
            return False
        self.slot_of[node.key] = self._free_slots.pop()
        return True

    def _remove(self, key: Hashable) -> None:  # every way out: take, discard, drop
        super()._remove(key)
        self._free_slots.append(self.slot_of.pop(key))

    def keys(self) -> list[Hashable]:
        return list(self._held)

    def check_slots(self) -> None:
        held, slots = set(self._held), self.slot_of
        if set(slots) != held or len(set(slots.values())) != len(slots):
            raise HostTierError(f"host slots out of sync: {len(slots)} slots, {len(held)} held")
        if sorted([*slots.values(), *self._free_slots]) != list(range(self.num_slots)):
            raise HostTierError("host slots lost or duplicated")


class HostLedger:
    """Owns the engine's host tier; hooks itself into ``mirror`` (and binds the policy)."""

    def __init__(
        self,
        mirror: PrefixIndex,
        num_slots: int,
        snapshot_bytes: int,
        bandwidth: float = DEFAULT_HOST_BANDWIDTH,
    ) -> None:
        self.mirror = mirror
        self.tier = SlottedHostTier(num_slots, snapshot_bytes, bandwidth)
        self.state_groups = sorted(mirror.state_groups)
        self.block_tokens = mirror.block_tokens
        self._ops: list[HostOp] = []
        self.aborted = 0  # promotions given up (the allocation evicted the path they needed)
        mirror.on_snapshot_evicted = self._on_snapshot_evicted
        mirror.on_entry_deleted = self._on_entry_deleted
        mirror.on_snapshot_added = self._on_snapshot_added
        bind = getattr(mirror.policy, "bind_host", None)
        if bind is not None:  # host-aware policies (flop) rank states that have a host place
            bind(self.tier)

    # ---------------------------------------------------------------- mirror hooks
    def _on_snapshot_evicted(self, node: Node, pages: dict[int, list[int]], prio: float) -> None:
        if node.n_tokens != self.block_tokens:
            return  # a partial block's state (a prompt end): not kept on the host
        if not self.tier.demote(node, prio):
            return
        blocks = tuple(pages[g][0] for g in self.state_groups)
        self._ops.append((DEMOTE, self.tier.slot_of[node.key], blocks))

    def _on_entry_deleted(self, key: Hashable) -> None:
        self.tier.discard(key)  # its KV left the device: the state alone is useless

    def _on_snapshot_added(self, node: Node) -> None:
        self.tier.discard(node.key, superseded=True)  # one tier at a time

    # ---------------------------------------------------------------- promotion
    def find_promotion(
        self, key_at: Callable[[int], Hashable], num_tokens: int
    ) -> tuple[Node, int] | None:
        """The host snapshot a request of ``num_tokens`` tokens should resume from, and where
        it ends: walking the request's full blocks from the deepest a hit may reach
        (``num_tokens - 1``, as ``KVCacheManager.get_computed_blocks``) up, the first entry with
        a snapshot decides; only a host one whose entry is live (the KV of its whole prefix is
        on the device) is returned. ``key_at(end)``: the request's block hash ending at ``end``."""
        if not len(self.tier):
            return None
        b, mirror, tier = self.block_tokens, self.mirror, self.tier
        for end in range((num_tokens - 1) // b * b, 0, -b):
            node = mirror.live_node(key_at(end))
            if node is None:
                continue
            if node.has_snapshot:
                return None  # the device already resumes here or deeper
            if tier.holds(node):
                return node, end
        return None

    def promote(self, node: Node, blocks: Sequence[int]) -> int:
        """``node``'s snapshot goes back to the device, into ``blocks`` (one per Mamba group),
        which the caller caches under ``node``'s key right after. Returns the slot read."""
        if len(blocks) != len(self.state_groups):
            raise ValueError(f"one block per Mamba group {self.state_groups}, got {blocks}")
        slot = self.tier.slot_of[node.key]
        self.tier.take(node)  # before the blocks are cached (which would supersede it)
        self._ops.append((PROMOTE, slot, tuple(blocks)))
        return slot

    # ---------------------------------------------------------------- the step's copies
    def take_ops(self) -> list[HostOp]:
        """This step's copies, in order; the ledger forgets them."""
        ops, self._ops = self._ops, []
        return ops

    def clear(self) -> None:
        """The engine reset its prefix cache: every host snapshot goes (pending copies stay:
        they are harmless and keep the slots' order)."""
        for key in self.tier.keys():
            self.tier.discard(key)

    # ---------------------------------------------------------------- observability
    @property
    def num_slots(self) -> int:
        return self.tier.num_slots

    @property
    def bytes_used(self) -> int:
        return self.tier.used_bytes

    def check_integrity(self) -> None:
        """The host tier's invariants (H1, H2) against the mirror, and the slot map."""
        tier = self.tier
        by_key = {}
        for key in tier.keys():
            node = self.mirror.node_of(key)
            if node is not None:
                by_key[key] = node
        tier.check(by_key, self.block_tokens)
        tier.check_slots()
