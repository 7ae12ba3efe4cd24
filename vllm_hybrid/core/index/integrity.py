"""The index's invariants (``PrefixIndex`` docstring, numbered as there), checked from scratch.

O(size): for tests and the engine's debug mode (``hybrid_checks``), never on a hot path.
"""

from __future__ import annotations

from collections.abc import Hashable

from vllm_hybrid.core.index._base import KV, SNAP, IndexFields, IsFree


class IndexIntegrity(IndexFields):
    """``check_integrity`` and the from-scratch reference it compares with."""

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
            if node.refs == 0 and (KV, entry.serial) not in queued:
                assert self.policy.kv_priority(node, self.now) is None, f"inv 6: KV {node!r}"
            if node.has_snapshot and entry.used_state == 0 and (SNAP, entry.serial) not in queued:
                prio = self.policy.snapshot_priority(node, self.now)
                assert prio is None, f"inv 6: snapshot {node!r}"
                if node.refs == 0 and (KV, entry.serial) not in queued:
                    assert entry.serial in self._unranked, f"inv 6: unranked {node!r}"
