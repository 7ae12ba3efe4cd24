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
pages only). A unit with any page in use is never chosen, so neither is any page with
``ref_cnt > 0``. With a :attr:`~PoolMirror.lookahead` (the engine's waiting requests), the
units a waiting request would hit go last, in the same order among themselves.

Everything is kept incrementally (the live trie, ``refs``, a lazy heap of units), so an
eviction costs O(victims * depth + dead/duplicate entries + heap pops * log) and an event
O(depth), not O(pool). Which pages are in use is known in one of two modes:

* *callback* (default): ``is_free(page)`` of :meth:`pick_victims`. A cached page counts as in
  use from :meth:`add` or :meth:`touch_pages` until ``is_free`` says otherwise; each
  :meth:`pick_victims` (and :meth:`free_pages` given ``is_free``) re-checks only the pages
  believed in use, O(those). Relies on vLLM's rule that a free cached page is taken only by
  ``touch`` (reported) or ``get_new_blocks`` (which drops its hashes first); a page found in
  use anyway is never returned.
* *events* (:meth:`use_free_events`): the adapter reports every page's change with
  :meth:`page_used` / :meth:`page_freed`; nothing is re-checked, ``is_free`` only guards the
  victims.

A priority is computed when its entry changes (added, touched, child set, snapshot, or it
becomes evictable), as ``PrefixIndex`` does (``core/policy.py``): exact for priorities that are
functions of the entry alone (``vllm``, ``lru-dense``, ``sglang``); ``flop`` keeps the GreedyDual
clock of that moment and ``marconi``/``flop`` the ancestor chain of that moment (the simulator's
semantics; the pre-incremental mirror re-ranked every entry at every eviction).

Invariants (asserted by :meth:`check_integrity`):

1. ``_page_keys`` and the entries' ``pages`` are inverse maps: ``(key, group)`` is in
   ``_page_keys[page]`` iff ``page`` is in ``_entries[key].pages[group]``; no empty set or
   entry is stored.
2. An entry's node has ``key`` as its key and spans ``(start, end]`` with ``end > 0``,
   ``start = end - block_tokens`` for a full block, else the block boundary below ``end``.
3. Every group of every stored page is a KV group or a state group, all of one kind per page
   (an engine's page belongs to one group).
4. ``pages_victimized`` counts every page :meth:`pick_victims` returned; none was in use.
5. The live trie equals a from-scratch rebuild (:meth:`_reference_trie`): ``live``, parent,
   ``children``/``partials``, ``has_snapshot``, and ``refs`` = the entry's in-use (page, group)
   pairs + its live children with ``refs > 0`` (the root: its children with ``refs > 0``), so
   ``refs == 0`` iff no (page, group) in the live subtree is in use; ``_kids``, ``_dead``
   (entries not live), ``_dups`` ((key, group) with two pages or more), ``used``/``used_state``,
   ``_by_serial``, ``_n_live``, ``_n_free`` and ``_n_free_state`` match their definitions.
6. Every evictable unit (KV: live, ``refs == 0``; snapshot: ``has_snapshot``, no state page in
   use) whose priority is not None has a heap item of its node's current version, or is dirty;
   a free snapshot on a path not in use that neither priority ranks is in ``_unranked``.
7. In events mode ``_used`` holds exactly the pages in use; in callback mode it holds cached
   pages only, and every cached page outside it is free (checked when ``is_free`` is given).
8. With a snapshot budget, once the engine has enforced it (:meth:`pick_snapshot_victims` at
   every release): free state pages <= ``snapshot_budget_pages``, but for those of an entry
   whose path is in use (``refs > 0``: no unit with a page in use goes, so nothing can take
   them).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policy import EvictionPolicy

PageKey = tuple[Hashable, int]
IsFree = Callable[[int], bool]
_KV, _SNAP = 0, 1


@dataclass(eq=False, slots=True)
class _Entry:
    """One key: the node the policy ranks, the engine pages holding it per group, and the
    incremental state: ``live``, in-use (page, group) pairs (``used``, of state groups
    ``used_state``), and ``serial`` (creation order, the heap's tie-break after the depth)."""

    node: Node
    parent_key: Hashable | None
    serial: int
    pages: dict[int, set[int]] = field(default_factory=dict)
    live: bool = False
    used: int = 0
    used_state: int = 0


# prio, end, serial, kind, version: unique per (serial, kind, version), so two items never tie;
# numbers only (the entry is found by its serial), so the garbage collector skips the heap.
_Item = tuple[float, int, int, int, int]


@dataclass
class VictimStats:
    """Counts of what :meth:`PoolMirror.pick_victims` chose, by reason."""

    dead_pages: int = 0
    duplicate_pages: int = 0
    kv_units: int = 0
    snapshot_units: int = 0
    pages: int = 0
    #: times a unit was passed over because a waiting request would hit it
    #: (:attr:`PoolMirror.lookahead`), and units taken anyway, for want of others
    wanted_units: int = 0
    wanted_taken: int = 0


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
        self._is_state = {g: False for g in self.kv_groups} | {g: True for g in self.state_groups}
        self.policy = policy
        self.kv_bytes_per_token = kv_bytes_per_token
        self.root = Node(None, None, 0, 0, 0)
        self.now = 0
        self.stats = VictimStats()
        self._events = False
        self._used: set[int] = set()
        self._serial = 0
        #: Optional hooks for a second tier of snapshots (the engine's host tier,
        #: ``core/host_ledger.py``); None (the default) changes nothing.
        #: ``on_snapshot_evicted(node, pages by state group, priority)``: the policy evicts
        #: ``node``'s snapshot alone (its KV stays), before its pages are dropped.
        self.on_snapshot_evicted: Callable[[Node, dict[int, list[int]], float], None] | None = None
        #: ``on_entry_deleted(key)``: the engine holds no page under ``key`` any more.
        self.on_entry_deleted: Callable[[Hashable], None] | None = None
        #: ``on_snapshot_added(node)``: ``node`` has a page in every state group again.
        self.on_snapshot_added: Callable[[Node], None] | None = None
        #: The snapshot budget: at most this many free cached pages of state groups (the
        #: engine's ``max_snapshot_fraction`` of its pool); None: no budget of their own,
        #: snapshots and KV compete for the pool by the policy's value alone.
        self.snapshot_budget_pages: int | None = None
        #: Lookahead (None: off): the key paths of requests that will look the cache up soon
        #: (an engine's waiting queue), each the keys at successive full-block ends from the
        #: first block up to the last a hit may reach. A unit on such a path down to the
        #: path's deepest snapshot (the hit that request would get now) goes only after every
        #: other unit: the order changes, never how many pages an eviction frees.
        self._lookahead: Callable[[], Iterable[Sequence[Hashable]]] | None = None
        #: At most this many lookahead paths count, the first ones (an engine admits its
        #: waiting requests in queue order): bounds the cost of an eviction under overload.
        self.lookahead_paths = 64
        self._wanted: set[Hashable] | None  # the lookahead's keys, until refreshed (_reset)
        self._reset()

    @property
    def lookahead(self) -> Callable[[], Iterable[Sequence[Hashable]]] | None:
        return self._lookahead

    @lookahead.setter
    def lookahead(self, paths: Callable[[], Iterable[Sequence[Hashable]]] | None) -> None:
        self._lookahead = paths
        self._wanted = None

    def refresh_lookahead(self) -> None:
        """The waiting requests may have changed: the next eviction asks :attr:`lookahead`
        again. Until then evictions reuse the keys it gave (an engine refreshes once per
        scheduler step: its waiting queue changes between steps, and walking up to
        :attr:`lookahead_paths` paths at every eviction batch of a step would cost more than
        the evictions; within a step, units evicted meanwhile are simply no longer there)."""
        self._wanted = None

    def _reset(self) -> None:
        self.root.children, self.root.partials, self.root.refs = {}, {}, 0
        self._entries: dict[Hashable, _Entry] = {}
        self._by_serial: dict[int, _Entry] = {}  # the heap items' entries
        self._page_keys: dict[int, set[PageKey]] = {}
        self.cached = self._page_keys.keys()  # read-only view: the cached pages
        self._kids: dict[Hashable, set[Hashable]] = {}  # parent key -> keys of its entries
        self._dead: set[Hashable] = set()
        self._dups: set[PageKey] = set()
        self._dirty: dict[int, _Entry] = {}  # serial -> entry to re-rank before the next pop
        self._heap: list[_Item] = []
        #: serials of free snapshots no unit ranks (both priorities None, path not in use), as
        #: of their last ranking: what the snapshot budget's last resort looks at
        self._unranked: set[int] = set()
        self._victims: dict[int, list[PageKey]] = {}  # last pick's victims -> what they held
        self._n_live = self._n_free = self._n_free_state = 0
        self._wanted = None
        if not self._events:
            self._used.clear()

    # ----------------------------------------------------------------- engine events
    def tick(self) -> int:
        """Advance the logical clock (the adapter calls it once per scheduler step)."""
        self.now += 1
        return self.now

    def add(
        self,
        page: int,
        key: Hashable,
        group: int,
        end_tokens: int,
        parent_key: Hashable | None,
        origin: int = -1,
    ) -> bool:
        """The engine cached ``page`` under ``(key, group)``; ``key`` ends at ``end_tokens``.
        ``origin``: the index of the request that computed it (``Node.origin``), if known.
        Returns True if ``page`` held nothing before (it is newly cached)."""
        is_state = self._is_state.get(group)
        if is_state is None:
            raise ValueError(f"group {group} is neither a KV nor a state group")
        if self._victims:
            self._victims.pop(page, None)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(key, end_tokens, parent_key)
            entry.node.origin = origin
        newly_cached = page not in self._page_keys
        if self._link(page, key, group, entry):
            self._group_added(entry, group)
        node = entry.node
        if is_state:
            node.snap_access = self.now
        node.last_access = self.now
        node.version += 1  # _mark, inlined (hot)
        self._dirty[entry.serial] = entry
        return newly_cached

    def _new_entry(self, key: Hashable, end: int, parent_key: Hashable | None) -> _Entry:
        if end <= 0:
            raise ValueError(f"an entry ends after token 0, got {end}")
        b = self.block_tokens
        start = end - b if end % b == 0 else end // b * b
        node = Node(key, None, start, end, (end - start) * self.kv_bytes_per_token)
        node.last_access = node.snap_access = self.now
        self._serial += 1
        entry = _Entry(node, parent_key, self._serial)
        self._entries[key] = entry
        self._by_serial[entry.serial] = entry
        kids = self._kids.get(parent_key)
        if kids is None:
            kids = self._kids[parent_key] = set()
        kids.add(key)
        self._dead.add(key)
        return entry

    def drop_page(self, page: int) -> list[PageKey]:
        """The engine dropped every hash of ``page``; returns what the mirror held for it (for
        a victim of the last :meth:`pick_victims`, what it held before that call dropped it)."""
        held = self._page_keys.get(page)
        if not held:
            return self._victims.pop(page, []) if self._victims else []
        out = list(held) if len(held) == 1 else sorted(held, key=repr)
        for key, group in out:
            entry = self._entries[key]
            if self._unlink(page, key, group, entry):
                self._group_removed(entry, group)
            if not entry.pages:
                self._delete(entry)
        return out

    def move_page(self, src: int, dst: int) -> None:
        """The engine re-pointed every hash of ``src`` to ``dst`` (copy-on-write)."""
        for key, group in sorted(self._page_keys.get(src, ()), key=repr):
            entry = self._entries[key]
            self._link(dst, key, group, entry)  # first: the group never empties
            self._unlink(src, key, group, entry)

    def clear(self) -> None:
        """The engine reset its prefix cache."""
        for entry in self._entries.values():
            entry.node.alive = False
        self._reset()

    def touch_pages(self, pages: Iterable[int]) -> None:
        """A request hit these pages (now in use): one use per key and kind (KV, snapshot)."""
        kv_keys: dict[Hashable, None] = {}  # ordered: marks in a deterministic order
        snap_keys: dict[Hashable, None] = {}
        page_keys, used, is_state = self._page_keys, self._used, self._is_state
        newly_used: list[int] = []
        for page in pages:
            held = page_keys.get(page)
            if held is None:
                continue
            if page not in used:
                newly_used.append(page)
            for key, group in held:
                (snap_keys if is_state[group] else kv_keys)[key] = None
        if newly_used:
            self._set_many(newly_used, True)
        now, entries, dirty = self.now, self._entries, self._dirty
        for key in kv_keys:
            entry = entries[key]
            node = entry.node
            node.last_access = now
            node.hits += 1
            node.version += 1
            dirty[entry.serial] = entry
        for key in snap_keys:
            entry = entries[key]
            node = entry.node
            node.snap_access = now
            node.snap_hits += 1
            node.version += 1
            dirty[entry.serial] = entry

    def use_free_events(self, in_use: Iterable[int] = ()) -> None:
        """From now on the engine reports every page's change of free state (cached or not)
        through :meth:`page_used` / :meth:`page_freed`; ``in_use``: the pages in use now."""
        target = set(in_use)
        self._events = True
        for page in list(self._page_keys):
            self._set_used(page, page in target)
        self._used = target

    def page_used(self, page: int) -> None:
        """The engine took ``page`` (its ``ref_cnt`` went 0 -> 1); idempotent."""
        self._set_used(page, True)

    def page_freed(self, page: int) -> None:
        """The engine released ``page`` (its ``ref_cnt`` went to 0); idempotent."""
        self._set_used(page, False)

    def pages_used(self, pages: Iterable[int]) -> None:
        """:meth:`page_used` of each page, in one call (the adapter's batch per allocation)."""
        used, page_keys = self._used, self._page_keys
        cached: list[int] = []
        for page in pages:
            if page not in used:
                if page in page_keys:
                    cached.append(page)
                elif self._events:  # callback mode tracks cached pages only
                    used.add(page)
        if cached:
            self._set_many(cached, True)

    def pages_freed(self, pages: Iterable[int]) -> None:
        """:meth:`page_freed` of each page, in one call (the adapter's batch per release)."""
        used, page_keys = self._used, self._page_keys
        cached: list[int] = []
        for page in pages:
            if page in used:
                if page in page_keys:
                    cached.append(page)
                else:
                    used.discard(page)
        if cached:
            self._set_many(cached, False)

    # ----------------------------------------------------------------- queries
    def keys_of(self, page: int) -> set[PageKey]:
        return set(self._page_keys.get(page, ()))

    def live_node(self, key: Hashable) -> Node | None:
        """``key``'s node if its entry is live (the KV of its whole prefix is held), else None."""
        entry = self._entries.get(key)
        return entry.node if entry is not None and entry.live else None

    def node_of(self, key: Hashable) -> Node | None:
        """The node the policy ranks for ``key``, while the engine holds a page under it."""
        entry = self._entries.get(key)
        return None if entry is None else entry.node

    def holds(self, page: int) -> bool:
        return page in self._page_keys

    def cached_pages(self) -> list[int]:
        return list(self._page_keys)

    def __len__(self) -> int:
        return len(self._entries)

    def free_pages(self, is_free: IsFree | None = None) -> int:
        """How many cached pages are free: O(1) in events mode; in callback mode pass
        ``is_free`` to re-check the pages believed in use first (O(those))."""
        if is_free is not None and not self._events:
            self._sync(is_free)
        return self._n_free

    def free_state_pages(self) -> int:
        """How many cached pages of state groups are free (events mode: exact, O(1); callback
        mode: as of the last re-check). These are the snapshot budget's pages."""
        return self._n_free_state

    def snapshot_excess(self) -> int:
        """Free state pages over :attr:`snapshot_budget_pages` (0 without a budget): what
        :meth:`pick_snapshot_victims` should free after pages were released."""
        budget = self.snapshot_budget_pages
        return 0 if budget is None else max(0, self._n_free_state - budget)

    def pick_victims(self, n_pages: int, is_free: IsFree) -> list[int]:
        """At least ``n_pages`` free cached pages whose hashes the engine should drop now (fewer
        only if no more can go), in eviction order: every dead or duplicate page, then policy
        units until ``n_pages`` are reached (a unit may overshoot). The victims leave the mirror
        here, as if :meth:`drop_page` had been called (so later units see the trie without
        them); the engine must drop their hashes at once and report it with :meth:`drop_page`,
        which then returns what the victim held and changes nothing else."""
        return self._pick(n_pages, 0, is_free) if n_pages > 0 else []

    def pick_snapshot_victims(self, n_state_pages: int, is_free: IsFree) -> list[int]:
        """Free cached pages to drop so that at least ``n_state_pages`` free state pages stop
        holding a snapshot (:meth:`snapshot_excess`): every dead or duplicate page, then
        policy units lowest first, passing over the units that hold no state page (KV with no
        snapshot in its subtree: a KV shortage evicts those, not the snapshot budget). A leaf
        snapshot goes with its KV unit where the policy ranks it so (its KV alone could not be
        resumed from). If those do not suffice because the policy leaves some free states
        unranked (``marconi`` keeps branch points), their snapshot units go last, least
        recently used first (:meth:`_pick_unranked_states`). Same contract as
        :meth:`pick_victims` otherwise."""
        return self._pick(0, n_state_pages, is_free) if n_state_pages > 0 else []

    def wanted_keys(self, paths: Iterable[Sequence[Hashable]]) -> set[Hashable]:
        """The keys of the hits ``paths`` would get now: along each path, its live entries down
        to the deepest one with a snapshot (none if the path reaches no snapshot)."""
        out: set[Hashable] = set()
        entries = self._entries
        for path in paths:
            hit = 0
            for i, key in enumerate(path):
                entry = entries.get(key)
                if entry is None or not entry.live:
                    break
                if entry.node.has_snapshot:
                    hit = i + 1
            out.update(path[:hit])
        return out

    def _pick(self, n_pages: int, n_state_pages: int, is_free: IsFree) -> list[int]:
        out: list[int] = []
        if self._victims:
            self._victims.clear()
        if not self._events:
            self._sync(is_free)
        state_target = self._n_free_state - n_state_pages if n_state_pages else None
        if self._dead or self._dups:
            out.extend(self._dead_or_duplicate(is_free))  # all of them: nothing can hit them
            for page in out:
                self._victims[page] = self.drop_page(page)
        if state_target is not None:
            if self._n_free_state > state_target:
                unbounded = len(self._page_keys) + len(out)  # the state target stops it
                self._pick_units(unbounded, out, is_free, state_target)
            if self._n_free_state > state_target:
                self._pick_unranked_states(out, is_free, state_target)
        elif len(out) < n_pages:
            self._pick_units(n_pages, out, is_free)
        assert all(is_free(p) for p in out), "inv 4: a victim page is in use"
        self.stats.pages += len(out)
        return out

    # ----------------------------------------------------------------- pages and use counts
    def _link(self, page: int, key: Hashable, group: int, entry: _Entry) -> bool:
        """Add the pair; True if ``group`` was new for the entry."""
        pages = entry.pages.get(group)
        if pages is not None and page in pages:
            return False
        held = self._page_keys.get(page)
        if held is None:
            held = self._page_keys[page] = set()
            if not self._events:
                self._used.add(page)  # believed in use until is_free says otherwise
            elif page not in self._used:
                self._n_free += 1
                self._n_free_state += self._is_state[group]
        held.add((key, group))
        new_group = pages is None
        if pages is None:
            pages = entry.pages[group] = set()
        pages.add(page)
        if len(pages) == 2:
            self._dups.add((key, group))
        if page in self._used:
            self._count_used(entry, group, 1)
        return new_group

    def _unlink(self, page: int, key: Hashable, group: int, entry: _Entry) -> bool:
        """Remove the pair; True if the entry no longer holds ``group``."""
        if page in self._used:
            self._count_used(entry, group, -1)
        held = self._page_keys[page]
        held.discard((key, group))
        if not held:
            del self._page_keys[page]
            if page not in self._used:
                self._n_free -= 1
                self._n_free_state -= self._is_state[group]
            elif not self._events:
                self._used.discard(page)
        pages = entry.pages[group]
        pages.discard(page)
        if len(pages) == 1:
            self._dups.discard((key, group))
        if pages:
            return False
        del entry.pages[group]
        return True

    def _set_used(self, page: int, used: bool) -> None:
        if (page in self._used) == used:
            return
        held = self._page_keys.get(page)
        if held is None and not self._events:
            return  # callback mode tracks cached pages only
        if used:
            self._used.add(page)
        else:
            self._used.discard(page)
        if held is None:
            return
        delta = 1 if used else -1
        self._n_free -= delta
        for key, group in held:
            self._count_used(self._entries[key], group, delta)
        self._n_free_state -= delta * self._is_state[group]  # one kind per page (inv 3)

    def _set_many(self, pages: list[int], used: bool) -> None:
        """:meth:`_set_used` of cached pages, all the same way (a page already so is skipped):
        the use counts first, then one ``refs`` change per live node (all of one sign, so a
        node reaches or leaves 0 exactly when page-by-page changes would have it do so, and
        is re-ranked the same)."""
        delta = 1 if used else -1
        used_set, page_keys, entries = self._used, self._page_keys, self._entries
        is_state, dirty = self._is_state, self._dirty
        deltas: dict[Node, int] = {}
        for page in pages:
            if used:
                if page in used_set:
                    continue  # listed twice
                used_set.add(page)
            else:
                if page not in used_set:
                    continue
                used_set.discard(page)
            self._n_free -= delta
            for key, group in page_keys[page]:
                entry = entries[key]
                entry.used += delta
                if is_state[group]:
                    entry.used_state += delta
                    if entry.used_state == 0:  # its snapshot may go again (_mark, inlined)
                        entry.node.version += 1
                        dirty[entry.serial] = entry
                if entry.live:
                    node = entry.node
                    deltas[node] = deltas.get(node, 0) + delta
            if is_state[group]:  # one kind per page (inv 3)
                self._n_free_state -= delta
        for node, d in deltas.items():
            self._add_refs(node, d)

    def _count_used(self, entry: _Entry, group: int, delta: int) -> None:
        entry.used += delta
        if self._is_state[group]:
            entry.used_state += delta
            if entry.used_state == 0:
                self._mark(entry)  # its snapshot may go again
        if entry.live:
            self._add_refs(entry.node, delta)

    def _add_refs(self, node: Node | None, delta: int) -> None:
        """``refs += delta`` on ``node``, then on its ancestors as long as one flips between 0
        and not 0 (``refs`` counts the node's in-use pages and its children with ``refs > 0``:
        inv 5), so a change deep in a path in use stops at once. A node reaching 0 is
        re-ranked; so is a leaf with a snapshot leaving 0 (a policy may offer a leaf's state
        alone while its KV is in use, as flop does; other nodes in use have no valid unit to
        re-rank). Zero-ness is that of the in-use count of the whole subtree, so the nodes
        re-ranked are those a sum over the subtree would re-rank."""
        root, entries, dirty = self.root, self._entries, self._dirty
        while node is not None and delta:
            was_free = node.refs == 0
            node.refs += delta
            now_free = node.refs == 0
            if node is not root and (
                now_free
                or (was_free and node.has_snapshot and not node.children and not node.partials)
            ):
                entry = entries[node.key]  # _mark, inlined (hot)
                node.version += 1
                dirty[entry.serial] = entry
            if was_free == now_free:
                return
            delta = 1 if was_free else -1  # the parent gained or lost a child in use
            node = node.parent

    def _sync(self, is_free: IsFree) -> None:
        """Callback mode: re-check the pages believed in use."""
        for page in [p for p in self._used if is_free(p)]:
            self._set_used(page, False)

    def _free(self, page: int, is_free: IsFree) -> bool:
        """Free by the mirror's knowledge and by ``is_free``; a page found in use is marked."""
        if page in self._used:
            return False
        if is_free(page):
            return True
        self._set_used(page, True)
        return False

    # ----------------------------------------------------------------- the live trie
    def _group_added(self, entry: _Entry, group: int) -> None:
        if self._is_state[group]:
            entry.node.has_snapshot = entry.pages.keys() >= self.state_groups
            if entry.node.has_snapshot and self.on_snapshot_added is not None:
                self.on_snapshot_added(entry.node)
        elif not entry.live and self._can_live(entry):
            self._attach(entry)

    def _group_removed(self, entry: _Entry, group: int) -> None:
        if self._is_state[group]:
            entry.node.has_snapshot = False
            self._mark(entry)
        elif entry.live:
            self._detach(entry)

    def _can_live(self, entry: _Entry) -> bool:
        if not entry.pages.keys() >= self.kv_groups:
            return False
        if entry.parent_key is None:
            return True
        parent = self._entries.get(entry.parent_key)
        if parent is None or not parent.live:
            return False
        node = parent.node
        return node.end_tokens - node.start_tokens == self.block_tokens  # a full block

    def _attach(self, top: _Entry) -> None:
        """``top`` (whose parent is live) becomes live, with every entry below it that can."""
        order, stack = [], [top]
        entries, all_kids, dead, dirty = self._entries, self._kids, self._dead, self._dirty
        b, kv_groups = self.block_tokens, self.kv_groups
        while stack:
            entry = stack.pop()
            node = entry.node
            key = node.key
            parent = self.root if entry.parent_key is None else entries[entry.parent_key].node
            node.parent, node.refs = parent, entry.used
            n_tokens = node.end_tokens - node.start_tokens
            if n_tokens == b:
                parent.children[key] = node
                kids = all_kids.get(key)
                if kids:
                    stack.extend(
                        k for k in map(entries.__getitem__, kids) if k.pages.keys() >= kv_groups
                    )
            else:
                parent.partials.setdefault(n_tokens, {})[key] = node
            entry.live = True
            dead.discard(key)
            self._n_live += 1
            order.append(entry)
            node.version += 1  # _mark, inlined
            dirty[entry.serial] = entry
        for entry in reversed(order[1:]):  # children before parents
            assert entry.node.parent is not None
            if entry.node.refs:
                entry.node.parent.refs += 1
        if top.node.refs:
            self._add_refs(top.node.parent, 1)
        self._mark_parent(top.node)

    def _detach(self, top: _Entry) -> None:
        """``top`` is no longer live, nor is anything below it."""
        node = top.node
        parent = node.parent
        assert parent is not None
        if node.n_tokens == self.block_tokens:
            del parent.children[node.key]
        else:
            del parent.partials[node.n_tokens][node.key]
            if not parent.partials[node.n_tokens]:
                del parent.partials[node.n_tokens]
        if node.refs:
            self._add_refs(parent, -1)
        self._mark_parent(node)
        stack = [node]
        entries, dead = self._entries, self._dead
        while stack:
            walk = stack.pop()
            if walk.children or walk.partials:
                stack.extend(walk.iter_children())
                walk.children, walk.partials = {}, {}
            entries[walk.key].live = False
            dead.add(walk.key)
            self._n_live -= 1
            walk.parent, walk.refs = None, 0
            walk.version += 1

    def _mark_parent(self, node: Node) -> None:
        if node.parent is not None and node.parent is not self.root:
            self._mark(self._entries[node.parent.key])

    def _delete(self, entry: _Entry) -> None:
        key = entry.node.key
        entry.node.alive = False
        del self._entries[key]
        kids = self._kids[entry.parent_key]
        kids.discard(key)
        if not kids:
            del self._kids[entry.parent_key]
        self._dead.discard(key)
        self._dirty.pop(entry.serial, None)
        self._unranked.discard(entry.serial)
        del self._by_serial[entry.serial]
        if self.on_entry_deleted is not None:
            self.on_entry_deleted(key)

    # ----------------------------------------------------------------- ranking
    def _mark(self, entry: _Entry) -> None:
        """The entry changed: its heap items are stale; it is re-ranked before the next pop."""
        entry.node.version += 1
        self._dirty[entry.serial] = entry

    def _flush(self) -> None:
        """Rank every dirty entry that is live: push a heap item per evictable unit (KV:
        ``refs == 0``; snapshot: no state page in use) whose priority is not None."""
        dirty = self._dirty
        if not dirty:
            return
        self._dirty = {}
        heap, now, push = self._heap, self.now, heapq.heappush
        kv_priority, snapshot_priority = self.policy.kv_priority, self.policy.snapshot_priority
        unranked = self._unranked
        for serial, entry in dirty.items():  # KV before snapshot, entries in marking order
            if not entry.live:
                continue
            node = entry.node
            kv_prio = None
            if node.refs == 0:
                kv_prio = kv_priority(node, now)
                if kv_prio is not None:
                    push(heap, (kv_prio, node.end_tokens, serial, _KV, node.version))
            if node.has_snapshot and entry.used_state == 0:
                prio = snapshot_priority(node, now)
                if prio is not None:
                    push(heap, (prio, node.end_tokens, serial, _SNAP, node.version))
                elif node.refs == 0 and kv_prio is None:
                    unranked.add(serial)
                    continue
            if unranked:
                unranked.discard(serial)
        if len(heap) > 4 * (self._n_live + 1024):  # compact: drop the stale items
            by_serial = self._by_serial
            self._heap = [i for i in heap if self._valid(i, by_serial.get(i[2]))]
            heapq.heapify(self._heap)

    @staticmethod
    def _valid(item: _Item, entry: _Entry | None) -> bool:
        """``item`` (of ``entry``, the entry of its serial, if any) still ranks a unit."""
        if entry is None or not entry.live:
            return False
        node = entry.node
        if item[4] != node.version:
            return False
        if item[3] == _KV:
            return node.refs == 0
        return node.has_snapshot and entry.used_state == 0

    def _pop_valid(self) -> tuple[_Item, _Entry] | None:
        self._flush()
        heap, by_serial, pop, valid = self._heap, self._by_serial, heapq.heappop, self._valid
        while heap:
            item = pop(heap)
            entry = by_serial.get(item[2])
            if valid(item, entry):
                assert entry is not None
                return item, entry
        return None

    # ----------------------------------------------------------------- picking
    def _dead_or_duplicate(self, is_free: IsFree) -> list[int]:
        """Free pages whose every (key, group) is dead or held by another page too."""
        spare: set[tuple[int, Hashable, int]] = set()
        for key in list(self._dead):
            for group, pages in list(self._entries[key].pages.items()):
                spare.update((p, key, group) for p in list(pages) if self._free(p, is_free))
        for key, group in list(self._dups):
            entry = self._entries[key]
            if not entry.live:
                continue
            pages = entry.pages[group]
            free = sorted(p for p in list(pages) if self._free(p, is_free))
            keep = 0 if len(free) < len(pages) else 1  # one free copy stays if needed
            spare.update((p, key, group) for p in free[keep:])
        out = sorted(
            {p for p, _, _ in spare if all((p, k, g) in spare for k, g in self._page_keys[p])}
        )
        for page in out:
            if any(not self._entries[k].live for k, _ in self._page_keys[page]):
                self.stats.dead_pages += 1
            else:
                self.stats.duplicate_pages += 1
        return out

    def _pick_units(
        self, n_pages: int, out: list[int], is_free: IsFree, state_target: int | None = None
    ) -> None:
        """Policy units, lowest first, until ``out`` holds ``n_pages`` pages or, with
        ``state_target``, until at most that many free state pages still hold a snapshot
        (units without a state page are then passed over and stay ranked). With a
        :attr:`lookahead`, the units a waiting request would hit are passed over first and
        taken, lowest first again, only if the others do not suffice."""
        taken = set(out)
        wanted = self._wanted
        if wanted is None and self._lookahead is not None:
            paths = itertools.islice(self._lookahead(), self.lookahead_paths)
            wanted = self._wanted = self.wanted_keys(paths)
        held = self._pick_loop(n_pages, out, taken, is_free, state_target, wanted or None)
        self.stats.wanted_units += len(held)
        for item in held:  # ranked again (an item whose entry changed meanwhile is stale)
            heapq.heappush(self._heap, item)
        if held and not self._enough(n_pages, out, state_target):
            before = self.stats.kv_units + self.stats.snapshot_units
            self._pick_loop(n_pages, out, taken, is_free, state_target, None)
            self.stats.wanted_taken += self.stats.kv_units + self.stats.snapshot_units - before

    def _pick_unranked_states(self, out: list[int], is_free: IsFree, state_target: int) -> None:
        """The budget's last resort, when the policy's units cannot meet it: it keeps some
        free states unranked (``marconi`` keeps branch points; a state with children goes
        with no KV unit either). Their snapshot units go, least recently used first (then
        shallowest, then oldest entry), on paths not in use, until the target is met.
        O(states left unranked at their last ranking): the ones still so are re-checked."""
        taken = set(out)
        by_serial = self._by_serial
        order = sorted(
            (e.node.snap_access, e.node.end_tokens, e.serial, e)
            for e in map(by_serial.__getitem__, self._unranked)
            if e.live and e.node.has_snapshot and e.used_state == 0 and not e.node.refs
        )
        for _, _, serial, entry in order:
            if self._n_free_state <= state_target:
                return
            pages = self._unit_pages(entry, _SNAP)
            if all(self._free(p, is_free) for p in pages):
                item = (float("-inf"), entry.node.end_tokens, serial, _SNAP, entry.node.version)
                self._take_unit(item, entry, pages, out, taken)

    def _enough(self, n_pages: int, out: list[int], state_target: int | None) -> bool:
        if state_target is not None:
            return self._n_free_state <= state_target
        return len(out) >= n_pages

    def _pick_loop(
        self,
        n_pages: int,
        out: list[int],
        taken: set[int],
        is_free: IsFree,
        state_target: int | None,
        wanted: set[Hashable] | None,
    ) -> list[_Item]:
        """One pass of :meth:`_pick_units`; returns the items of the units passed over because
        their key is ``wanted``, lowest first (no longer in the heap)."""
        passed: list[_Item] = []
        held: list[_Item] = []
        while not self._enough(n_pages, out, state_target):
            popped = self._pop_valid()
            if popped is None:
                break
            item, entry = popped
            pages = self._unit_pages(entry, item[3])
            used = self._used
            if any(p in used or not is_free(p) for p in pages) and not all(
                self._free(p, is_free) for p in pages
            ):
                continue  # the mirror had missed a use: the unit waits until it is free
            if state_target is not None and item[3] == _KV and not self._holds_state(pages):
                passed.append(item)
            elif wanted is not None and entry.node.key in wanted:
                held.append(item)
            else:
                self._take_unit(item, entry, pages, out, taken)
        for item in passed:  # still ranked (an item whose entry changed meanwhile is stale)
            heapq.heappush(self._heap, item)
        return held

    def _take_unit(
        self, item: _Item, entry: _Entry, pages: list[int], out: list[int], taken: set[int]
    ) -> None:
        """Evict one policy unit: tell the policy, drop its pages from the mirror."""
        prio, kind = item[0], item[3]
        self.policy.on_evict(prio)
        hook = getattr(self.policy, "on_evicted", None)  # optional (core/policy.py)
        if hook is not None:  # as PrefixIndex calls it: before the unit goes
            hook(entry.node, kind == _SNAP, self._n_live)  # live entries, not units
        if kind == _SNAP:
            self.stats.snapshot_units += 1
            if self.on_snapshot_evicted is not None:  # the pages still hold the state
                by_group = {g: sorted(entry.pages[g]) for g in sorted(self.state_groups)}
                self.on_snapshot_evicted(entry.node, by_group, prio)
        else:
            self.stats.kv_units += 1
        victims = self._victims
        for page in pages:
            victims[page] = self.drop_page(page)
            if page not in taken:
                out.append(page)
                taken.add(page)

    def _holds_state(self, pages: list[int]) -> bool:
        page_keys, is_state = self._page_keys, self._is_state
        return any(is_state[g] for p in pages for _, g in page_keys[p])

    def _unit_pages(self, entry: _Entry, kind: int) -> list[int]:
        """A snapshot unit's state pages, or a KV unit's pages (all groups, whole subtree),
        top first."""
        if kind == _SNAP:
            pages = entry.pages
            return sorted(p for g in self.state_groups if g in pages for p in pages[g])
        node = entry.node
        if not node.children and not node.partials:  # a leaf (the usual unit)
            return list(dict.fromkeys(sorted(p for ps in entry.pages.values() for p in ps)))
        out: dict[int, None] = {}
        stack = [entry.node]
        while stack:
            node = stack.pop()
            stack.extend(node.iter_children())
            pages = self._entries[node.key].pages
            out.update(dict.fromkeys(sorted(p for ps in pages.values() for p in ps)))
        return list(out)

    # ----------------------------------------------------------------- integrity
    def _reference_trie(self) -> dict[Hashable, tuple[Hashable | None, bool, int]]:
        """From scratch, as the pre-incremental mirror did at every eviction (O(pool log pool)):
        key -> (parent key, has_snapshot, refs) of every live entry."""
        live: dict[Hashable, list[object]] = {}
        order = sorted(self._entries.items(), key=lambda kv: kv[1].node.end_tokens)
        for key, entry in order:
            pk = entry.parent_key
            if pk is not None and (
                pk not in live or self._entries[pk].node.n_tokens != self.block_tokens
            ):
                continue
            if not all(g in entry.pages for g in self.kv_groups):
                continue
            snap = bool(self.state_groups) and all(g in entry.pages for g in self.state_groups)
            used = sum(p in self._used for ps in entry.pages.values() for p in ps)
            live[key] = [pk, snap, used]
        for key in reversed(list(live)):
            pk, refs = live[key][0], live[key][2]
            if pk is not None:
                live[pk][2] += refs  # type: ignore[operator]
        return {k: (v[0], bool(v[1]), int(v[2])) for k, v in live.items()}  # type: ignore[call-overload]

    def check_integrity(self, is_free: IsFree | None = None) -> None:
        """Assert invariants 1-7 of the module docstring (O(size); for tests and debug mode).
        With ``is_free``, also that the mirror's knowledge of pages in use is right (inv 7)."""
        self._check_maps()
        self._check_trie()
        self._check_heap()
        self._check_snapshot_budget()
        if is_free is not None:
            for page in self._page_keys:
                if self._events or page not in self._used:
                    assert is_free(page) != (page in self._used), f"inv 7: page {page} use"

    def _check_maps(self) -> None:
        b = self.block_tokens
        seen: set[tuple[int, Hashable, int]] = set()
        for key, entry in self._entries.items():
            node = entry.node
            assert entry.pages, f"inv 1: empty entry {key!r}"
            assert node.key == key and node.end_tokens > 0 and node.alive, f"inv 2: {node!r}"
            start = node.end_tokens - b if node.end_tokens % b == 0 else node.end_tokens // b * b
            assert node.start_tokens == start, f"inv 2: span of {node!r}"
            assert key in self._kids.get(entry.parent_key, ()), f"inv 5: _kids of {key!r}"
            for group, pages in entry.pages.items():
                assert pages, f"inv 1: empty page set at {key!r} group {group}"
                assert group in self.kv_groups or group in self.state_groups, f"inv 3: {group}"
                assert ((key, group) in self._dups) == (len(pages) > 1), f"inv 5: dups {key!r}"
                for page in pages:
                    assert (key, group) in self._page_keys.get(page, ()), f"inv 1: page {page}"
                    seen.add((page, key, group))
        n_free_state = 0
        for page, held in self._page_keys.items():
            assert held, f"inv 1: page {page} with an empty key set"
            kinds = {self._is_state[g] for _, g in held}
            assert len(kinds) == 1, f"inv 3: page {page} holds KV and state groups: {held}"
            n_free_state += page not in self._used and kinds == {True}
            for key, group in held:
                assert (page, key, group) in seen, f"inv 1: page {page} -> {key!r} not mirrored"
        assert sum(len(k) for k in self._kids.values()) == len(self._entries), "inv 5: _kids"
        by_serial = {e.serial: e for e in self._entries.values()}
        assert self._by_serial == by_serial, "inv 5: _by_serial"
        assert self._events or self._used <= self._page_keys.keys(), "inv 7: _used uncached"
        n_free = sum(p not in self._used for p in self._page_keys)
        assert self._n_free == n_free, f"inv 5: _n_free {self._n_free} != {n_free}"
        assert self._n_free_state == n_free_state, f"inv 5: _n_free_state {self._n_free_state}"

    def _check_snapshot_budget(self) -> None:
        budget = self.snapshot_budget_pages
        if budget is None or self._n_free_state <= budget:
            return
        stuck = sum(
            page not in self._used
            and any(self._is_state[g] and self._entries[k].node.refs for k, g in held)
            for page, held in self._page_keys.items()
        )
        assert self._n_free_state <= budget + stuck, (
            f"inv 8: {self._n_free_state} free state pages > budget {budget} (+{stuck} in use)"
        )

    def _check_trie(self) -> None:
        ref = self._reference_trie()
        assert self._dead == self._entries.keys() - ref.keys(), "inv 5: _dead"
        assert self._n_live == len(ref), f"inv 5: _n_live {self._n_live} != {len(ref)}"
        kids: dict[Hashable, set[Hashable]] = {}
        for key, entry in self._entries.items():
            node, groups = entry.node, entry.pages.values()
            used = [p in self._used for ps in groups for p in ps]
            used_state = [
                p in self._used for g in self.state_groups for p in entry.pages.get(g, ())
            ]
            assert (entry.used, entry.used_state) == (sum(used), sum(used_state)), f"inv 5: {key!r}"
            assert entry.live == (key in ref), f"inv 5: live {key!r}"
            if key not in ref:
                continue
            pk, snap, in_use = ref[key]
            parent = self.root if pk is None else self._entries[pk].node
            assert node.parent is parent, f"inv 5: parent of {node!r}"
            assert node.has_snapshot == snap, f"inv 5: {node!r} != {ref[key]}"
            assert (node.refs == 0) == (in_use == 0), f"inv 5: {node!r} != {ref[key]}"
            kids.setdefault(pk, set()).add(key)
        for key in [None, *ref]:
            node = self.root if key is None else self._entries[key].node
            got = {k.key for k in node.iter_children()}
            assert got == kids.get(key, set()), f"inv 5: children of {node!r}"
            own = 0 if key is None else self._entries[key].used
            busy = sum(ref[k][2] > 0 for k in got)
            assert node.refs == own + busy, f"inv 5: refs of {node!r} != {own} + {busy}"

    def _check_heap(self) -> None:
        by_serial = self._by_serial
        queued = {(i[3], i[2]) for i in self._heap if self._valid(i, by_serial.get(i[2]))}
        for entry in self._entries.values():
            node = entry.node
            if not entry.live or entry.serial in self._dirty:
                continue
            if node.refs == 0 and (_KV, entry.serial) not in queued:
                assert self.policy.kv_priority(node, self.now) is None, f"inv 6: KV {node!r}"
            if node.has_snapshot and entry.used_state == 0 and (_SNAP, entry.serial) not in queued:
                prio = self.policy.snapshot_priority(node, self.now)
                assert prio is None, f"inv 6: snapshot {node!r}"
                if node.refs == 0 and (_KV, entry.serial) not in queued:
                    assert entry.serial in self._unranked, f"inv 6: unranked {node!r}"
