"""What the parts of :class:`~vllm_hybrid.core.index.PrefixIndex` share: its fields and types.

The index is one object whose methods live in four modules, one job each (``pages``: which page
holds which (key, group) and which pages are in use; ``trie``: the live trie and its lookups;
``victims``: ranking and picking; ``integrity``: the invariants). Each part is a mixin over
:class:`IndexFields`, which declares every field (set by ``PrefixIndex.__init__`` / ``_reset``)
and, for the type checker, the methods one part calls on another.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policy import EvictionPolicy

PageKey = tuple[Hashable, int]
IsFree = Callable[[int], bool]
KV, SNAP = 0, 1  # the two kinds of eviction unit: an entry's KV (with its subtree), its state

# prio, end, serial, kind, version: unique per (serial, kind, version), so two items never tie;
# numbers only (the entry is found by its serial), so the garbage collector skips the heap.
Item = tuple[float, int, int, int, int]


@dataclass(eq=False, slots=True)
class Entry:
    """One key: the node the policy ranks, the pages holding it per group, and the incremental
    state: ``live``, in-use (page, group) pairs (``used``, of state groups ``used_state``), and
    ``serial`` (creation order, the heap's tie-break after the depth)."""

    node: Node
    parent_key: Hashable | None
    serial: int
    pages: dict[int, set[int]] = field(default_factory=dict)
    live: bool = False
    used: int = 0
    used_state: int = 0
    #: The chained keys of the request that cached it, one per match unit, and the index in
    #: them of the unit this entry's span starts after (``PageMap.add(units=...)``): what
    #: :meth:`LiveTrie.shared_tokens` compares a later request's keys with inside the span.
    units: tuple[Sequence[Hashable], int] | None = None


@dataclass
class VictimStats:
    """Counts of what :meth:`PrefixIndex.pick_victims` chose, by reason."""

    dead_pages: int = 0
    duplicate_pages: int = 0
    kv_units: int = 0
    snapshot_units: int = 0
    pages: int = 0
    #: times a unit was passed over because a waiting request would hit it
    #: (:attr:`PrefixIndex.lookahead`), and units taken anyway, for want of others
    wanted_units: int = 0
    wanted_taken: int = 0


class IndexFields:
    """The fields of the index (documented where ``PrefixIndex.__init__`` sets them)."""

    block_tokens: int
    kv_groups: frozenset[int]
    state_groups: frozenset[int]
    _is_state: dict[int, bool]
    policy: EvictionPolicy
    _on_evicted: Callable[[Node, bool, int], None] | None
    kv_bytes_per_token: int
    root: Node
    now: int
    stats: VictimStats
    _events: bool
    _used: set[int]
    _serial: int
    on_snapshot_evicted: Callable[[Node, dict[int, list[int]], float], None] | None
    on_entry_deleted: Callable[[Hashable], None] | None
    on_snapshot_added: Callable[[Node], None] | None
    snapshot_budget_pages: int | None
    _lookahead: Callable[[], Iterable[Sequence[Hashable]]] | None
    lookahead_paths: int
    _wanted: set[Hashable] | None
    _entries: dict[Hashable, Entry]
    _by_serial: dict[int, Entry]
    _page_keys: dict[int, set[PageKey]]
    cached: Collection[int]
    _kids: dict[Hashable, set[Hashable]]
    _dead: set[Hashable]
    _dups: set[PageKey]
    _dirty: dict[int, Entry]
    _heap: list[Item]
    _unranked: set[int]
    _victims: dict[int, list[PageKey]]
    _n_live: int
    _n_free: int
    _n_free_state: int

    if TYPE_CHECKING:  # what one part calls on another

        def drop_page(self, page: int) -> list[PageKey]: ...
        def wanted_keys(self, paths: Iterable[Sequence[Hashable]]) -> set[Hashable]: ...
        def _set_used(self, page: int, used: bool) -> None: ...
        def _sync(self, is_free: IsFree) -> None: ...
        def _free(self, page: int, is_free: IsFree) -> bool: ...
        def _group_added(self, entry: Entry, group: int) -> None: ...
        def _group_removed(self, entry: Entry, group: int) -> None: ...
        def _delete(self, entry: Entry) -> None: ...
        def _add_refs(self, node: Node | None, delta: int) -> None: ...
        def _mark(self, entry: Entry) -> None: ...
        @staticmethod
        def _valid(item: Item, entry: Entry | None) -> bool: ...
