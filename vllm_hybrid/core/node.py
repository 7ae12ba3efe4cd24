"""Nodes of the prefix index and the small value types its methods return.

A :class:`Node` is owned by :class:`~vllm_hybrid.core.index.PrefixIndex`; callers may read its
fields (policies do, to compute priorities) but only the index writes them. A node stays valid as
a handle while ``alive`` is true; an evicted node is never revived (a re-inserted block gets a new
node).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


class Node:
    """One block of KV (``[start_tokens, end_tokens)``) and optionally a state snapshot at its end.

    A *full* node spans exactly ``block_tokens`` and may have children; a *partial* node spans
    fewer tokens, is always a leaf and always holds a snapshot (it exists only to keep an
    exact-position state). ``refs`` counts lock handles on this node or below it.
    """

    __slots__ = (
        "key",
        "parent",
        "children",
        "partials",
        "start_tokens",
        "end_tokens",
        "kv_bytes",
        "has_snapshot",
        "refs",
        "last_access",
        "snap_access",
        "hits",
        "snap_hits",
        "version",
        "alive",
        "origin",
    )

    def __init__(
        self, key: Hashable, parent: Node | None, start_tokens: int, end_tokens: int, kv_bytes: int
    ) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[Hashable, Node] = {}
        self.partials: dict[int, dict[Hashable, Node]] = {}
        self.start_tokens = start_tokens
        self.end_tokens = end_tokens
        self.kv_bytes = kv_bytes
        self.has_snapshot = False
        self.refs = 0
        self.last_access = 0
        self.snap_access = 0
        self.hits = 0
        self.snap_hits = 0
        self.version = 0
        self.alive = True
        self.origin = -1  # caller-defined id of the request that inserted the node

    @property
    def n_tokens(self) -> int:
        return self.end_tokens - self.start_tokens

    @property
    def is_leaf(self) -> bool:
        return not self.children and not self.partials

    @property
    def n_children(self) -> int:
        return len(self.children) + sum(len(d) for d in self.partials.values())

    def iter_children(self) -> list[Node]:
        kids = list(self.children.values())
        for group in self.partials.values():
            kids.extend(group.values())
        return kids

    def __repr__(self) -> str:
        snap = "+S" if self.has_snapshot else ""
        return (
            f"Node({self.key!r}, [{self.start_tokens},{self.end_tokens}){snap}, refs={self.refs})"
        )


@dataclass
class Match:
    """Result of :meth:`PrefixIndex.match` (a query: nothing is mutated).

    ``kv_nodes`` are the full-block nodes of the longest cached KV prefix, in path order (root
    excluded); ``hit_node`` is the deepest node on that path (or a partial child of it) that holds
    a snapshot, ``root`` when there is none. Only ``[0, hit_tokens)`` can be skipped: KV past the
    last snapshot cannot resume the recurrent layers.
    """

    kv_nodes: list[Node]
    kv_tokens: int
    hit_node: Node
    hit_tokens: int

    @property
    def ends_on_snapshot(self) -> bool:
        return self.hit_tokens > 0


@dataclass
class Eviction:
    """What one :meth:`PrefixIndex.evict` call removed; the engine frees exactly these."""

    kv_keys: list[Hashable] = field(default_factory=list)
    snapshot_keys: list[Hashable] = field(default_factory=list)
    freed_bytes: int = 0


class LockHandle:
    """A running request's hold on a path: its node and every ancestor cannot be evicted.

    :meth:`PrefixIndex.insert_block` moves the handle down to the inserted child, so a request
    that extends its own path keeps all of it locked with one handle.
    """

    __slots__ = ("node", "active")

    def __init__(self, node: Node) -> None:
        self.node = node
        self.active = True
