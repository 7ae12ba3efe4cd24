"""Nodes of the prefix index and the result of its lookups.

A :class:`Node` is owned by :class:`~vllm_hybrid.core.index.PrefixIndex`; callers may read its
fields (policies do, to compute priorities) but only the index writes them. A node stays valid as
a handle while ``alive`` is true (the pool holds a page under its key); a deleted node is never
revived (a key cached again gets a new node).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


class Node:
    """One block of KV (``[start_tokens, end_tokens)``) and optionally a state snapshot at its end.

    A *full* node spans exactly ``block_tokens`` and may have children; a *partial* node spans
    fewer tokens and is always a leaf (it exists to keep an exact-position state). While the node
    is in the live trie, ``refs`` is not 0 exactly when some page of it or below it is in use
    (``core/index/trie.py``).
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
