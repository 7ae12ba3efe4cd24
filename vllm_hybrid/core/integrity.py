"""``PrefixIndex.check_integrity``: asserts exactly the numbered invariants of its docstring."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_hybrid.core.node import Node

if TYPE_CHECKING:
    from vllm_hybrid.core.index import PrefixIndex


class IntegrityError(AssertionError):
    """An invariant of the index does not hold (a bug, never bad user input)."""


def _require(ok: bool, number: int, what: str) -> None:
    if not ok:
        raise IntegrityError(f"invariant {number} violated: {what}")


def _walk(root: Node) -> list[Node]:
    out, stack = [], list(root.iter_children())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.iter_children())
    return out


def _check_tree(index: PrefixIndex, nodes: list[Node]) -> None:
    block = index.block_tokens
    for node in nodes:
        parent = node.parent
        _require(parent is not None and parent.alive and node.alive, 1, f"{node!r} parent")
        assert parent is not None
        _require(node.start_tokens == parent.end_tokens, 1, f"{node!r} start != parent end")
        if node.n_tokens == block:
            _require(parent.children.get(node.key) is node, 1, f"{node!r} not in children")
        else:
            in_group = parent.partials.get(node.n_tokens, {}).get(node.key) is node
            _require(0 < node.n_tokens < block and in_group, 1, f"{node!r} bad partial")
            _require(node.is_leaf and node.has_snapshot, 1, f"{node!r} partial not a leaf+state")


def check_index(index: PrefixIndex) -> None:
    nodes = _walk(index.root)
    _check_tree(index, nodes)
    # 2. unique keys
    _require(len(index._by_key) == len(nodes), 2, "key map size != live nodes")
    _require(all(index._by_key.get(n.key) is n for n in nodes), 2, "key map mismatch")
    # 3. snapshots only on live nodes: guaranteed by walking live nodes; the root holds none.
    _require(not index.root.has_snapshot, 3, "root holds a snapshot")
    # 4. refs == active handles at or below the node; handles on live nodes
    expected: dict[int, int] = {}
    for handle in index._handles:
        _require(handle.active and handle.node.alive, 4, "active handle on an evicted node")
        walk: Node | None = handle.node
        while walk is not None:
            expected[id(walk)] = expected.get(id(walk), 0) + 1
            walk = walk.parent
    for node in [index.root, *nodes]:
        _require(node.refs == expected.get(id(node), 0), 4, f"{node!r} refs != handles")
    # 5. byte accounting
    n_snap = sum(1 for n in nodes if n.has_snapshot)
    held = sum(n.kv_bytes for n in nodes) + n_snap * index.snapshot_bytes
    _require(n_snap == index.n_snapshots, 5, f"n_snapshots {index.n_snapshots} != {n_snap}")
    _require(held == index.used_bytes, 5, f"used_bytes {index.used_bytes} != held {held}")
    # 6. budget
    _require(
        index.used_bytes <= index.peak_bytes <= index.budget_bytes or index.used_bytes == 0,
        6,
        f"used {index.used_bytes} peak {index.peak_bytes} budget {index.budget_bytes}",
    )
