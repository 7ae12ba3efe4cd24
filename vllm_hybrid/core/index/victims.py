"""The index's victims: policy priorities in one lazy heap, and which free pages go first.

Victims, in this order: free pages of entries that are not live (nothing can hit them), free
duplicate pages of a (key, group) that another page also holds, then policy units: a KV unit
(the entry with its whole live subtree, snapshots included) or a snapshot unit (the state
pages only). A unit with any page in use is never chosen. With a :attr:`lookahead` (an
engine's waiting requests), the units a waiting request would hit go last, in the same order.

A priority is computed when its entry changes (added, touched, child set, snapshot, or it
becomes evictable): :meth:`_mark` makes the entry's heap items stale and queues it, and
:meth:`_flush` ranks the queued entries before the next pop (``core/policy.py``: exact for
priorities that are functions of the entry alone; ``flop``'s GreedyDual clock and
``marconi``/``flop``'s ancestor chains are those of that moment).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Sequence

from vllm_hybrid.core.index._base import KV, SNAP, Entry, IndexFields, IsFree, Item


class VictimPicker(IndexFields):
    """Ranking and picking; see the module docstring."""

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

    def snapshot_excess(self) -> int:
        """Free state pages over :attr:`snapshot_budget_pages` (0 without a budget): what
        :meth:`pick_snapshot_victims` should free after pages were released."""
        budget = self.snapshot_budget_pages
        return 0 if budget is None else max(0, self._n_free_state - budget)

    def pick_victims(self, n_pages: int, is_free: IsFree, kv_only: bool = False) -> list[int]:
        """At least ``n_pages`` free cached pages whose hashes the engine should drop now (fewer
        only if no more can go), in eviction order: every dead or duplicate page, then policy
        units until ``n_pages`` are reached (a unit may overshoot). The victims leave the mirror
        here, as if :meth:`drop_page` had been called (so later units see the trie without
        them); the engine must drop their hashes at once and report it with :meth:`drop_page`,
        which then returns what the victim held and changes nothing else. ``kv_only``: snapshot
        units are passed over (they stay ranked), for a pool whose states have memory of their
        own, so that a KV shortage frees KV (a KV unit's states go with it)."""
        return self._pick(n_pages, 0, is_free, kv_only) if n_pages > 0 else []

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

    def _pick(
        self, n_pages: int, n_state_pages: int, is_free: IsFree, kv_only: bool = False
    ) -> list[int]:
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
            self._pick_units(n_pages, out, is_free, kv_only=kv_only)
        assert all(is_free(p) for p in out), "inv 4: a victim page is in use"
        self.stats.pages += len(out)
        return out

    def _mark(self, entry: Entry) -> None:
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
                    push(heap, (kv_prio, node.end_tokens, serial, KV, node.version))
            if node.has_snapshot and entry.used_state == 0:
                prio = snapshot_priority(node, now)
                if prio is not None:
                    push(heap, (prio, node.end_tokens, serial, SNAP, node.version))
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
    def _valid(item: Item, entry: Entry | None) -> bool:
        """``item`` (of ``entry``, the entry of its serial, if any) still ranks a unit."""
        if entry is None or not entry.live:
            return False
        node = entry.node
        if item[4] != node.version:
            return False
        if item[3] == KV:
            return node.refs == 0
        return node.has_snapshot and entry.used_state == 0

    def _pop_valid(self) -> tuple[Item, Entry] | None:
        if self._dirty:
            self._flush()
        heap, by_serial, pop, valid = self._heap, self._by_serial, heapq.heappop, self._valid
        while heap:
            item = pop(heap)
            entry = by_serial.get(item[2])
            if valid(item, entry):
                assert entry is not None
                return item, entry
        return None

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
        self,
        n_pages: int,
        out: list[int],
        is_free: IsFree,
        state_target: int | None = None,
        kv_only: bool = False,
    ) -> None:
        """Policy units, lowest first, until ``out`` holds ``n_pages`` pages or, with
        ``state_target``, until at most that many free state pages still hold a snapshot
        (units without a state page are then passed over and stay ranked; ``kv_only``: the
        snapshot units are). With a :attr:`lookahead`, the units a waiting request would hit
        are passed over first and taken, lowest first again, only if the others do not
        suffice."""
        taken = set(out)
        wanted = self._wanted
        if wanted is None and self._lookahead is not None:
            paths = itertools.islice(self._lookahead(), self.lookahead_paths)
            wanted = self._wanted = self.wanted_keys(paths)
        loop = self._pick_loop
        held = loop(n_pages, out, taken, is_free, state_target, wanted or None, kv_only)
        self.stats.wanted_units += len(held)
        for item in held:  # ranked again (an item whose entry changed meanwhile is stale)
            heapq.heappush(self._heap, item)
        if held and not self._enough(n_pages, out, state_target):
            before = self.stats.kv_units + self.stats.snapshot_units
            loop(n_pages, out, taken, is_free, state_target, None, kv_only)
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
            pages = self._unit_pages(entry, SNAP)
            if self._all_free(pages, is_free):
                item = (float("-inf"), entry.node.end_tokens, serial, SNAP, entry.node.version)
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
        kv_only: bool = False,
    ) -> list[Item]:
        """One pass of :meth:`_pick_units`; returns the items of the units passed over because
        their key is ``wanted``, lowest first (no longer in the heap)."""
        passed: list[Item] = []
        held: list[Item] = []
        while not self._enough(n_pages, out, state_target):
            popped = self._pop_valid()
            if popped is None:
                break
            item, entry = popped
            pages = self._unit_pages(entry, item[3])
            if not self._all_free(pages, is_free):
                continue  # the mirror had missed a use: the unit waits until it is free
            if state_target is not None and item[3] == KV and not self._holds_state(pages):
                passed.append(item)
            elif kv_only and item[3] == SNAP:
                passed.append(item)
            elif wanted is not None and entry.node.key in wanted:
                held.append(item)
            else:
                self._take_unit(item, entry, pages, out, taken)
        for item in passed:  # still ranked (an item whose entry changed meanwhile is stale)
            heapq.heappush(self._heap, item)
        return held

    def _all_free(self, pages: list[int], is_free: IsFree) -> bool:
        """Every page is free by the mirror's knowledge and by ``is_free``; the first page
        ``is_free`` finds in use (a use the mirror missed) is marked so."""
        used = self._used
        for page in pages:
            if page in used:
                return False
            if not is_free(page):
                self._set_used(page, True)
                return False
        return True

    def _take_unit(
        self, item: Item, entry: Entry, pages: list[int], out: list[int], taken: set[int]
    ) -> None:
        """Evict one policy unit: tell the policy, drop its pages from the mirror."""
        prio, kind = item[0], item[3]
        self.policy.on_evict(prio)
        hook = self._on_evicted  # the policy's optional hook (core/policy.py)
        if hook is not None:  # before the unit goes
            hook(entry.node, kind == SNAP, self._n_live)  # live entries, not units
        if kind == SNAP:
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

    def _unit_pages(self, entry: Entry, kind: int) -> list[int]:
        """A snapshot unit's state pages, or a KV unit's pages (all groups, whole subtree),
        top first."""
        if kind == SNAP:
            pages = entry.pages
            return sorted(p for g in self.state_groups if g in pages for p in pages[g])
        node = entry.node
        if not node.children and not node.partials:  # a leaf (the usual unit)
            return sorted({p for ps in entry.pages.values() for p in ps})
        out: dict[int, None] = {}
        stack = [entry.node]
        while stack:
            node = stack.pop()
            stack.extend(node.iter_children())
            pages = self._entries[node.key].pages
            out.update(dict.fromkeys(sorted(p for ps in pages.values() for p in ps)))
        return list(out)
