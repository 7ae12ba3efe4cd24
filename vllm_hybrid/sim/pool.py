"""The simulator's page pool: pages, reference counts and a byte budget under the one index.

The simulator runs the engine's index (``core/index/``) over this pool, as the engine runs it
over vLLM's ``BlockPool``: the pool owns pages and their reference counts, caches each page
under one (block hash, group), reports every change to the index (events mode) and asks the
index which free pages go when it needs room. So a simulated replay and an engine replay of
the same token ids rank, keep and evict by the same code; only the pool underneath differs.

How it models vLLM's pool, and where it does not:

* one KV group (``KV_GROUP``, all attention layers) and one state group (``STATE_GROUP``, all
  recurrent layers); a page holds one block of KV or one state snapshot;
* a page has the bytes it really takes (a full KV block ``block_tokens * kv_bytes_per_token``,
  a partial one ``n_tokens * kv_bytes_per_token``, a state ``snapshot_bytes``); vLLM pads every
  page to one size (``bench/predict.py`` gives the simulator those bytes when it predicts an
  engine row);
* a page is cached the moment it is written (the simulator knows every block's content), so
  the pool has no uncached pages; a key is cached once (no duplicate pages), but for the
  stale copies of ``vllm_queue`` (below);
* a request holds pages through a :class:`LockHandle`: the KV of its path, with
  ``hold_snapshots`` the states on it too (else, as vLLM's align mode frees a state block once
  a request has computed past it, states are free and rankable while the request runs); a
  partial block's state is always held with it. A held page is in use and never a victim.

vLLM's own free queue (``vllm_queue=N``, off by default; ``bench/predict.py`` sets it for the
``stock`` row, N the engine's state groups): the pool evicts as vLLM 0.32's ``BlockPool`` does,
not by the index's units. vLLM keeps one queue of free blocks; a block enters it at its tail when
its last holder frees it (a finished request frees its attention blocks last block first, then
each Mamba group's, ``SingleTypeKVCacheManager.free``; a running request frees the states it has
computed past, ``MambaManager.remove_skipped_blocks``), a hit takes it out, and
``get_new_blocks`` pops the head, dropping the hashes of a cached block it pops. Uncached free
blocks go to the head (``BlockPool.free_blocks``), so they are used before any cached one is
evicted: the pool's free bytes. Three consequences the units of the index do not have:

* pages go one at a time: a snapshot is N pages (one per Mamba group), and popping one of them
  leaves the state unusable (the index drops it) while its other pages stay until the queue
  reaches them (*orphans*); a block whose parent was evicted stays too (the index holds it as
  not live, and a hit may revive it once the parent is cached again, as in vLLM);
* stale copies: a request recomputes every block from its hit on, and vLLM caches a recomputed
  block's new page next to the page that already held its hash (``BlockHashToBlockMap`` holds
  several blocks per hash). The old page stays in the queue where it was (an orphan slot here;
  the key's page is the new one, held by the request); a hit takes the page cached first
  (``get_one_block``), so a hit on a key with an older copy takes that one out of the queue and
  leaves the key's page where it was. A copy's bytes are taken when the request touches the
  block, before it allocates, so its allocation may evict the old page itself, as vLLM's may;
* nothing is evicted that the queue has not reached, whatever the policy ranks.

Invariants (:meth:`SimPool.check_integrity`, with the index's own and the host tier's):

P1. Every page is cached in the index under exactly the one (key, group) the pool gave it,
    and the index holds no other page.
P2. A page's reference count is the number of active handles that hold it; every active
    handle's pages exist.
P3. ``used_bytes`` is the sum of the pages' bytes, and ``used_bytes <= peak_bytes <=
    budget_bytes``: room is made before bytes are taken, never after. ``used_state_bytes`` is
    the sum of the state pages' bytes; with a state pool each pool stays within its budget.
    With ``vllm_queue``, ``used_bytes`` also counts the orphans' bytes (between a stale copy's
    making and the request's allocation it may exceed the budget; never after).
P4. With ``vllm_queue``: every page in the queue is cached and free, every free cached page is
    in the queue or waits for the next ``flush_free``, and ``orphan_bytes`` is the orphans'.

Two pools (``state_budget_bytes``, off by default), as SGLang sizes a Mamba pool apart from the
KV pool: states take their bytes from ``state_budget_bytes``, KV from the rest of the budget; a
state shortage evicts what frees states (a leaf's KV goes with its state), a KV shortage what
frees KV (snapshot units are passed over), each in the policy's order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

from vllm_hybrid.core import (
    EvictionPolicy,
    HiddenFn,
    HostLedger,
    Match,
    Node,
    PrefixIndex,
    ProbeFn,
    host_slots,
)

KV_GROUP, STATE_GROUP = 0, 1


class BudgetError(RuntimeError):
    """A commit took bytes the pool had not made room for (a bug, never bad input)."""


class _Slot:
    """A place in vLLM's free queue (``vllm_queue``): one page, or one Mamba group's page of a
    snapshot (``part``), of ``n_bytes``; ``page`` None once it is an orphan (a stale copy, or
    what is left of a snapshot that lost a page)."""

    __slots__ = ("page", "part", "n_bytes", "key")

    def __init__(self, page: int | None, part: int, n_bytes: int, key: Hashable) -> None:
        self.page = page
        self.part = part
        self.n_bytes = n_bytes
        self.key = key  # the (key, group) its page held: what an orphan was


class LockHandle:
    """A request's hold on pages: the KV (and states) of its path, moved down as it inserts.

    ``node`` is the deepest full block of the path (the root before any); ``pages`` the pages
    held (each once)."""

    __slots__ = ("node", "pages", "active")

    def __init__(self, node: Node) -> None:
        self.node = node
        self.pages: set[int] = set()
        self.active = True


class SimPool:
    """A page pool with a byte budget whose cache the one prefix index ranks."""

    def __init__(
        self,
        *,
        block_tokens: int,
        kv_bytes_per_token: int,
        snapshot_bytes: int,
        budget_bytes: int,
        policy: EvictionPolicy,
        host_bytes: int = 0,
        host_bandwidth: float = 25e9,
        hold_snapshots: bool = True,
        state_budget_bytes: int | None = None,
        vllm_queue: int = 0,
    ) -> None:
        if vllm_queue and (state_budget_bytes is not None or host_bytes > 0):
            raise ValueError("vllm_queue models vLLM's one pool: no state pool, no host tier")
        if state_budget_bytes is not None and not 0 <= state_budget_bytes <= budget_bytes:
            raise ValueError(f"state pool {state_budget_bytes} outside 0..{budget_bytes}")
        if block_tokens <= 0 or budget_bytes < 0 or kv_bytes_per_token < 0 or snapshot_bytes < 0:
            raise ValueError("block_tokens must be > 0 and byte sizes >= 0")
        self.block_tokens = block_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.kv_bytes_per_block = kv_bytes_per_token * block_tokens
        self.snapshot_bytes = snapshot_bytes
        self.budget_bytes = budget_bytes
        self.state_budget_bytes = state_budget_bytes
        self.hold_snapshots = hold_snapshots
        self.index = PrefixIndex(
            block_tokens=block_tokens,
            kv_groups=[KV_GROUP],
            state_groups=[STATE_GROUP],
            policy=policy,
            kv_bytes_per_token=kv_bytes_per_token,
        )
        self.index.use_free_events()
        self.host: HostLedger | None = None
        if host_bytes > 0 and snapshot_bytes > 0 and host_slots(host_bytes, snapshot_bytes):
            slots = host_slots(host_bytes, snapshot_bytes)
            self.host = HostLedger(self.index, slots, snapshot_bytes, host_bandwidth)
        self.used_bytes = self.peak_bytes = self.used_state_bytes = 0
        self.snapshots_admitted = self.evicted_kv_blocks = self.evicted_snapshots = 0
        self._next_page = 0
        self._bytes: dict[int, int] = {}  # page -> its bytes
        self._page_of: dict[int, tuple[Hashable, int]] = {}  # page -> (key, group)
        self._pages: tuple[dict[Hashable, int], dict[Hashable, int]] = ({}, {})  # by group
        self._refs: dict[int, int] = {}  # page -> handles holding it (absent: 0)
        self._handles: set[LockHandle] = set()
        self._pending_free: list[int] = []
        #: vllm_queue: the number of pages of a snapshot (0: the index's units evict)
        self.vllm_queue = vllm_queue
        self._queue: dict[int, _Slot] = {}  # slot id -> slot, head first
        self._next_slot = 0
        self._slots_of: dict[int, list[int]] = {}  # page -> its slots in the queue
        self.orphan_bytes = 0
        #: per key: its stale copies (insertion serial, slot) and its own page's serial
        self._copies: dict[Hashable, list[tuple[int, int]]] = {}
        self._main_serial: dict[Hashable, int] = {}
        self._copy_key: dict[int, Hashable] = {}  # a stale copy's slot -> its key
        self._serial = 0
        self.copies_made = 0

    # ----------------------------------------------------------------- queries
    @property
    def root(self) -> Node:
        return self.index.root

    @property
    def now(self) -> int:
        return self.index.now

    @now.setter
    def now(self, t: int) -> None:
        self.index.now = t

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    @property
    def n_snapshots(self) -> int:
        return len(self._pages[STATE_GROUP])

    def node_of(self, key: Hashable) -> Node | None:
        return self.index.node_of(key)

    def on_host(self, node: Node) -> bool:
        """Whether ``node``'s snapshot is on the host tier (not in the pool)."""
        return self.host is not None and self.host.tier.holds(node)

    def match(
        self,
        block_hashes: Sequence[Hashable],
        max_tokens: int,
        probe: ProbeFn | None = None,
        hidden: HiddenFn | None = None,
    ) -> Match:
        """The index's lookup, host snapshots counted (:meth:`PrefixIndex.match`)."""
        host = None if self.host is None else self.host.tier.holds
        return self.index.match(block_hashes, max_tokens, probe, hidden, host)

    # ----------------------------------------------------------------- holds
    def lock(self, node: Node) -> LockHandle:
        """Hold the KV of ``node`` and its ancestors (and their states with
        ``hold_snapshots``; a partial node's state always) until :meth:`unlock`."""
        if not node.alive:
            raise ValueError(f"cannot lock deleted {node!r}")
        handle = LockHandle(node if node.n_tokens == self.block_tokens else node.parent or node)
        pages: list[int] = []
        walk: Node | None = node
        kv, states = self._pages
        while walk is not None and walk is not self.root:
            pages.append(kv[walk.key])
            state = states.get(walk.key)
            if state is not None and (self.hold_snapshots or walk.n_tokens != self.block_tokens):
                pages.append(state)
            walk = walk.parent
        self._handles.add(handle)
        self._hold(handle, pages)
        return handle

    def unlock(self, handle: LockHandle) -> None:
        if not handle.active:
            raise ValueError("lock handle already released")
        handle.active = False
        self._handles.discard(handle)
        self._release(handle, list(handle.pages))

    def touch(self, handle: LockHandle, m: Match) -> None:
        """A request used ``m``: its KV path and the state it resumes from (held by
        ``handle`` as in use; the state let go at once without ``hold_snapshots``)."""
        kv, states = self._pages
        pages = [kv[n.key] for n in m.kv_nodes]
        hit = m.hit_node
        state = states.get(hit.key) if hit is not self.root else None
        if hit.n_tokens != self.block_tokens and hit is not self.root:
            pages.append(kv[hit.key])
        if state is not None:
            pages.append(state)
        self._hold(handle, pages)
        self.index.touch_pages(pages)
        if state is not None and not self.hold_snapshots:
            self._release(handle, [state])

    # ----------------------------------------------------------------- vLLM's free queue
    def before_hit(self, m: Match) -> None:
        """``vllm_queue``: what a request's lookup ``m`` does to the queue before the request
        holds its path (call it before :meth:`lock`): the hit's blocks take their first-cached
        copies, and each KV block past the hit (the request recomputes it) leaves its old page
        in the queue as a stale copy."""
        n_hit = m.hit_tokens // self.block_tokens
        for node in m.kv_nodes[:n_hit]:
            self._hit_first_copy(node.key)
        for node in m.kv_nodes[n_hit:]:
            self._leave_copy(node.key)

    def recompute_block(self, handle: LockHandle, node: Node) -> None:
        """``vllm_queue``: a request recomputes cached ``node`` past its KV match (a hit never
        covers the prompt's last token): its old page stays in the queue as a stale copy and
        the key's page is the request's, held and used now."""
        page = self._pages[KV_GROUP][node.key]
        self._leave_copy(node.key)
        self._hold(handle, [page])
        self.index.touch_pages([page])

    def _leave_copy(self, key: Hashable) -> None:
        """The page of ``key`` stays in the queue where it is, as an orphan (a stale copy);
        the key's page counts again from now (the request's new page): its bytes are taken,
        past the budget until the next :meth:`make_room`."""
        page = self._pages[KV_GROUP][key]
        slots = self._slots_of.pop(page, None)
        if not slots:
            return  # held elsewhere: not modelled (one request at a time never does this)
        for sid in slots:
            slot = self._queue[sid]
            slot.page = None
            self.orphan_bytes += slot.n_bytes
            self.used_bytes += slot.n_bytes
            self._copies.setdefault(key, []).append((self._main_serial.get(key, -1), sid))
            self._copy_key[sid] = key
        self._serial += 1
        self._main_serial[key] = self._serial
        self.copies_made += 1

    def _hit_first_copy(self, key: Hashable) -> None:
        """A hit on ``key`` takes the page cached first (``get_one_block``): if that is a stale
        copy in the queue, the copy leaves the queue and the key's page stays where it was
        (as an orphan: the two pages swap roles)."""
        copies = self._copies.get(key)
        if not copies:
            return
        serial, sid = min(copies)
        main = self._main_serial.get(key, -1)
        if serial > main:
            return
        page = self._pages[KV_GROUP][key]
        slots = self._slots_of.get(page)
        if not slots:
            return  # the key's page is held: the hit takes it
        copies.remove((serial, sid))
        del self._copy_key[sid]
        gone = self._queue.pop(sid)
        self.orphan_bytes -= gone.n_bytes
        self.used_bytes -= gone.n_bytes
        self._leave_copy(key)  # the key's page becomes the copy at its place ...
        self._main_serial[key] = serial  # ... and takes the first copy's rank
        self.copies_made -= 1

    def _enqueue(self, pages: Sequence[int]) -> None:
        """``pages`` became free: to the queue's tail in vLLM's order (the attention group's
        blocks last block first, then each Mamba group's page of the states, last first)."""
        kv, st = [], []
        for page in pages:
            key, group = self._page_of[page]
            node = self.index.node_of(key)
            end = node.end_tokens if node is not None else 0
            (kv if group == KV_GROUP else st).append((-end, page))
        kv.sort()
        st.sort()
        for _, page in kv:
            self._push(page, 0, self._bytes[page])
        n = self.vllm_queue
        for part in range(n):
            for _, page in st:
                size = self._bytes[page]
                self._push(page, part, size // n + (size % n if part == n - 1 else 0))

    def _push(self, page: int, part: int, n_bytes: int) -> None:
        sid = self._next_slot
        self._next_slot += 1
        self._queue[sid] = _Slot(page, part, n_bytes, self._page_of[page])
        self._slots_of.setdefault(page, []).append(sid)

    def _dequeue(self, page: int) -> None:
        for sid in self._slots_of.pop(page, ()):
            del self._queue[sid]

    def _evict_head(self) -> bool:
        """Pop the queue's head (``get_new_blocks``); False if the queue is empty."""
        if not self._queue:
            return False
        sid = next(iter(self._queue))
        slot = self._queue.pop(sid)
        page = slot.page
        if page is None:  # an orphan: its bytes go
            self.orphan_bytes -= slot.n_bytes
            self.used_bytes -= slot.n_bytes
            key = self._copy_key.pop(sid, None)
            copies = self._copies.get(key) if key is not None else None
            if copies:
                copies[:] = [c for c in copies if c[1] != sid]
            return True
        slots = self._slots_of[page]
        slots.remove(sid)
        rest = [self._queue[s] for s in slots]
        del self._slots_of[page]
        self.index.drop_page(page)  # the hash goes: the index mirrors it
        self._drop(page)
        for other in rest:  # a snapshot's other groups' pages: orphans, where they are
            other.page = None
            self.orphan_bytes += other.n_bytes
            self.used_bytes += other.n_bytes
        return True

    # ----------------------------------------------------------------- commits
    def insert_block(self, handle: LockHandle, key: Hashable, origin: int = -1) -> Node | None:
        """Cache (or reuse) the full block ``key`` under the handle's node and move the handle
        onto it. Makes room first; returns None (nothing changed) if it cannot."""
        parent = self._live_handle_node(handle)
        page = self._pages[KV_GROUP].get(key)
        if page is None:
            if not self.make_room(self.kv_bytes_per_block):
                return None
            end = parent.end_tokens + self.block_tokens
            page = self._new_page(self.kv_bytes_per_block, key, KV_GROUP, handle)
            self.index.add(page, key, KV_GROUP, end, parent.key, origin)
        elif self.vllm_queue and page in self._slots_of:  # cached, free: recomputed
            self._leave_copy(key)
            self._hold(handle, [page])
            self.index.touch_pages([page])
            self.make_room(0)
        else:
            self._hold(handle, [page])
        node = self.index.live_node(key)
        if node is None or node.parent is not parent:
            raise ValueError(f"key {key!r} is cached elsewhere in the tree")
        handle.node = node
        return node

    def admit_snapshot(self, handle: LockHandle, node: Node) -> bool:
        """Keep a state snapshot at ``node.end_tokens`` (a live node on the handle's path);
        held by the handle with ``hold_snapshots``. False if no room can be made."""
        if not node.alive or not node.refs:
            raise ValueError(f"admit_snapshot needs a live node in use, got {node!r}")
        if node.key in self._pages[STATE_GROUP]:
            return True
        if not self.make_room(0, self.snapshot_bytes):
            return False
        holder = handle if self.hold_snapshots else None
        page = self._new_page(self.snapshot_bytes, node.key, STATE_GROUP, holder)
        self.index.add(page, node.key, STATE_GROUP, node.end_tokens, self._parent_key(node))
        self.snapshots_admitted += 1
        return True

    def admit_partial(
        self, handle: LockHandle, key: Hashable, n_tokens: int, origin: int = -1
    ) -> Node | None:
        """Keep the KV of ``n_tokens < block_tokens`` tokens after the handle's node and the
        state at their end (an exact-position snapshot), not held. The handle does not move."""
        parent = self._live_handle_node(handle)
        if not 0 < n_tokens < self.block_tokens:
            raise ValueError(f"partial block needs 0 < n_tokens < {self.block_tokens}")
        if key in self._pages[KV_GROUP]:
            return self.index.live_node(key)
        kv_bytes = n_tokens * self.kv_bytes_per_token
        if not self.make_room(kv_bytes, self.snapshot_bytes):
            return None
        end = parent.end_tokens + n_tokens
        kv_page = self._new_page(kv_bytes, key, KV_GROUP, None)
        state_page = self._new_page(self.snapshot_bytes, key, STATE_GROUP, None)
        self.index.add(kv_page, key, KV_GROUP, end, parent.key, origin)
        self.index.add(state_page, key, STATE_GROUP, end, parent.key, origin)
        self.snapshots_admitted += 1
        return self.index.live_node(key)

    def promote(self, handle: LockHandle, m: Match) -> bool:
        """Serve ``m``'s hit from the host tier if that is where its state is: copy it back
        into a new page (made room for like any admit; the hit path is held by ``handle``).
        Returns whether the hit came from the host; if no room can be made, the state is used
        from the host and stays there."""
        node = m.hit_node
        if self.host is None or not self.host.tier.holds(node):
            return False
        if not node.refs:
            raise ValueError(f"promote needs the hit path in use, got {node!r}")
        tier = self.host.tier
        priority = tier.take(node)
        if self.make_room(0, self.snapshot_bytes):
            holder = handle if self.hold_snapshots else None
            page = self._new_page(self.snapshot_bytes, node.key, STATE_GROUP, holder)
            self.index.add(page, node.key, STATE_GROUP, node.end_tokens, self._parent_key(node))
        else:
            tier.demote(node, priority)
        self.host.take_ops()  # the simulator moves no bytes
        return True

    # ----------------------------------------------------------------- pages
    def _live_handle_node(self, handle: LockHandle) -> Node:
        node = handle.node
        if not handle.active or not node.alive:
            raise ValueError("lock handle is released or its node was evicted")
        if node is not self.root and node.n_tokens != self.block_tokens:
            raise ValueError("cannot extend a partial node")
        return node

    def _parent_key(self, node: Node) -> Hashable | None:
        return None if node.parent is None else node.parent.key

    def _new_page(self, n_bytes: int, key: Hashable, group: int, holder: LockHandle | None) -> int:
        """A page of ``n_bytes`` for (key, group), held by ``holder`` if given; the caller
        made room and caches it in the index next."""
        if n_bytes > self._pool_free(group == STATE_GROUP):
            raise BudgetError(f"budget exceeded: {n_bytes} more in group {group}")
        page = self._next_page
        self._next_page += 1
        self.used_bytes += n_bytes
        self.used_state_bytes += n_bytes if group == STATE_GROUP else 0
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        self._bytes[page] = n_bytes
        self._page_of[page] = (key, group)
        self._pages[group][key] = page
        if holder is not None:
            self._hold(holder, [page])
        elif self.vllm_queue:
            self._pending_free.append(page)  # queued at the next flush_free
        return page

    def _hold(self, handle: LockHandle, pages: list[int]) -> None:
        refs, newly = self._refs, []
        for page in pages:
            if page in handle.pages:
                continue
            handle.pages.add(page)
            n = refs.get(page, 0)
            refs[page] = n + 1
            if not n:
                newly.append(page)
        if newly:
            self.index.pages_used(newly)
            if self.vllm_queue:
                for page in newly:
                    self._dequeue(page)

    def flush_free(self) -> None:
        """``vllm_queue``: the pages freed since the last call enter the queue now, in one
        batch, as vLLM frees blocks in batches: a running request's passed states (the one it
        hit, its junction and checkpoint states) at its first decode step
        (``remove_skipped_blocks``), a finished request's blocks at once (``free``). The
        replay calls it at those two points; until then the pages are free but not evictable
        (vLLM still holds them). Without ``vllm_queue`` it does nothing."""
        if self._pending_free:
            pages, self._pending_free = self._pending_free, []
            keep = dict.fromkeys(p for p in pages if p in self._page_of and p not in self._refs)
            self._enqueue(list(keep))

    def _release(self, handle: LockHandle, pages: list[int]) -> None:
        refs, freed = self._refs, []
        for page in pages:
            handle.pages.discard(page)
            n = refs[page] - 1
            if n:
                refs[page] = n
            else:
                del refs[page]
                freed.append(page)
        if freed:
            self.index.pages_freed(freed)
            if self.vllm_queue:
                self._pending_free.extend(freed)

    def _is_free(self, page: int) -> bool:
        return page not in self._refs

    def set_lookahead(self, paths: Callable[[], Iterable[Sequence[Hashable]]] | None) -> None:
        """The waiting requests' paths, whose hits the index evicts last
        (:attr:`PrefixIndex.lookahead`, asked again after :meth:`refresh_lookahead`)."""
        self.index.lookahead = paths

    def refresh_lookahead(self) -> None:
        self.index.refresh_lookahead()

    def make_room(self, n_bytes: int, state_bytes: int = 0) -> bool:
        """Free the index's victims until ``n_bytes`` of KV and ``state_bytes`` of states more
        fit (one sum without a state pool); False if they cannot (what is left is held).
        Commits call it; tests and callers may too."""
        if self.vllm_queue:
            while self._pool_free(False) < n_bytes + state_bytes:
                if not self._evict_head():
                    return False
            return True
        largest = max(self.kv_bytes_per_block, self.snapshot_bytes, 1)
        is_free, index = self._is_free, self.index
        if self.state_budget_bytes is None:
            ok = self._evict_until(
                n_bytes + state_bytes,
                False,
                lambda n: index.pick_victims(-(-n // largest), is_free),
            )
        else:
            snap = max(self.snapshot_bytes, 1)
            ok = self._evict_until(
                state_bytes, True, lambda n: index.pick_snapshot_victims(-(-n // snap), is_free)
            ) and self._evict_until(
                n_bytes, False, lambda n: index.pick_victims(-(-n // largest), is_free, True)
            )
        if self.host is not None:
            self.host.take_ops()  # demotions: the simulator moves no bytes
        return ok

    def _evict_until(self, n_bytes: int, state: bool, pick: Callable[[int], list[int]]) -> bool:
        """Drop ``pick(bytes short)``'s victims until ``n_bytes`` fit in the pool of states
        (``state``) or of KV; False if they run out. Asking for every page that must go at
        once evicts what one page at a time would, in fewer calls."""
        while self._pool_free(state) < n_bytes:
            victims = pick(n_bytes - self._pool_free(state))
            if not victims:
                return False
            for page in victims:
                self._drop(page)
        return True

    def _pool_free(self, state: bool) -> int:
        """Free bytes of the pool a state (``state``) or KV page takes from: the budget's,
        without a state pool."""
        if self.state_budget_bytes is None:
            return self.budget_bytes - self.used_bytes
        if state:
            return self.state_budget_bytes - self.used_state_bytes
        return self.budget_bytes - self.state_budget_bytes - self.used_bytes + self.used_state_bytes

    def _drop(self, page: int) -> None:
        """A victim leaves the pool. The index let it go when it picked it (an engine reports
        the drop with ``drop_page`` as well, which then changes nothing: skipped here)."""
        if self.vllm_queue:
            self._dequeue(page)
            key = self._page_of[page][0]
            if self._page_of[page][1] == KV_GROUP:  # its stale copies, if any: orphans now
                self._copies.pop(key, None)
                self._main_serial.pop(key, None)
        key, group = self._page_of.pop(page)
        del self._pages[group][key]
        n_bytes = self._bytes.pop(page)
        self.used_bytes -= n_bytes
        self.used_state_bytes -= n_bytes if group == STATE_GROUP else 0
        if group == KV_GROUP:
            self.evicted_kv_blocks += 1
        else:
            self.evicted_snapshots += 1

    # ----------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Assert P1-P3 (module docstring), then the index's and the host tier's invariants."""
        index = self.index
        assert set(index.cached) == self._page_of.keys(), "P1: pages cached in the index"
        for page, (key, group) in self._page_of.items():
            assert index.keys_of(page) == {(key, group)}, f"P1: page {page} in the index"
            assert self._pages[group].get(key) == page, f"P1: page {page} in the pool's map"
        assert sum(len(p) for p in self._pages) == len(self._page_of), "P1: the pool's map"
        expected: dict[int, int] = {}
        for handle in self._handles:
            assert handle.active, "P2: an inactive handle is held"
            for page in handle.pages:
                assert page in self._page_of, f"P2: a handle holds page {page}, not in the pool"
                expected[page] = expected.get(page, 0) + 1
        assert expected == self._refs, "P2: reference counts != handles"
        assert self.used_bytes == sum(self._bytes.values()) + self.orphan_bytes, "P3: used bytes"
        if self.vllm_queue:
            queued = {s.page for s in self._queue.values() if s.page is not None}
            assert queued == set(self._slots_of), "P4: the queue's pages"
            assert not queued & set(self._refs), "P4: a page in use is in the queue"
            pending = set(self._pending_free)
            assert queued | pending >= set(self._page_of) - set(self._refs), "P4: free pages"
            orphans = sum(s.n_bytes for s in self._queue.values() if s.page is None)
            assert orphans == self.orphan_bytes, "P4: orphan bytes"
        assert self.used_bytes <= self.peak_bytes <= self.budget_bytes or not self.used_bytes, (
            f"P3: used {self.used_bytes} peak {self.peak_bytes} budget {self.budget_bytes}"
        )
        states = sum(self._bytes[p] for p in self._pages[STATE_GROUP].values())
        assert self.used_state_bytes == states, "P3: used state bytes"
        assert self._pool_free(True) >= 0 and self._pool_free(False) >= 0, "P3: a pool over"
        index.check_integrity(self._is_free)
        if self.host is not None:
            self.host.check_integrity()
