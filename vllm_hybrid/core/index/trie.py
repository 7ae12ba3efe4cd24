"""The index's live trie: the entries a lookup can reach, their ``refs``, and the lookups.

An entry is *live* when every KV group holds a page for it and its parent entry is live and a
full block (an engine's attention hit is a contiguous prefix; a state past a gap cannot be
resumed); a live entry *has a snapshot* when every state group holds a page for it. Live nodes
form a trie under ``root`` (full blocks in ``children``, shorter exact-position entries in
``partials``). ``refs`` counts a node's in-use (page, group) pairs plus its live children with
``refs > 0``, so a change deep in a path in use stops at the first node that stays in use.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

from vllm_hybrid.core.index._base import Entry, IndexFields
from vllm_hybrid.core.node import Match, Node

#: ``probe(block_index, n_tokens)``: the key of a request's first ``n_tokens`` of that block
ProbeFn = Callable[[int, int], Hashable]
#: ``hidden(node, snapshot)``: whether a lookup must not see ``node``'s KV (``snapshot``
#: False) or its snapshot (True), e.g. what requests still in flight inserted (``sim/``)
HiddenFn = Callable[[Node, bool], bool]


class LiveTrie(IndexFields):
    """The live trie over the page map's entries; see the module docstring."""

    def live_node(self, key: Hashable) -> Node | None:
        """``key``'s node if its entry is live (the KV of its whole prefix is held), else None."""
        entry = self._entries.get(key)
        return entry.node if entry is not None and entry.live else None

    def node_of(self, key: Hashable) -> Node | None:
        """The node the policy ranks for ``key``, while the engine holds a page under it."""
        entry = self._entries.get(key)
        return None if entry is None else entry.node

    def __len__(self) -> int:
        return len(self._entries)

    def shared_tokens(
        self,
        parent_key: Hashable | None,
        keys: Sequence[Hashable],
        first: int,
        unit: int,
        limit: int | None = None,
    ) -> int:
        """How many tokens past ``parent_key``'s end a request with chained keys ``keys`` (one
        per ``unit`` tokens; ``keys[first]`` ends the first unit past the parent) shares with
        some entry cached under it: the exact junction inside a block, where vLLM's lookup only
        sees whole blocks and prompt tails. Entries added without ``units`` are not compared.
        Chained keys make the match a prefix (equal at ``k`` means equal below ``k``), so each
        child costs a binary search. ``limit``: compare ``keys[:limit]`` only."""
        best = 0
        end = len(keys) if limit is None else min(limit, len(keys))
        for child_key in self._kids.get(parent_key, ()):
            entry = self._entries.get(child_key)
            if entry is None or entry.units is None:
                continue
            theirs, start = entry.units
            node = entry.node
            n = min((node.end_tokens - node.start_tokens) // unit, len(theirs) - start)
            n = min(n, end - first)
            if n <= best // unit:
                continue
            lo, hi = 0, n  # keys[first + i] == theirs[start + i] for every i < lo
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if keys[first + mid - 1] == theirs[start + mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            best = max(best, lo * unit)
        return best

    def match(
        self,
        block_hashes: Sequence[Hashable],
        max_tokens: int,
        probe: ProbeFn | None = None,
        hidden: HiddenFn | None = None,
        elsewhere: Callable[[Node], bool] | None = None,
    ) -> Match:
        """The longest live KV prefix of ``block_hashes`` within ``max_tokens`` and the deepest
        snapshot on it (a query). With ``probe``, partial (exact-position) entries below the
        path match too. With ``hidden``, the path stops at the first hidden block and hidden
        snapshots do not count. ``elsewhere(node)``: the node's state is held off the pool (a
        host tier); it counts as a snapshot (never hidden). An engine matches with its own code
        (vLLM's ``find_longest_cache_hit``); the simulator and the predictions use this."""
        node, path, best = self.root, [], self.root
        with_partials: list[Node] = [node] if node.partials else []
        for key in block_hashes[: max_tokens // self.block_tokens]:
            child = node.children.get(key)
            if child is None or (hidden is not None and hidden(child, False)):
                break
            node = child
            path.append(child)
            if (child.has_snapshot and (hidden is None or not hidden(child, True))) or (
                elsewhere is not None and elsewhere(child)
            ):
                best = child
            if child.partials:
                with_partials.append(child)
        if probe is not None and with_partials:
            best = self._deepest_partial(with_partials, best, max_tokens, probe, hidden)
        return Match(path, len(path) * self.block_tokens, best, best.end_tokens)

    def _deepest_partial(
        self,
        candidates: list[Node],
        best: Node,
        max_tokens: int,
        probe: ProbeFn,
        hidden: HiddenFn | None,
    ) -> Node:
        """The deepest partial entry with a snapshot below ``candidates`` (path nodes, top
        first) that ends past ``best`` and within ``max_tokens``; else ``best``."""
        b = self.block_tokens
        for node in reversed(candidates):
            for n_tokens in sorted(node.partials, reverse=True):
                end = node.end_tokens + n_tokens
                if end <= best.end_tokens:
                    break
                if end > max_tokens:
                    continue
                hit = node.partials[n_tokens].get(probe(node.end_tokens // b, n_tokens))
                if hit is None or not hit.has_snapshot:
                    continue
                if hidden is None or not (hidden(hit, False) or hidden(hit, True)):
                    return hit
        return best

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

    def _group_added(self, entry: Entry, group: int) -> None:
        if self._is_state[group]:
            entry.node.has_snapshot = entry.pages.keys() >= self.state_groups
            if entry.node.has_snapshot and self.on_snapshot_added is not None:
                self.on_snapshot_added(entry.node)
        elif not entry.live and self._can_live(entry):
            self._attach(entry)

    def _group_removed(self, entry: Entry, group: int) -> None:
        if self._is_state[group]:
            entry.node.has_snapshot = False
            self._mark(entry)
        elif entry.live:
            self._detach(entry)

    def _can_live(self, entry: Entry) -> bool:
        if not entry.pages.keys() >= self.kv_groups:
            return False
        if entry.parent_key is None:
            return True
        parent = self._entries.get(entry.parent_key)
        if parent is None or not parent.live:
            return False
        node = parent.node
        return node.end_tokens - node.start_tokens == self.block_tokens  # a full block

    def _attach(self, top: Entry) -> None:
        """``top`` (whose parent is live) becomes live, with every entry below it that can."""
        if top.node.key not in self._kids:  # no entry below it: the usual, new block
            self._attach_leaf(top)
            return
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

    def _attach_leaf(self, entry: Entry) -> None:
        """:meth:`_attach` of an entry with no entry below it (the same steps, no walk)."""
        node, root = entry.node, self.root
        parent = root if entry.parent_key is None else self._entries[entry.parent_key].node
        node.parent, node.refs = parent, entry.used
        n_tokens = node.end_tokens - node.start_tokens
        if n_tokens == self.block_tokens:
            parent.children[node.key] = node
        else:
            parent.partials.setdefault(n_tokens, {})[node.key] = node
        entry.live = True
        self._dead.discard(node.key)
        self._n_live += 1
        node.version += 1  # _mark, inlined
        self._dirty[entry.serial] = entry
        if node.refs:
            self._add_refs(parent, 1)
        if parent is not root:
            self._mark(self._entries[parent.key])

    def _detach(self, top: Entry) -> None:
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
        if not node.children and not node.partials:  # a leaf: the usual victim
            top.live = False
            self._dead.add(node.key)
            self._n_live -= 1
            node.parent, node.refs = None, 0
            node.version += 1
            return
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

    def _delete(self, entry: Entry) -> None:
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
