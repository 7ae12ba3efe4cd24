"""A mirror of an engine's page pool as a prefix trie, so that a policy picks eviction victims.

An engine with a fixed page pool (vLLM's ``BlockPool``) caches pages under chained block hashes,
one entry per (key, group): *KV groups* (attention) hold the KV of block ``[end - B, end)``,
*state groups* (Mamba) hold the recurrent state at ``end``. The engine owns the pages, their
reference counts and its hash map; :class:`PoolMirror` only mirrors which page holds which
(key, group), and answers one question: *which free cached pages should go first?*

The adapter reports every change of the engine's hash map (:meth:`add`, :meth:`drop_page`,
:meth:`move_page`, :meth:`clear`) and every hit (:meth:`touch_pages`); :meth:`pick_victims`
then ranks by the same policy objects the simulator runs (``core/policies.py``):

* an *entry* is one key; its :class:`~vllm_hybrid.core.node.Node` carries the policy's
  statistics (hits, last access) for as long as the engine holds any page under the key;
* an entry is *live* when every KV group holds a page for it and its parent entry is live
  (vLLM's attention hit is a contiguous prefix; a state past a gap cannot be resumed);
* a live entry *has a snapshot* when every state group holds a page for it.

Victims, in this order: free pages of entries that are not live (nothing can hit them), free
duplicate pages of a (key, group) that another page also holds, then policy units: a KV unit
(the entry with its whole live subtree, snapshots included) or a snapshot unit (the state
pages only). A unit with any page in use (``is_free(page)`` false) is never chosen, so neither
is any page with ``ref_cnt > 0``.

Invariants (asserted by :meth:`check_integrity`):

1. ``_page_keys`` and the entries' ``pages`` are inverse maps: ``(key, group)`` is in
   ``_page_keys[page]`` iff ``page`` is in ``_entries[key].pages[group]``; no empty set or
   entry is stored.
2. An entry's node has ``key`` as its key and spans ``(start, end]`` with ``end > 0``,
   ``start = end - block_tokens`` for a full block, else the block boundary below ``end``.
3. Every group of every stored page is a KV group or a state group.
4. ``pages_victimized`` counts every page :meth:`pick_victims` returned; none was in use.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass, field

from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policy import EvictionPolicy

PageKey = tuple[Hashable, int]
IsFree = Callable[[int], bool]
_Heap = list[tuple[float, int, int, Node, int]]
_KV, _SNAP = 0, 1


@dataclass
class _Entry:
    """One key: the node the policy ranks, and the engine pages holding it per group."""

    node: Node
    parent_key: Hashable | None
    pages: dict[int, set[int]] = field(default_factory=dict)


@dataclass
class VictimStats:
    """Counts of what :meth:`PoolMirror.pick_victims` chose, by reason."""

    dead_pages: int = 0
    duplicate_pages: int = 0
    kv_units: int = 0
    snapshot_units: int = 0
    pages: int = 0


class PoolMirror:
    """Which page holds which (key, group) of an engine's prefix cache, and who goes first."""

    def __init__(
        self,
        *,
        block_tokens: int,
        kv_groups: Collection[int],
        state_groups: Collection[int],
        policy: EvictionPolicy,
        kv_bytes_per_token: int = 1,
    ) -> None:
        if block_tokens <= 0 or not kv_groups or set(kv_groups) & set(state_groups):
            raise ValueError("block_tokens > 0, at least one KV group, disjoint group sets")
        self.block_tokens = block_tokens
        self.kv_groups = frozenset(kv_groups)
        self.state_groups = frozenset(state_groups)
        self.policy = policy
        self.kv_bytes_per_token = kv_bytes_per_token
        self.root = Node(None, None, 0, 0, 0)
        self.now = 0
        self.stats = VictimStats()
        self._entries: dict[Hashable, _Entry] = {}
        self._page_keys: dict[int, set[PageKey]] = {}
        self._seq = 0

    # ----------------------------------------------------------------- engine events
    def tick(self) -> int:
        """Advance the logical clock (the adapter calls it once per scheduler step)."""
        self.now += 1
        return self.now

    def add(
        self, page: int, key: Hashable, group: int, end_tokens: int, parent_key: Hashable | None
    ) -> None:
        """The engine cached ``page`` under ``(key, group)``; ``key`` ends at ``end_tokens``."""
        if group not in self.kv_groups and group not in self.state_groups:
            raise ValueError(f"group {group} is neither a KV nor a state group")
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(key, end_tokens, parent_key)
        pages = entry.pages.setdefault(group, set())
        if page not in pages:
            pages.add(page)
            self._page_keys.setdefault(page, set()).add((key, group))
        if group in self.state_groups:
            entry.node.snap_access = self.now
        entry.node.last_access = self.now

    def _new_entry(self, key: Hashable, end: int, parent_key: Hashable | None) -> _Entry:
        if end <= 0:
            raise ValueError(f"an entry ends after token 0, got {end}")
        b = self.block_tokens
        start = end - b if end % b == 0 else end // b * b
        node = Node(key, None, start, end, (end - start) * self.kv_bytes_per_token)
        node.last_access = node.snap_access = self.now
        entry = _Entry(node, parent_key)
        self._entries[key] = entry
        return entry

    def drop_page(self, page: int) -> list[PageKey]:
        """The engine dropped every hash of ``page``; returns what the mirror held for it."""
        held = self._page_keys.pop(page, set())
        for key, group in held:
            entry = self._entries[key]
            pages = entry.pages[group]
            pages.discard(page)
            if not pages:
                del entry.pages[group]
            if not entry.pages:
                entry.node.alive = False
                del self._entries[key]
        return sorted(held, key=repr)

    def move_page(self, src: int, dst: int) -> None:
        """The engine re-pointed every hash of ``src`` to ``dst`` (copy-on-write)."""
        held = self._page_keys.pop(src, set())
        for key, group in held:
            pages = self._entries[key].pages[group]
            pages.discard(src)
            pages.add(dst)
        if held:
            self._page_keys.setdefault(dst, set()).update(held)

    def clear(self) -> None:
        """The engine reset its prefix cache."""
        for entry in self._entries.values():
            entry.node.alive = False
        self._entries.clear()
        self._page_keys.clear()

    def touch_pages(self, pages: Iterable[int]) -> None:
        """A request hit these pages: one use per key and kind (KV, snapshot)."""
        kv_keys: set[Hashable] = set()
        snap_keys: set[Hashable] = set()
        for page in pages:
            for key, group in self._page_keys.get(page, ()):
                (kv_keys if group in self.kv_groups else snap_keys).add(key)
        for key in kv_keys:
            node = self._entries[key].node
            node.last_access = self.now
            node.hits += 1
        for key in snap_keys:
            node = self._entries[key].node
            node.snap_access = self.now
            node.snap_hits += 1

    # ----------------------------------------------------------------- queries
    def keys_of(self, page: int) -> set[PageKey]:
        return set(self._page_keys.get(page, ()))

    def holds(self, page: int) -> bool:
        return page in self._page_keys

    def cached_pages(self) -> list[int]:
        return list(self._page_keys)

    def __len__(self) -> int:
        return len(self._entries)

    def pick_victims(self, n_pages: int, is_free: IsFree) -> list[int]:
        """At least ``n_pages`` free cached pages whose hashes the engine should drop now (fewer
        only if no more can go), in eviction order: every dead or duplicate page, then policy
        units until ``n_pages`` are reached (a unit may overshoot). Nothing is dropped here:
        the engine drops them and reports it through :meth:`drop_page`."""
        out: list[int] = []
        if n_pages <= 0:
            return out
        live = self._rebuild(is_free)
        out.extend(self._dead_or_duplicate(live, is_free))  # all of them: nothing can hit them
        if len(out) < n_pages:
            self._pick_units(live, n_pages, out, is_free)
        assert all(is_free(p) for p in out), "inv 4: a victim page is in use"
        self.stats.pages += len(out)
        return out

    # ----------------------------------------------------------------- internals
    def _rebuild(self, is_free: IsFree) -> dict[Hashable, Node]:
        """Re-derive the live trie (children, snapshots, refs) from the page map."""
        self.root.children, self.root.partials, self.root.refs = {}, {}, 0
        live: dict[Hashable, Node] = {}
        order = sorted(self._entries.values(), key=lambda e: e.node.end_tokens)
        for entry in order:
            node = entry.node
            node.children, node.partials, node.refs = {}, {}, 0
            node.has_snapshot = bool(self.state_groups) and all(
                g in entry.pages for g in self.state_groups
            )
            parent = self.root if entry.parent_key is None else live.get(entry.parent_key)
            if parent is None or not all(g in entry.pages for g in self.kv_groups):
                continue
            if parent is not self.root and parent.n_tokens != self.block_tokens:
                continue  # only full blocks have children
            node.parent = parent
            if node.n_tokens == self.block_tokens:
                parent.children[node.key] = node
            else:
                parent.partials.setdefault(node.n_tokens, {})[node.key] = node
            live[node.key] = node
        for entry in reversed(order):
            node = entry.node
            if node.key in live:
                node.refs += sum(not is_free(p) for ps in entry.pages.values() for p in ps)
                assert node.parent is not None
                node.parent.refs += node.refs
        return live

    def _dead_or_duplicate(self, live: dict[Hashable, Node], is_free: IsFree) -> list[int]:
        """Free pages whose every (key, group) is dead or held by another page too."""
        spare: set[tuple[int, Hashable, int]] = set()
        for key, entry in self._entries.items():
            for group, pages in entry.pages.items():
                free = sorted(p for p in pages if is_free(p))
                if key not in live:
                    spare.update((p, key, group) for p in free)
                elif len(pages) > 1:
                    keep = 0 if len(free) < len(pages) else 1  # one free copy stays if needed
                    spare.update((p, key, group) for p in free[keep:])
        out = sorted(
            {p for p, _, _ in spare if all((p, k, g) in spare for k, g in self._page_keys[p])}
        )
        for page in out:
            if any(k not in live for k, _ in self._page_keys[page]):
                self.stats.dead_pages += 1
            else:
                self.stats.duplicate_pages += 1
        return out

    def _push(self, heap: _Heap, node: Node, is_free: IsFree) -> None:
        node.version += 1
        if node.refs == 0:
            prio = self.policy.kv_priority(node, self.now)
            if prio is not None:
                heapq.heappush(heap, (prio, self._next_seq(), _KV, node, node.version))
        if node.has_snapshot and self._free_state(node, is_free):
            prio = self.policy.snapshot_priority(node, self.now)
            if prio is not None:
                heapq.heappush(heap, (prio, self._next_seq(), _SNAP, node, node.version))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _free_state(self, node: Node, is_free: IsFree) -> bool:
        pages = self._entries[node.key].pages
        return all(is_free(p) for g in self.state_groups for p in pages.get(g, ()))

    def _pick_units(
        self, live: dict[Hashable, Node], n_pages: int, out: list[int], is_free: IsFree
    ) -> None:
        taken = set(out)
        heap: _Heap = []
        for node in live.values():
            self._push(heap, node, is_free)
        while heap and len(out) < n_pages:
            prio, _, kind, node, version = heapq.heappop(heap)
            if node.key not in live or version != node.version:
                continue
            if kind == _SNAP and not node.has_snapshot:
                continue
            self.policy.on_evict(prio)
            self._notify_evicted(node, kind == _SNAP, len(live))
            if kind == _SNAP:
                pages = self._unit_pages(node, self.state_groups)
                node.has_snapshot = False
                self.stats.snapshot_units += 1
                self._push(heap, node, is_free)
            else:
                pages = self._evict_subtree(node, live)
                self.stats.kv_units += 1
                if node.parent is not None and node.parent is not self.root:
                    self._push(heap, node.parent, is_free)
            out.extend(p for p in pages if p not in taken)
            taken.update(pages)

    def _notify_evicted(self, node: Node, snapshot_only: bool, live_entries: int) -> None:
        """The optional ``on_evicted`` hook of ``core/policy.py``, as ``PrefixIndex`` calls it
        (before the unit goes); ``live_entries`` counts live entries, not KV + snapshots."""
        hook = getattr(self.policy, "on_evicted", None)
        if hook is not None:
            hook(node, snapshot_only, live_entries)

    def _unit_pages(self, node: Node, groups: Collection[int]) -> list[int]:
        pages = self._entries[node.key].pages
        return sorted(p for g in groups if g in pages for p in pages[g])

    def _evict_subtree(self, top: Node, live: dict[Hashable, Node]) -> list[int]:
        parent = top.parent
        assert parent is not None and top.refs == 0
        if top.n_tokens == self.block_tokens:
            del parent.children[top.key]
        else:
            del parent.partials[top.n_tokens][top.key]
            if not parent.partials[top.n_tokens]:
                del parent.partials[top.n_tokens]
        all_groups = self.kv_groups | self.state_groups
        pages: list[int] = []
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.iter_children())
            del live[node.key]
            pages.extend(self._unit_pages(node, all_groups))
        return pages

    # ----------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Assert invariants 1-3 of the module docstring (O(size); for tests and debug mode)."""
        b = self.block_tokens
        seen: set[tuple[int, Hashable, int]] = set()
        for key, entry in self._entries.items():
            node = entry.node
            assert entry.pages, f"inv 1: empty entry {key!r}"
            assert node.key == key and node.end_tokens > 0, f"inv 2: {node!r}"
            start = node.end_tokens - b if node.end_tokens % b == 0 else node.end_tokens // b * b
            assert node.start_tokens == start, f"inv 2: span of {node!r}"
            for group, pages in entry.pages.items():
                assert pages, f"inv 1: empty page set at {key!r} group {group}"
                assert group in self.kv_groups or group in self.state_groups, f"inv 3: {group}"
                for page in pages:
                    assert (key, group) in self._page_keys.get(page, ()), f"inv 1: page {page}"
                    seen.add((page, key, group))
        for page, held in self._page_keys.items():
            assert held, f"inv 1: page {page} with an empty key set"
            for key, group in held:
                assert (page, key, group) in seen, f"inv 1: page {page} -> {key!r} not mirrored"
