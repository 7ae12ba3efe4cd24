"""The prefix index: KV pages and state snapshots under chained block hashes, ranked by a policy.

One structure for the engine and the simulator. A page pool caches pages under chained block
hashes, one entry per (key, group): *KV groups* (attention) hold the KV of block
``[end - B, end)``, *state groups* (Mamba, GDN, ...) hold the recurrent state at ``end``. The
pool owns the pages, their reference counts and its hash map; the index mirrors which page
holds which (key, group) and answers two questions: *what can a request resume from?*
(:meth:`~LiveTrie.match`) and *which free cached pages should go first?*
(:meth:`~VictimPicker.pick_victims`). Two pools run it: vLLM's ``BlockPool``, through the
adapter (``adapters/vllm/block_pool.py``), and the simulator's page pool (``sim/pool.py``);
both report every change of their hash map (:meth:`~PageMap.add`, :meth:`~PageMap.drop_page`,
:meth:`~PageMap.move_page`, :meth:`clear`) and every hit (:meth:`~PageMap.touch_pages`), and the
same policy objects rank (``core/policies.py``):

* an *entry* is one key; its :class:`~vllm_hybrid.core.node.Node` carries the policy's
  statistics (hits, last access) for as long as the pool holds any page under the key;
* an entry is *live* when every KV group holds a page for it and its parent entry is live
  (an attention hit is a contiguous prefix; a state past a gap cannot be resumed);
* a live entry *has a snapshot* when every state group holds a page for it.

The parts, one module each: ``pages.py`` (the page map and page use), ``trie.py`` (the live
trie, ``refs``, lookups), ``victims.py`` (the lazy heap and the victim order), ``integrity.py``
(the invariants below). Everything is kept incrementally, so an eviction costs
O(victims * depth + dead/duplicate entries + heap pops * log) and an event O(depth), not
O(pool). Which pages are in use is known in one of two modes:

* *callback* (default): ``is_free(page)`` of :meth:`~VictimPicker.pick_victims`. A cached page
  counts as in use from ``add`` or ``touch_pages`` until ``is_free`` says otherwise; each pick
  (and ``free_pages`` given ``is_free``) re-checks only the pages believed in use. Relies on
  vLLM's rule that a free cached page is taken only by ``touch`` (reported) or
  ``get_new_blocks`` (which drops its hashes first); a page found in use anyway is never
  returned.
* *events* (:meth:`~PageMap.use_free_events`): the pool reports every page's change with
  ``page_used`` / ``page_freed``; nothing is re-checked, ``is_free`` only guards the victims.

Invariants (asserted by :meth:`~IndexIntegrity.check_integrity`):

1. ``_page_keys`` and the entries' ``pages`` are inverse maps: ``(key, group)`` is in
   ``_page_keys[page]`` iff ``page`` is in ``_entries[key].pages[group]``; no empty set or
   entry is stored.
2. An entry's node has ``key`` as its key and spans ``(start, end]`` with ``end > 0``,
   ``start = end - block_tokens`` for a full block, else the block boundary below ``end``.
3. Every group of every stored page is a KV group or a state group, all of one kind per page
   (an engine's page belongs to one group).
4. No page :meth:`~VictimPicker.pick_victims` returned was in use.
5. The live trie equals a from-scratch rebuild (``_reference_trie``): ``live``, parent,
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
8. With a snapshot budget, once the pool has enforced it (``pick_snapshot_victims`` at every
   release): free state pages <= ``snapshot_budget_pages``, but for those of an entry whose
   path is in use (``refs > 0``: no unit with a page in use goes, so nothing can take them).
"""

from __future__ import annotations

from collections.abc import Collection

from vllm_hybrid.core.index._base import VictimStats
from vllm_hybrid.core.index.integrity import IndexIntegrity
from vllm_hybrid.core.index.pages import PageMap
from vllm_hybrid.core.index.trie import LiveTrie
from vllm_hybrid.core.index.victims import VictimPicker
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policy import EvictionPolicy


class PrefixIndex(PageMap, LiveTrie, VictimPicker, IndexIntegrity):
    """Which page holds which (key, group) of a pool's prefix cache, what a request can resume
    from, and which free pages go first (module docstring)."""

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
        #: the policy's optional hook, told of each unit before it goes (``core/policy.py``)
        self._on_evicted = getattr(policy, "on_evicted", None)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.root = Node(None, None, 0, 0, 0)
        self.now = 0
        self.stats = VictimStats()
        self._events = False
        self._used = set()
        self._serial = 0
        #: Optional hooks for a second tier of snapshots (the host tier,
        #: ``core/host_ledger.py``); None (the default) changes nothing.
        #: ``on_snapshot_evicted(node, pages by state group, priority)``: the policy evicts
        #: ``node``'s snapshot alone (its KV stays), before its pages are dropped.
        self.on_snapshot_evicted = None
        #: ``on_entry_deleted(key)``: the pool holds no page under ``key`` any more.
        self.on_entry_deleted = None
        #: ``on_snapshot_added(node)``: ``node`` has a page in every state group again.
        self.on_snapshot_added = None
        #: The snapshot budget: at most this many free cached pages of state groups (the
        #: engine's ``max_snapshot_fraction`` of its pool); None: no budget of their own,
        #: snapshots and KV compete for the pool by the policy's value alone.
        self.snapshot_budget_pages = None
        #: Lookahead (None: off): the key paths of requests that will look the cache up soon
        #: (an engine's waiting queue), each the keys at successive full-block ends from the
        #: first block up to the last a hit may reach. A unit on such a path down to the
        #: path's deepest snapshot (the hit that request would get now) goes only after every
        #: other unit: the order changes, never how many pages an eviction frees.
        self._lookahead = None
        #: At most this many lookahead paths count, the first ones (an engine admits its
        #: waiting requests in queue order): bounds the cost of an eviction under overload.
        self.lookahead_paths = 64
        self._reset()

    def _reset(self) -> None:
        self.root.children, self.root.partials, self.root.refs = {}, {}, 0
        self._entries = {}
        self._by_serial = {}  # the heap items' entries
        self._page_keys = {}
        self.cached = self._page_keys.keys()  # read-only view: the cached pages
        self._kids = {}  # parent key -> keys of its entries
        self._dead = set()
        self._dups = set()
        self._dirty = {}  # serial -> entry to re-rank before the next pop
        self._heap = []
        #: serials of free snapshots no unit ranks (both priorities None, path not in use), as
        #: of their last ranking: what the snapshot budget's last resort looks at
        self._unranked = set()
        self._victims = {}  # last pick's victims -> what they held
        self._n_live = self._n_free = self._n_free_state = 0
        self._wanted = None  # the lookahead's keys, until refreshed
        if not self._events:
            self._used.clear()

    def tick(self) -> int:
        """Advance the logical clock and return it: the adapter gives each request its index
        this way, at its first prefix lookup (the simulator's clock is the request's index)."""
        self.now += 1
        return self.now

    def clear(self) -> None:
        """The pool reset its prefix cache."""
        for entry in self._entries.values():
            entry.node.alive = False
        self._reset()
