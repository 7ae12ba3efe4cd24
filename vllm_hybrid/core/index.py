"""The hybrid prefix index: a trie of chained block hashes holding KV blocks and state snapshots.

Query/commit pairs in the style of nano-vllm's ``can_allocate``/``allocate``: :meth:`match` only
reads; :meth:`lock`, :meth:`insert_block`, :meth:`admit_snapshot`, :meth:`admit_partial` and
:meth:`evict` commit. An engine adapter drives it per request::

    m = index.match(block_hashes, max_tokens=num_prompt_tokens - 1)   # skip [0, m.hit_tokens)
    h = index.lock(m.kv_nodes[-1] if m.kv_nodes else index.root)       # protect the path
    index.touch(m, now)                                                 # record the use
    node = index.insert_block(h, next_hash, now)  # None: budget full of locked entries
    index.admit_snapshot(node, now)               # state at node.end_tokens (node must be locked)
    index.unlock(h)                                                    # request finished

An engine with a fixed pool asks ``index.evict(n * index.kv_bytes_per_block)`` and frees the
returned block hashes and snapshots. Which entry goes first is the policy's pure priority
(lower is evicted first); the index keeps a lazy heap of (priority, node) entries.

Invariants (asserted by :meth:`check_integrity`, numbered as there):

1. Tree: every live non-root node is in its parent's ``children`` (full node, exactly
   ``block_tokens`` long) or ``partials[n_tokens]`` (partial node, shorter, a leaf that holds a
   snapshot); ``start_tokens == parent.end_tokens``; its parent is live.
2. Keys are unique: ``_by_key`` maps each live node's key to it and holds nothing else.
3. A snapshot is only held by a live node, so the KV of its whole prefix ``[0, end_tokens)`` is
   held (the node and all its ancestors are live).
4. ``node.refs`` equals the number of active lock handles at the node or below it; every active
   handle points to a live node. A node with ``refs > 0`` (KV or snapshot) is never evicted
   (with ``hold_snapshots=False`` the snapshot of a full node may be, its KV never).
5. ``used_bytes`` equals the KV bytes of all live nodes plus ``snapshot_bytes`` per snapshot,
   and ``n_snapshots`` the number of snapshots held.
6. ``used_bytes <= peak_bytes <= budget_bytes``: the budget is never exceeded, not even
   transiently (room is made before bytes are taken).

With a :class:`~vllm_hybrid.core.host_tier.HostTier` (``host=``), a snapshot the policy evicts
alone is demoted there instead of lost; :meth:`match` counts host snapshots as resume points and
:meth:`promote` brings the one a request hits back to the device. The tier's own invariants (H1,
H2) are checked with the index's.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence

from vllm_hybrid.core.host_tier import HostTier
from vllm_hybrid.core.node import Eviction, LockHandle, Match, Node
from vllm_hybrid.core.policy import EvictionPolicy

_KV, _SNAP = 0, 1
ProbeFn = Callable[[int, int], Hashable]
#: ``hidden(node, snapshot)``: whether a lookup must not see ``node``'s KV (``snapshot`` False)
#: or its snapshot (True), e.g. what requests still in flight inserted (``sim/replay.py``).
HiddenFn = Callable[[Node, bool], bool]


class BudgetError(RuntimeError):
    """Raised when a commit is asked for that the caller should have made room for."""


class PrefixIndex:
    """KV blocks + state snapshots under one strict byte budget, evicted by a policy."""

    def __init__(
        self,
        *,
        block_tokens: int,
        kv_bytes_per_token: int,
        snapshot_bytes: int,
        budget_bytes: int,
        policy: EvictionPolicy,
        record_evictions: bool = False,
        host: HostTier | None = None,
        hold_snapshots: bool = True,
    ) -> None:
        if block_tokens <= 0 or budget_bytes < 0 or kv_bytes_per_token < 0 or snapshot_bytes < 0:
            raise ValueError("block_tokens must be > 0 and byte sizes >= 0")
        self.block_tokens = block_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.kv_bytes_per_block = kv_bytes_per_token * block_tokens
        self.snapshot_bytes = snapshot_bytes
        self.budget_bytes = budget_bytes
        self.policy = policy
        #: False: a lock protects the KV of its path, not the snapshots of full blocks on it
        #: (they stay ranked and evictable by the policy's priority while locked), as vLLM's
        #: align mode frees a running request's state blocks once it has computed past them
        #: (``sim/replay.py``, ``hold_snapshots``). A partial node (KV and state in one) is
        #: still protected: evicting it removes the node.
        self.hold_snapshots = hold_snapshots
        self.root = Node(None, None, 0, 0, 0)
        self.used_bytes = 0
        self.peak_bytes = 0
        self.n_snapshots = 0
        self.evicted_kv_blocks = 0
        self.evicted_snapshots = 0
        self.snapshots_admitted = 0
        self.now = 0
        self._by_key: dict[Hashable, Node] = {}
        self._handles: set[LockHandle] = set()
        self._heap: list[tuple[float, int, int, Node, int]] = []
        self._seq = 0
        self._log: Eviction | None = Eviction() if record_evictions else None
        # Optional policy hook, called before an entry goes: (node, snapshot_only, entries held).
        self._on_evicted: Callable[[Node, bool, int], None] | None = getattr(
            policy, "on_evicted", None
        )
        self.host = host
        if host is not None:
            host.attach(snapshot_bytes)
            bind = getattr(policy, "bind_host", None)
            if bind is not None:
                bind(host)

    # ----------------------------------------------------------------- queries
    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def get(self, key: Hashable) -> Node | None:
        return self._by_key.get(key)

    def match(
        self,
        block_hashes: Sequence[Hashable],
        max_tokens: int,
        probe: ProbeFn | None = None,
        hidden: HiddenFn | None = None,
    ) -> Match:
        """Longest cached KV prefix of ``block_hashes`` within ``max_tokens`` and the deepest
        snapshot on it. ``probe(block_index, n_tokens)`` returns the key of the request's first
        ``n_tokens`` of block ``block_index``; with it, partial (exact-position) snapshots match.
        A snapshot on the host tier counts (``on_host(m.hit_node)``; see :meth:`promote`).
        With ``hidden``, the KV path stops at the first hidden block and hidden snapshots do
        not count (a host snapshot is never hidden)."""
        node, path, best = self.root, [], self.root
        host = self.host
        with_partials: list[Node] = [self.root] if self.root.partials else []
        for key in block_hashes[: max_tokens // self.block_tokens]:
            child = node.children.get(key)
            if child is None or (hidden is not None and hidden(child, False)):
                break
            node = child
            path.append(child)
            if (child.has_snapshot and (hidden is None or not hidden(child, True))) or (
                host is not None and host.holds(child)
            ):
                best = child
            if child.partials:
                with_partials.append(child)
        if probe is not None:
            best = self._match_partials(with_partials, best, max_tokens, probe, hidden)
        return Match(path, len(path) * self.block_tokens, best, best.end_tokens)

    def _match_partials(
        self,
        candidates: list[Node],
        best: Node,
        max_tokens: int,
        probe: ProbeFn,
        hidden: HiddenFn | None = None,
    ) -> Node:
        for node in reversed(candidates):
            for n_tokens in sorted(node.partials, reverse=True):
                end = node.end_tokens + n_tokens
                if end <= best.end_tokens:
                    break
                if end > max_tokens:
                    continue
                hit = node.partials[n_tokens].get(
                    probe(node.end_tokens // self.block_tokens, n_tokens)
                )
                if hit is not None and (hidden is None or not hidden(hit, False)):
                    best = hit
                    break
        return best

    def on_host(self, node: Node) -> bool:
        """Whether ``node``'s snapshot is on the host tier (not the device)."""
        return self.host is not None and self.host.holds(node)

    # ----------------------------------------------------------------- locks and use
    def lock(self, node: Node) -> LockHandle:
        """Protect ``node`` and its ancestors (KV and snapshots) until :meth:`unlock`."""
        if not node.alive:
            raise ValueError(f"cannot lock evicted {node!r}")
        handle = LockHandle(node)
        self._handles.add(handle)
        walk: Node | None = node
        while walk is not None:
            walk.refs += 1
            walk = walk.parent
        return handle

    def unlock(self, handle: LockHandle) -> None:
        if not handle.active:
            raise ValueError("lock handle already released")
        handle.active = False
        self._handles.discard(handle)
        walk: Node | None = handle.node
        while walk is not None:
            walk.refs -= 1
            if walk.refs == 0:
                self._refresh(walk)
            walk = walk.parent

    def touch(self, m: Match, now: int) -> None:
        """Record that a request used the KV path of ``m`` and the snapshot at its hit."""
        self.now = now
        for node in m.kv_nodes:
            node.last_access = now
            node.hits += 1
            self._refresh(node)
        if m.hit_node is not self.root:
            hit = m.hit_node
            hit.snap_access = now
            hit.snap_hits += 1
            hit.last_access = now
            self._refresh(hit)

    # ----------------------------------------------------------------- commits
    def insert_block(
        self, handle: LockHandle, key: Hashable, now: int, origin: int = -1
    ) -> Node | None:
        """Add (or reuse) the full block ``key`` under the handle's node and move the handle
        onto it. Evicts to make room; returns ``None`` (nothing changed) if it cannot."""
        parent = self._live_handle_node(handle)
        child = parent.children.get(key)
        if child is None:
            if key in self._by_key:
                raise ValueError(f"key {key!r} already cached elsewhere in the tree")
            if not self._make_room(self.kv_bytes_per_block):
                return None
            child = Node(
                key,
                parent,
                parent.end_tokens,
                parent.end_tokens + self.block_tokens,
                self.kv_bytes_per_block,
            )
            child.origin = origin
            parent.children[key] = child
            self._by_key[key] = child
            self._take(self.kv_bytes_per_block)
            self._refresh(parent)
        child.last_access = now
        child.refs += 1  # the handle moves down: ancestors already count it
        handle.node = child
        return child

    def admit_snapshot(self, node: Node, now: int) -> bool:
        """Keep a state snapshot at ``node.end_tokens``; the node must be locked."""
        if not node.alive or node.refs == 0:
            raise ValueError(f"admit_snapshot needs a live, locked node, got {node!r}")
        if not node.has_snapshot:
            if not self._make_room(self.snapshot_bytes):
                return False
            if self.host is not None:
                self.host.discard(node.key, superseded=True)  # one tier at a time
            node.has_snapshot = True
            self.n_snapshots += 1
            self.snapshots_admitted += 1
            self._take(self.snapshot_bytes)
        node.snap_access = now
        if self.hold_snapshots:
            node.version += 1  # ranked when unlocked
        else:
            self._refresh(node)  # the node is locked: its snapshot is ranked now
        return True

    def admit_partial(
        self, handle: LockHandle, key: Hashable, n_tokens: int, now: int, origin: int = -1
    ) -> Node | None:
        """Keep the KV of ``n_tokens < block_tokens`` tokens after the handle's node and the
        state at their end (an exact-position snapshot). The handle does not move."""
        parent = self._live_handle_node(handle)
        if not 0 < n_tokens < self.block_tokens:
            raise ValueError(f"partial block needs 0 < n_tokens < {self.block_tokens}")
        group = parent.partials.get(n_tokens, {})
        if key in group:
            group[key].snap_access = group[key].last_access = now
            return group[key]
        if key in self._by_key:
            raise ValueError(f"key {key!r} already cached elsewhere in the tree")
        need = n_tokens * self.kv_bytes_per_token + self.snapshot_bytes
        if not self._make_room(need):
            return None
        node = Node(
            key,
            parent,
            parent.end_tokens,
            parent.end_tokens + n_tokens,
            n_tokens * self.kv_bytes_per_token,
        )
        node.has_snapshot = True
        node.origin = origin
        node.last_access = node.snap_access = now
        parent.partials.setdefault(n_tokens, {})[key] = node
        self._by_key[key] = node
        self.n_snapshots += 1
        self.snapshots_admitted += 1
        self._take(need)
        self._refresh(parent)
        self._refresh(node)
        return node

    def promote(self, m: Match, now: int) -> bool:
        """Serve ``m``'s hit from the host tier if that is where its snapshot is: copy it back
        to the device (made room for by the policy, like any admit). The caller has locked the
        path. Returns whether the hit came from the host; if the device has no room (all of it
        locked), the state is used from the host and stays there."""
        host, node = self.host, m.hit_node
        if host is None or not host.holds(node):
            return False
        if node.refs == 0:
            raise ValueError(f"promote needs the hit path locked, got {node!r}")
        priority = host.take(node)
        if self._make_room(self.snapshot_bytes):
            node.has_snapshot = True
            self.n_snapshots += 1
            self._take(self.snapshot_bytes)
            node.snap_access = now
            node.version += 1
        else:
            host.demote(node, priority)
        return True

    def pop_evictions(self) -> Eviction:
        """Everything evicted since the last call, including evictions made inside
        :meth:`insert_block` and the admits (needs ``record_evictions=True``)."""
        if self._log is None:
            raise ValueError("construct the index with record_evictions=True")
        out, self._log = self._log, Eviction()
        return out

    def evict(self, bytes_needed: int) -> Eviction:
        """Evict by policy priority until ``free_bytes >= bytes_needed`` or nothing evictable
        is left (check ``free_bytes`` afterwards). Locked entries are never evicted."""
        out = Eviction()
        while self.free_bytes < bytes_needed:
            entry = self._pop_valid()
            if entry is None:
                break
            priority, kind, node = entry
            self.policy.on_evict(priority)
            snapshot_only = kind == _SNAP and node.n_tokens == self.block_tokens
            if self._on_evicted is not None:
                self._on_evicted(node, snapshot_only, self.n_snapshots + len(self._by_key))
            if snapshot_only:
                self._drop_snapshot(node, out)
                if self.host is not None:
                    self.host.demote(node, priority)  # its KV stays: the state may too
            else:
                self._evict_subtree(node, out)
        if self._log is not None:
            self._log.kv_keys += out.kv_keys
            self._log.snapshot_keys += out.snapshot_keys
            self._log.freed_bytes += out.freed_bytes
        return out

    # ----------------------------------------------------------------- internals
    def _live_handle_node(self, handle: LockHandle) -> Node:
        if not handle.active or not handle.node.alive:
            raise ValueError("lock handle is released or its node was evicted")
        if handle.node.n_tokens != self.block_tokens and handle.node is not self.root:
            raise ValueError("cannot extend a partial node")
        return handle.node

    def _make_room(self, bytes_needed: int) -> bool:
        if bytes_needed > self.free_bytes:
            self.evict(bytes_needed)
        return bytes_needed <= self.free_bytes

    def _take(self, n_bytes: int) -> None:
        self.used_bytes += n_bytes
        if self.used_bytes > self.budget_bytes:
            raise BudgetError(f"budget exceeded: {self.used_bytes} > {self.budget_bytes}")
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def _refresh(self, node: Node) -> None:
        """Re-rank ``node`` after a change: stale heap entries are skipped by version."""
        node.version += 1
        if node is self.root:
            return
        if node.refs:  # pushed again when unlocked, but for a snapshot a lock does not hold
            if not self.hold_snapshots and self._loose_snapshot(node):
                prio = self.policy.snapshot_priority(node, self.now)
                if prio is not None:
                    self._push(prio, _SNAP, node)
            return
        now = self.now
        prio = self.policy.kv_priority(node, now)
        if prio is not None:
            self._push(prio, _KV, node)
        if node.has_snapshot:
            prio = self.policy.snapshot_priority(node, now)
            if prio is not None:
                self._push(prio, _SNAP, node)

    def _push(self, priority: float, kind: int, node: Node) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (priority, self._seq, kind, node, node.version))
        if len(self._heap) > 4 * (len(self._by_key) + 1024):
            self._compact()

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._valid(e[2], e[3], e[4])]
        heapq.heapify(self._heap)

    def _valid(self, kind: int, node: Node, version: int) -> bool:
        if not node.alive or node.version != version:
            return False
        if node.refs:  # locked: only a snapshot a lock does not hold may go
            return not self.hold_snapshots and kind == _SNAP and self._loose_snapshot(node)
        return kind == _KV or node.has_snapshot

    def _loose_snapshot(self, node: Node) -> bool:
        """With ``hold_snapshots=False``: ``node`` holds a snapshot that may go while it is
        locked (a full node's; a partial node's state goes only with the node)."""
        return node.has_snapshot and node.n_tokens == self.block_tokens

    def _pop_valid(self) -> tuple[float, int, Node] | None:
        while self._heap:
            priority, _, kind, node, version = heapq.heappop(self._heap)
            if self._valid(kind, node, version):
                return priority, kind, node
        return None

    def _drop_snapshot(self, node: Node, out: Eviction) -> None:
        node.has_snapshot = False
        self.n_snapshots -= 1
        self.used_bytes -= self.snapshot_bytes
        self.evicted_snapshots += 1
        out.snapshot_keys.append(node.key)
        out.freed_bytes += self.snapshot_bytes
        self._refresh(node)

    def _evict_subtree(self, top: Node, out: Eviction) -> None:
        parent = top.parent
        assert parent is not None and top.refs == 0
        if top.n_tokens == self.block_tokens:
            del parent.children[top.key]
        else:
            group = parent.partials[top.n_tokens]
            del group[top.key]
            if not group:
                del parent.partials[top.n_tokens]
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.iter_children())
            if node.has_snapshot:
                node.has_snapshot = False
                self.n_snapshots -= 1
                self.used_bytes -= self.snapshot_bytes
                self.evicted_snapshots += 1
                out.snapshot_keys.append(node.key)
                out.freed_bytes += self.snapshot_bytes
            elif self.host is not None:
                self.host.discard(node.key)  # a state without its KV is useless
            node.alive = False
            del self._by_key[node.key]
            self.used_bytes -= node.kv_bytes
            out.freed_bytes += node.kv_bytes
            out.kv_keys.append(node.key)
            self.evicted_kv_blocks += 1
        self._refresh(parent)

    # ----------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Assert invariants 1-6 of the class docstring (O(size); for tests)."""
        from vllm_hybrid.core.integrity import check_index

        check_index(self)
        if self.host is not None:
            self.host.check(self._by_key, self.block_tokens)
