"""The index's page map: which engine page holds which (key, group), and which pages are in use.

An engine caches a page under a chained block hash (a *key*) for one KV cache group; the index
mirrors every such (page, key, group) (:meth:`PageMap.add`, :meth:`PageMap.drop_page`,
:meth:`PageMap.move_page`) and every hit (:meth:`PageMap.touch_pages`). Which cached pages are
in use is known in one of two modes (``PrefixIndex`` docstring): *callback* (``is_free(page)``,
re-checked only for the pages believed in use) or *events* (:meth:`PageMap.use_free_events`,
then :meth:`PageMap.page_used` / :meth:`PageMap.page_freed` for every change). Use counts feed
the live trie's ``refs`` (``trie.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from vllm_hybrid.core.index._base import Entry, IndexFields, IsFree, PageKey
from vllm_hybrid.core.node import Node


class PageMap(IndexFields):
    """Pages <-> (key, group) and their use; see the module docstring."""

    def add(
        self,
        page: int,
        key: Hashable,
        group: int,
        end_tokens: int,
        parent_key: Hashable | None,
        origin: int = -1,
        units: tuple[Sequence[Hashable], int] | None = None,
    ) -> bool:
        """The engine cached ``page`` under ``(key, group)``; ``key`` ends at ``end_tokens``.
        ``origin``: the index of the request that computed it (``Node.origin``), if known.
        ``units``: the request's chained keys per match unit and the index of the first unit
        inside this entry's span (kept for :meth:`LiveTrie.shared_tokens`).
        Returns True if ``page`` held nothing before (it is newly cached)."""
        is_state = self._is_state.get(group)
        if is_state is None:
            raise ValueError(f"group {group} is neither a KV nor a state group")
        if self._victims:
            self._victims.pop(page, None)
        if self.holds_key(page, key, group):
            # The same pair again: vLLM re-registers a prompt tail's partial entry at every
            # step of a running request (BlockPool.cache_partial_block inserts even when
            # already_cached). Nothing changed, and the page is in use, so it is not ranked.
            return False
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(key, end_tokens, parent_key)
            entry.node.origin = origin
        if units is not None and entry.units is None:
            entry.units = units
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

    def _new_entry(self, key: Hashable, end: int, parent_key: Hashable | None) -> Entry:
        if end <= 0:
            raise ValueError(f"an entry ends after token 0, got {end}")
        b = self.block_tokens
        start = end - b if end % b == 0 else end // b * b
        node = Node(key, None, start, end, (end - start) * self.kv_bytes_per_token)
        node.last_access = node.snap_access = self.now
        self._serial += 1
        entry = Entry(node, parent_key, self._serial)
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

    def keys_of(self, page: int) -> set[PageKey]:
        return set(self._page_keys.get(page, ()))

    def holds(self, page: int) -> bool:
        return page in self._page_keys

    def holds_key(self, page: int, key: Hashable, group: int) -> bool:
        """Whether ``page`` is cached under ``(key, group)``."""
        held = self._page_keys.get(page)
        return held is not None and (key, group) in held

    def cached_pages(self) -> list[int]:
        return list(self._page_keys)

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

    def _link(self, page: int, key: Hashable, group: int, entry: Entry) -> bool:
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

    def _unlink(self, page: int, key: Hashable, group: int, entry: Entry) -> bool:
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

    def _count_used(self, entry: Entry, group: int, delta: int) -> None:
        entry.used += delta
        if self._is_state[group]:
            entry.used_state += delta
            if entry.used_state == 0:
                self._mark(entry)  # its snapshot may go again
        if entry.live:
            self._add_refs(entry.node, delta)

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
