"""PrefixIndex: unit tests and a hypothesis property test against a tiny model of an engine pool."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hybrid.core import PrefixIndex
from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.layers import AttentionLayers, Mamba2Layers
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policies import POLICIES
from vllm_hybrid.core.shapes import ModelShape

B = 4
KV, S1, S2 = 0, 1, 2  # one attention group, two state groups
SHAPE = ModelShape(
    "tiny",
    (
        AttentionLayers(1, 1, 1, 1, 1, 1, kv_dtype_bytes=1),
        Mamba2Layers(1, 1, 1, 1, 1, 1, conv_kernel=2, state_dtype_bytes=1),
    ),
)
COST = CostModel(SHAPE, B)


def make(policy: str = "vllm") -> PrefixIndex:
    return PrefixIndex(
        block_tokens=B, kv_groups=[KV], state_groups=[S1, S2], policy=POLICIES[policy](COST)
    )


class Pool:
    """Pages with ref counts; caches chains of keys like vLLM (one page per (key, group))."""

    def __init__(self, mirror: PrefixIndex) -> None:
        self.mirror = mirror
        self.next_page = 0
        self.in_use: set[int] = set()

    def cache(self, chain: str, snap_at: set[int] = frozenset(), used: bool = False) -> dict:
        """Cache KV for every prefix of ``chain`` (one char per block) and states at ``snap_at``
        (block counts); returns {(prefix, group): page}."""
        out = {}
        for i in range(1, len(chain) + 1):
            groups = [KV] + ([S1, S2] if i in snap_at else [])
            for g in groups:
                page = self.next_page
                self.next_page += 1
                if used:  # events mode needs it; callback mode assumes it for a new page
                    self.mirror.page_used(page)
                parent = chain[: i - 1] or None
                self.mirror.add(page, chain[:i], g, i * B, parent)
                out[chain[:i], g] = page
                if used:
                    self.in_use.add(page)
        return out

    def is_free(self, page: int) -> bool:
        return page not in self.in_use

    def evict(self, n: int) -> list[int]:
        victims = self.mirror.pick_victims(n, self.is_free)
        for page in victims:
            self.mirror.drop_page(page)
        self.mirror.check_integrity()
        return victims


def test_rejects_bad_groups() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(block_tokens=B, kv_groups=[0], state_groups=[0], policy=POLICIES["vllm"](COST))
    with pytest.raises(ValueError):
        make().add(0, "a", 7, B, None)


def test_lru_leaf_first_and_snapshot_pages_go_with_their_kv() -> None:
    mirror = make("vllm")
    pool = Pool(mirror)
    old = pool.cache("ab", snap_at={2})
    mirror.tick()
    new = pool.cache("cd", snap_at={2})
    victims = pool.evict(1)
    # the least recently used block is evicted (deepest first on a tie in time)
    assert old["ab", KV] in victims or old["ab", S1] in victims
    assert all(p not in victims for p in new.values())
    mirror.check_integrity()


def test_kv_unit_takes_subtree_with_its_snapshots() -> None:
    mirror = make("flop")
    pool = Pool(mirror)
    pages = pool.cache("abc", snap_at={3})
    victims = pool.evict(len(pages))
    assert sorted(victims) == sorted(pages.values())
    assert len(mirror) == 0 and mirror.cached_pages() == []
    assert mirror.stats.pages == len(pages)


def test_pages_in_use_are_never_victims() -> None:
    mirror = make("vllm")
    pool = Pool(mirror)
    used = pool.cache("ab", snap_at={2}, used=True)
    assert pool.evict(10) == []
    free = pool.cache("x", snap_at={1})
    victims = pool.evict(10)
    assert sorted(victims) == sorted(free.values())
    assert all(mirror.keys_of(p) for p in used.values())


def test_snapshot_of_a_running_path_can_go_alone() -> None:
    mirror = make("vllm")
    pool = Pool(mirror)
    pages = pool.cache("ab", snap_at={1})
    pool.in_use.add(pages["ab", KV])  # a request still holds the deeper KV block
    victims = pool.evict(2)
    assert sorted(victims) == sorted([pages["a", S1], pages["a", S2]])
    assert mirror.keys_of(pages["a", KV]) == {("a", KV)}


def test_kv_only_victims_pass_over_snapshot_units() -> None:
    """A KV shortage in a pool whose states have memory of their own (SGLang's two pools):
    the snapshot unit that ranks lowest is passed over (it stays ranked), KV units go, a
    leaf's state with it."""
    mirror = make("sglang")
    pool = Pool(mirror)
    old = pool.cache("ab", snap_at={1})  # an interior state at "a": the oldest unit
    mirror.tick()
    new = pool.cache("cd", snap_at={2})
    mirror.tick()
    mirror.touch_pages([old["ab", KV]])  # "ab" more recent than "cd"
    victims = mirror.pick_victims(1, pool.is_free, kv_only=True)
    assert sorted(victims) == sorted(new[k, g] for k in ("cd",) for g in (KV, S1, S2))
    for page in victims:
        mirror.drop_page(page)
    mirror.check_integrity()
    assert pool.evict(1) == sorted([old["a", S1], old["a", S2]])  # still ranked, lowest


def test_dead_pages_first_after_the_engine_drops_an_interior_block() -> None:
    mirror = make("flop")
    pool = Pool(mirror)
    pages = pool.cache("abc", snap_at={3})
    other = pool.cache("z", snap_at={1})
    mirror.drop_page(pages["ab", KV])  # the engine evicted an interior block on its own
    mirror.check_integrity()
    victims = pool.evict(1)
    dead = {pages["abc", KV], pages["abc", S1], pages["abc", S2]}
    assert set(victims) == dead
    assert mirror.stats.dead_pages == 3
    assert all(mirror.keys_of(p) for p in other.values())


def test_free_duplicates_go_before_policy_units() -> None:
    mirror = make("vllm")
    pool = Pool(mirror)
    pages = pool.cache("a")
    mirror.add(100, "a", KV, B, None)  # a second page holding the same block
    pool.in_use.add(pages["a", KV])
    assert pool.evict(1) == [100]
    assert mirror.stats.duplicate_pages == 1


def test_move_page_and_clear() -> None:
    mirror = make()
    pool = Pool(mirror)
    pages = pool.cache("a", snap_at={1})
    mirror.move_page(pages["a", S1], 50)
    mirror.check_integrity()
    assert mirror.keys_of(50) == {("a", S1)} and mirror.keys_of(pages["a", S1]) == set()
    mirror.clear()
    mirror.check_integrity()
    assert len(mirror) == 0


def test_touch_counts_hits_once_per_key_and_kind() -> None:
    mirror = make()
    pool = Pool(mirror)
    pages = pool.cache("a", snap_at={1})
    mirror.tick()
    mirror.touch_pages(pages.values())
    node = mirror._entries["a"].node
    assert (node.hits, node.snap_hits, node.last_access, node.snap_access) == (1, 1, 1, 1)


def test_the_same_pair_again_changes_nothing() -> None:
    """vLLM re-registers a prompt tail's partial entry at every step of a running request: the
    index must treat it as the no-op it is (no new link, no re-ranking, no fresh access)."""
    mirror = make()
    pool = Pool(mirror)
    pages = pool.cache("ab", snap_at={2})
    mirror.tick()
    node = mirror._entries["ab"].node
    before = (node.last_access, node.snap_access, node.version, len(mirror._dirty))
    assert mirror.holds_key(pages["ab", S1], "ab", S1)
    assert not mirror.holds_key(pages["ab", S1], "ab", S2)
    assert mirror.add(pages["ab", S1], "ab", S1, 2 * B, "a") is False
    mirror.check_integrity()
    assert (node.last_access, node.snap_access, node.version, len(mirror._dirty)) == before
    assert mirror.keys_of(pages["ab", S1]) == {("ab", S1)}


def test_integrity_catches_a_broken_inverse_map() -> None:
    mirror = make()
    Pool(mirror).cache("a")
    mirror._page_keys[99] = {("a", KV)}
    with pytest.raises(AssertionError, match="inv 1"):
        mirror.check_integrity()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["cache", "drop", "use", "release", "evict", "move", "touch"]),
        st.text("abc", min_size=1, max_size=4),
        st.integers(0, 60),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from(sorted(POLICIES)), st.lists(st.text("abc", max_size=4), max_size=3))
def test_random_operations_keep_invariants(ops: list, policy: str, waiting: list) -> None:
    """Invariants after every operation; with all pages free, an eviction frees what was
    asked, whatever waiting requests would hit (the lookahead changes the order only)."""
    mirror = make(policy)
    pool = Pool(mirror)
    mirror.lookahead = lambda: paths(*waiting)
    for op, chain, x in ops:
        mirror.tick()
        if x % 2:  # an engine refreshes once per step; evictions in between reuse the keys
            mirror.refresh_lookahead()
        cached = mirror.cached_pages()
        page = cached[x % len(cached)] if cached else None
        if op == "cache":
            pool.cache(chain, snap_at={x % (len(chain) + 1)})
        elif op == "drop" and page is not None:
            mirror.drop_page(page)
        elif op == "use" and page is not None:
            pool.in_use.add(page)
        elif op == "release":
            pool.in_use.discard(page)
        elif op == "move" and page is not None:
            mirror.move_page(page, 1000 + pool.next_page)
            pool.next_page += 1
        elif op == "touch":
            mirror.touch_pages(cached[: x % 5])
        elif op == "evict":
            before = set(cached)
            victims = pool.evict(x % 6)
            assert len(set(victims)) == len(victims) and set(victims) <= before
            assert not set(victims) & pool.in_use
            if not pool.in_use & before:  # all free: every policy frees what was asked
                assert len(victims) >= min(x % 6, len(before))
        mirror.check_integrity()


def test_optional_on_evicted_hook_is_called_before_the_unit_goes() -> None:
    seen: list[tuple[str, bool, bool]] = []

    class Hooked(POLICIES["vllm"]):  # type: ignore[misc,valid-type]
        def on_evicted(self, node: Node, snap: bool, n: int) -> None:
            seen.append((node.key, snap, node.has_snapshot))

    mirror = PrefixIndex(block_tokens=B, kv_groups=[KV], state_groups=[S1, S2], policy=Hooked(COST))
    pool = Pool(mirror)
    pool.cache("a", snap_at={1})
    pool.evict(3)
    assert seen and all(has for _, _, has in seen)


# ---------------------------------------------------------------- lookahead (waiting requests)
def paths(*chains: str) -> list[list[str]]:
    """Key paths as the engine gives them: one key per full block, from the first block."""
    return [[c[:i] for i in range(1, len(c) + 1)] for c in chains]


def test_wanted_keys_are_the_path_down_to_its_deepest_snapshot() -> None:
    mirror = make("vllm")
    pool = Pool(mirror)
    pool.cache("abcd", snap_at={1, 3})
    pool.cache("xy")  # KV only: nothing to resume from
    assert mirror.wanted_keys(paths("abcd")) == {"a", "ab", "abc"}
    assert mirror.wanted_keys(paths("abz")) == {"a"}  # diverges after its snapshot at "a"
    assert mirror.wanted_keys(paths("xy", "q")) == set()
    pool.evict(0)
    mirror.drop_page(0)  # "a" loses its KV page: nothing below it is live
    assert mirror.wanted_keys(paths("abcd")) == set()


@pytest.mark.parametrize("lookahead", [False, True])
def test_what_a_waiting_request_would_hit_goes_last(lookahead: bool) -> None:
    """LRU would take the older chain first; a waiting request that would resume from it
    keeps it, and the newer chain goes instead. Without the lookahead, the old order."""
    mirror = make("vllm")
    pool = Pool(mirror)
    old = pool.cache("ab", snap_at={2})
    mirror.tick()
    new = pool.cache("cd", snap_at={2})
    if lookahead:
        mirror.lookahead = lambda: paths("abz")
    victims = set(pool.evict(1))
    went, kept = (new, old) if lookahead else (old, new)
    assert victims & set(went.values()) and not victims & set(kept.values())
    assert (mirror.stats.wanted_units > 0) == lookahead


def test_a_running_requests_state_a_waiting_request_needs_stays() -> None:
    """The engine's case: a request still running holds its KV, its prompt-end state is free
    (vLLM frees the state block during decode); another request waits for that prefix."""
    mirror = make("vllm")
    pool = Pool(mirror)
    running = pool.cache("ab", snap_at={2})
    pool.in_use.update([running["a", KV], running["ab", KV]])
    mirror.tick()
    other = pool.cache("x", snap_at={1})
    mirror.lookahead = lambda: paths("abc")
    victims = pool.evict(1)
    assert sorted(victims) == sorted(other.values())
    assert mirror.keys_of(running["ab", S1]) == {("ab", S1)}


def test_the_lookahead_is_walked_once_until_refreshed() -> None:
    """The waiting paths are asked for at the first eviction after a refresh (an engine
    refreshes once per step) and reused until the next; assigning a lookahead refreshes."""
    mirror = make("vllm")
    pool = Pool(mirror)
    chains = {}
    for key in "aceg":  # one block each, with its state, oldest first
        chains[key] = set(pool.cache(key, snap_at={1}).values())
        mirror.tick()
    waiting, asked = ["az"], []

    def lookahead() -> list[list[str]]:
        asked.append(list(waiting))
        return paths(*waiting)

    mirror.lookahead = lookahead
    assert set(pool.evict(1)) == chains["c"]  # "a" is wanted: the next oldest goes
    waiting[:] = ["ez"]
    assert set(pool.evict(1)) == chains["e"]  # not asked again: "a" is still the one kept
    mirror.refresh_lookahead()
    waiting[:] = ["gz"]
    assert set(pool.evict(1)) == chains["a"]  # asked again: now "g" is kept
    assert asked == [["az"], ["gz"]]


def test_the_lookahead_never_frees_fewer_pages() -> None:
    """Everything is wanted: the units go anyway, lowest first, as many as without it."""
    mirror = make("vllm")
    pool = Pool(mirror)
    old = pool.cache("ab", snap_at={2})
    mirror.tick()
    new = pool.cache("cd", snap_at={2})
    mirror.lookahead = lambda: paths("ab", "cd")
    victims = pool.evict(1)
    assert set(victims) <= set(old.values())  # LRU order among the wanted units
    assert mirror.stats.wanted_taken >= 1
    rest = pool.evict(100)
    assert sorted(victims + rest) == sorted([*old.values(), *new.values()])


# ---------------------------------------------------------------- incremental vs from scratch
def reference_pick(mirror: PrefixIndex, n_pages: int, is_free, spare_only: bool = False) -> list:
    """The pre-incremental ``pick_victims`` (rebuild the live trie and a heap from every entry
    at every call), on copies of the nodes, with the incremental heap's tie-break (priority,
    end, entry serial, kind). Nothing in ``mirror`` or its policy is changed: it ranks with a
    fresh policy of the same class, the same for the policies in ``EXACT`` (no state of their
    own; a compiled policy cannot be deep-copied)."""
    if n_pages <= 0:
        return []
    b = mirror.block_tokens
    root = Node(None, None, 0, 0, 0)
    live: dict = {}
    entries = mirror._entries
    for key, entry in sorted(entries.items(), key=lambda kv: kv[1].node.end_tokens):
        n = entry.node
        parent = root if entry.parent_key is None else live.get(entry.parent_key)
        if parent is None or not all(g in entry.pages for g in mirror.kv_groups):
            continue
        if parent is not root and parent.n_tokens != b:
            continue
        node = Node(key, parent, n.start_tokens, n.end_tokens, n.kv_bytes)
        for f in ("last_access", "snap_access", "hits", "snap_hits", "origin"):
            setattr(node, f, getattr(n, f))
        node.has_snapshot = all(g in entry.pages for g in mirror.state_groups)
        (parent.children if node.n_tokens == b else parent.partials.setdefault(node.n_tokens, {}))[
            key
        ] = node
        live[key] = node
    for key in reversed(list(live)):
        live[key].refs += sum(not is_free(p) for ps in entries[key].pages.values() for p in ps)
        live[key].parent.refs += live[key].refs
    spare = set()
    for key, entry in entries.items():
        for group, pages in entry.pages.items():
            free = sorted(p for p in pages if is_free(p))
            if key not in live:
                spare.update((p, key, group) for p in free)
            elif len(pages) > 1:
                keep = 0 if len(free) < len(pages) else 1
                spare.update((p, key, group) for p in free[keep:])
    held = mirror._page_keys
    out = sorted({p for p, _, _ in spare if all((p, k, g) in spare for k, g in held[p])})
    if spare_only:
        return out
    assert mirror.policy.name in EXACT, "the reference ranks like the mirror for EXACT only"
    policy = type(mirror.policy)(mirror.policy.cost)
    taken = set(out)
    heap: list = []

    def push(node: Node) -> None:
        e = entries[node.key]
        node.version += 1
        if node.refs == 0 and (prio := policy.kv_priority(node, mirror.now)) is not None:
            heapq.heappush(heap, (prio, node.end_tokens, e.serial, 0, node.version, node))
        state = [p for g in mirror.state_groups for p in e.pages.get(g, ())]
        if node.has_snapshot and all(is_free(p) for p in state):
            if (prio := policy.snapshot_priority(node, mirror.now)) is not None:
                heapq.heappush(heap, (prio, node.end_tokens, e.serial, 1, node.version, node))

    for node in list(live.values()):
        push(node)
    while heap and len(out) < n_pages:
        prio, _, _, kind, version, node = heapq.heappop(heap)
        if node.key not in live or version != node.version or (kind and not node.has_snapshot):
            continue
        policy.on_evict(prio)
        groups = mirror.state_groups if kind else mirror.kv_groups | mirror.state_groups
        unit = [node]
        if kind:
            node.has_snapshot = False
            push(node)
        else:
            parent = node.parent
            if node.n_tokens == b:
                del parent.children[node.key]
            else:
                del parent.partials[node.n_tokens][node.key]
                if not parent.partials[node.n_tokens]:
                    del parent.partials[node.n_tokens]
            stack, unit = [node], []
            while stack:
                walk = stack.pop()
                stack.extend(walk.iter_children())
                del live[walk.key]
                unit.append(walk)
            if parent is not root:
                push(parent)
        for walk in unit:
            pages = entries[walk.key].pages
            for p in sorted(p for g in groups if g in pages for p in pages[g]):
                if p not in taken:
                    out.append(p)
                    taken.add(p)
    return out


def apply(mirror: PrefixIndex, pool: Pool, op: str, chain: str, x: int) -> None:
    """One random engine event (no eviction)."""
    cached = mirror.cached_pages()
    page = cached[x % len(cached)] if cached else None
    if op == "cache":
        pool.cache(chain, snap_at={x % (len(chain) + 1)}, used=x % 3 == 0)
    elif op == "drop" and page is not None:
        mirror.drop_page(page)
    elif op == "use" and page is not None:
        pool.in_use.add(page)
        mirror.page_used(page)
    elif op == "release" and page is not None:
        pool.in_use.discard(page)
        if x % 2:  # callback mode learns it from is_free; events mode needs the event
            mirror.page_freed(page)
    elif op == "move" and page is not None:
        dst = 1000 + pool.next_page
        pool.next_page += 1
        if page in pool.in_use:
            pool.in_use.add(dst)
            mirror.page_used(dst)
        mirror.move_page(page, dst)
    elif op == "touch":
        hit = cached[: x % 5]
        pool.in_use.update(hit)
        mirror.touch_pages(hit)


EXACT = ["vllm", "lru-dense", "sglang"]  # priorities that depend on the entry alone
OPS2 = st.lists(
    st.tuples(
        st.sampled_from(["cache", "drop", "use", "release", "move", "touch", "evict", "tick"]),
        st.text("abc", min_size=1, max_size=4),
        st.integers(0, 60),
    ),
    max_size=50,
)


@settings(max_examples=200, deadline=None)
@given(OPS2, st.sampled_from(EXACT))
def test_incremental_equals_from_scratch(ops: list, policy: str) -> None:
    """Same victims, in the same order, as the rebuild-everything algorithm; integrity (the
    incremental trie == a rebuild from scratch) after every operation."""
    mirror = make(policy)
    pool = Pool(mirror)
    for op, chain, x in ops:
        if op == "tick":
            mirror.tick()
        elif op == "evict":
            mirror.free_pages(pool.is_free)  # sync what is_free says, as pick_victims does
            expected = reference_pick(mirror, x % 7, pool.is_free)
            assert pool.evict(x % 7) == expected
        else:
            apply(mirror, pool, op, chain, x)
        mirror.check_integrity(pool.is_free)


@settings(max_examples=150, deadline=None)
@given(OPS2, st.sampled_from(sorted(POLICIES)), st.booleans())
def test_victims_follow_the_rules_in_both_modes(ops: list, policy: str, events: bool) -> None:
    """Every policy, callback and events mode: victims are free, unique and cached; every dead
    or duplicate page comes first; a unit is a whole subtree or one entry's state pages."""
    mirror = make(policy)
    pool = Pool(mirror)
    if events:
        mirror.use_free_events()
    for op, chain, x in ops:
        if op == "tick":
            mirror.tick()
        elif op == "evict":
            before = set(mirror.cached_pages())
            spare = reference_pick(mirror, 1, pool.is_free, spare_only=True)
            victims = pool.evict(x % 7)
            assert len(set(victims)) == len(victims) and set(victims) <= before
            assert not set(victims) & pool.in_use
            if x % 7:
                assert victims[: len(spare)] == spare  # every dead/duplicate page, first
        else:
            if op == "release" and events and pool.in_use:
                x |= 1  # events mode: every release is reported
            apply(mirror, pool, op, chain, x)
        mirror.check_integrity(pool.is_free)


def test_events_mode_counts_free_pages_without_is_free() -> None:
    mirror = make("vllm")
    mirror.use_free_events(in_use=[7])
    mirror.add(7, "a", KV, B, None)  # page 7 is in use: not free
    mirror.add(8, "b", KV, B, None)
    assert mirror.free_pages() == 1
    mirror.page_freed(7)
    assert mirror.free_pages() == 2
    mirror.page_used(8)
    assert mirror.free_pages() == 1
    assert mirror.pick_victims(5, lambda p: p != 8) == [7]
    mirror.check_integrity(lambda p: p == 7 or p not in (7, 8))


def test_a_use_the_mirror_missed_is_never_returned() -> None:
    mirror = make("vllm")
    mirror.use_free_events()  # but page 0's use is never reported
    mirror.add(0, "a", KV, B, None)
    mirror.add(1, "b", KV, B, None)
    assert mirror.pick_victims(2, lambda p: p != 0) == [1]
    mirror.page_freed(0)
    assert mirror.pick_victims(1, lambda p: True) == [0]


def test_drop_page_of_a_victim_returns_what_it_held() -> None:
    mirror = make("vllm")
    mirror.add(0, "a", KV, B, None)
    victims = mirror.pick_victims(1, lambda p: True)
    assert victims == [0] and not mirror.holds(0)
    assert mirror.drop_page(0) == [("a", KV)]
    assert mirror.drop_page(0) == []


def test_a_child_cached_before_its_parent_becomes_live_with_it() -> None:
    mirror = make("vllm")
    mirror.add(1, "ab", KV, 2 * B, "a")  # the parent is not cached yet: dead
    mirror.check_integrity()
    assert mirror._entries["ab"].live is False
    mirror.add(0, "a", KV, B, None)
    mirror.check_integrity()
    assert mirror._entries["ab"].live and mirror.root.children["a"].children["ab"]
    mirror.drop_page(0)  # the parent goes: the child is dead again, a dead page first
    mirror.check_integrity()
    assert mirror.pick_victims(1, lambda p: True) == [1] and mirror.stats.dead_pages == 1


@settings(max_examples=100, deadline=None)
@given(OPS2, st.sampled_from(sorted(POLICIES)))
def test_batched_use_events_equal_page_by_page(ops: list, policy: str) -> None:
    """``pages_used``/``pages_freed`` (one call per engine operation, ``refs`` changed once per
    node) leave the mirror as ``page_used``/``page_freed`` page by page do: same victims, same
    refs and ranks; duplicates and uncached pages in a batch are fine."""
    one, many = make(policy), make(policy)
    one.use_free_events()
    many.use_free_events()
    pools = Pool(one), Pool(many)
    for op, chain, x in ops:
        if op == "tick":
            one.tick()
            many.tick()
        elif op == "evict":
            assert pools[0].evict(x % 7) == pools[1].evict(x % 7)
        elif op in ("use", "release"):
            cached = one.cached_pages()
            pages = [cached[(x + i) % len(cached)] for i in range(x % 4)] if cached else []
            pages += [5000 + x]  # an uncached page too
            for pool in pools:
                (pool.in_use.update if op == "use" else pool.in_use.difference_update)(pages)
            for page in pages:
                (one.page_used if op == "use" else one.page_freed)(page)
            (many.pages_used if op == "use" else many.pages_freed)(pages + pages[:1])
        else:
            apply(one, pools[0], op, chain, x | 1)
            apply(many, pools[1], op, chain, x | 1)
        for mirror, pool in zip((one, many), pools, strict=True):
            mirror.check_integrity(pool.is_free)
        assert {k: (e.node.refs, e.used, e.live) for k, e in one._entries.items()} == {
            k: (e.node.refs, e.used, e.live) for k, e in many._entries.items()
        }
        assert one.free_pages() == many.free_pages()


def test_add_says_whether_the_page_is_newly_cached() -> None:
    mirror = make()
    assert mirror.add(0, "a", KV, B, None) is True
    assert mirror.add(0, "a", KV, B, None) is False  # again: nothing new
    assert mirror.add(0, "x", KV, B, None) is False  # a second key on the same page
    assert 0 in mirror.cached and list(mirror.cached) == mirror.cached_pages() == [0]
    mirror.drop_page(0)
    assert 0 not in mirror.cached and mirror.add(0, "a", KV, B, None) is True


def test_refs_stop_at_the_first_node_that_stays_in_use() -> None:
    """``refs`` counts a node's pages in use and its children in use: a change below a node
    already in use does not walk further up, yet zero-ness is the whole subtree's."""
    mirror = make()
    mirror.use_free_events()
    pool = Pool(mirror)
    pages = pool.cache("abcd", used=True)
    root_refs = mirror.root.refs
    node = mirror.node_of("abcd")
    assert node is not None and node.refs == 1
    assert mirror.node_of("a").refs == 2  # its own page + child "ab" in use
    mirror.pages_freed([pages["abcd", KV]])
    assert node.refs == 0 and mirror.node_of("abc").refs == 1
    assert mirror.root.refs == root_refs == 1
    mirror.pages_freed([pages[c, KV] for c in ("a", "ab", "abc")])
    assert mirror.root.refs == 0 and mirror.node_of("a").refs == 0
    mirror.check_integrity(lambda p: True)


def test_snapshot_budget_takes_snapshots_lowest_first_and_leaves_kv_alone() -> None:
    """Over the budget, units holding state pages go (a leaf with its KV, an interior state
    alone), lowest priority first; a unit of KV only is passed over and stays ranked."""
    mirror = make("vllm")
    mirror.use_free_events()
    pool = Pool(mirror)
    kv_only = pool.cache("xy")  # no snapshot: KV pages only
    mirror.tick()
    old = pool.cache("abc", snap_at={2, 3})  # interior state at "ab", leaf state at "abc"
    mirror.tick()
    new = pool.cache("de", snap_at={2})
    assert mirror.free_state_pages() == 6
    assert mirror.snapshot_excess() == 0  # no budget
    mirror.snapshot_budget_pages = 2
    assert mirror.snapshot_excess() == 4
    victims = mirror.pick_snapshot_victims(mirror.snapshot_excess(), pool.is_free)
    for page in victims:
        mirror.drop_page(page)
    mirror.check_integrity(pool.is_free)
    assert mirror.free_state_pages() == 2
    # LRU: the older path goes, leaf first: "abc" with its state, then "ab" (a leaf now) with
    # its state; "a" (KV only) and "xy" (older still, KV only) are passed over
    assert set(victims) == {old[k, g] for k in ("abc", "ab") for g in (KV, S1, S2)}
    assert mirror.holds(old["a", KV])
    assert all(mirror.holds(p) for p in kv_only.values())
    assert all(mirror.holds(p) for p in new.values())
    # passed over, not lost: an ordinary eviction still ranks them (LRU: "xy" first)
    assert pool.evict(1) == [kv_only["xy", KV]]


@settings(max_examples=150, deadline=None)
@given(OPS2, st.sampled_from(sorted(POLICIES)), st.integers(0, 6))
def test_snapshot_budget_holds_after_every_release(ops: list, policy: str, budget: int) -> None:
    """Events mode, every policy, any budget: after each event and its enforcement the free
    state pages are within the budget but for those of a path in use (a unit with a page in
    use never goes); victims are free and were cached; the invariants hold."""
    mirror = make(policy)
    mirror.use_free_events()
    mirror.snapshot_budget_pages = budget
    pool = Pool(mirror)
    for op, chain, x in ops:
        if op == "tick":
            mirror.tick()
            continue
        if op == "evict":
            pool.evict(x % 7)
        else:
            if op == "release":
                x |= 1  # events mode: every release is reported
            apply(mirror, pool, op, chain, x)
        before = set(mirror.cached_pages())
        victims = mirror.pick_snapshot_victims(mirror.snapshot_excess(), pool.is_free)
        assert set(victims) <= before and not set(victims) & pool.in_use
        for page in victims:
            mirror.drop_page(page)
        mirror.check_integrity(pool.is_free)  # inv 8: the budget, but for paths in use


def test_the_budget_takes_states_the_policy_keeps_when_nothing_else_frees_them() -> None:
    """marconi keeps a branch point's state (no unit holds it); a budget of 0 still holds:
    the unranked state goes alone, least recently used first; the KV stays."""
    mirror = make("marconi")
    mirror.use_free_events()
    mirror.snapshot_budget_pages = 0
    pool = Pool(mirror)
    a = pool.cache("ab", snap_at={1})
    mirror.tick()
    c = pool.cache("cd", snap_at={1})
    pool.cache("ae")  # "a" branches: marconi ranks neither its state nor its KV
    pool.cache("cf")
    victims = mirror.pick_snapshot_victims(mirror.snapshot_excess(), pool.is_free)
    # the duplicate KV pages of "a" and "c" (Pool.cache re-caches a prefix) go first
    assert victims[2:] == [a["a", S1], a["a", S2], c["c", S1], c["c", S2]]
    assert mirror.stats.duplicate_pages == 2 and len(victims) == 6
    assert mirror.free_state_pages() == 0
    assert mirror.stats.snapshot_units == 2 and mirror.stats.kv_units == 0
    mirror.check_integrity(pool.is_free)
    g = pool.cache("gh", snap_at={1}, used=True)  # a path in use keeps its state (inv 8)
    pool.cache("gi")
    pool.in_use.difference_update([g["g", S1], g["g", S2]])
    mirror.pages_freed([g["g", S1], g["g", S2]])
    victims = mirror.pick_snapshot_victims(mirror.snapshot_excess(), pool.is_free)
    assert victims and not set(victims) & {g["g", S1], g["g", S2]}  # "g"'s duplicate KV only
    assert mirror.free_state_pages() == 2
    mirror.check_integrity(pool.is_free)


def test_only_the_first_lookahead_paths_count() -> None:
    mirror = make("vllm")
    pool = Pool(mirror)
    old = pool.cache("ab", snap_at={2})
    mirror.tick()
    pool.cache("cd", snap_at={2})
    mirror.lookahead = lambda: paths("x", "y", "ab")  # "ab" is third in the queue
    mirror.lookahead_paths = 2
    assert set(pool.evict(1)) & set(old.values())


def test_shared_tokens_finds_the_junction_inside_a_cached_span() -> None:
    """Chained per-unit keys (unit 1 token, blocks of B = 4): a block cached with its units
    tells a later request how far into it the two agree."""
    mirror = make()
    ours = ["a1", "a2", "a3", "a4", "b1", "b2", "b3", "b4"]  # chained keys, one per token
    mirror.add(0, "a4", KV, B, None, units=(ours, 0))
    mirror.add(1, "b4", KV, 2 * B, "a4", units=(ours, B))
    mirror.add(2, "x4", KV, 2 * B, "a4")  # no units: never compared
    mirror.check_integrity()
    theirs = ["a1", "a2", "a3", "a4", "b1", "b2", "c3", "c4"]  # diverges after 6 tokens
    assert mirror.shared_tokens("a4", theirs, B, 1) == 2
    assert mirror.shared_tokens("a4", theirs, B, 1, limit=5) == 1
    assert mirror.shared_tokens(None, theirs, 0, 1) == 4
    assert mirror.shared_tokens("a4", ["a1", "a2", "a3", "a4", "z1"], B, 1) == 0
    assert mirror.shared_tokens("nothing", theirs, B, 1) == 0


def test_an_exact_junction_is_a_stop_only_past_vllms_and_worth_a_chunk() -> None:
    from vllm_hybrid.core import exact_junction_stop
    from vllm_hybrid.core.policy import MIN_JUNCTION_GAIN_TOKENS as GAIN

    assert exact_junction_stop(0, 600, 512) == 600
    assert exact_junction_stop(0, 512, 512) == 0  # vLLM stops there itself
    assert exact_junction_stop(637, 641, 0) == 0  # a next turn: a few tokens, no chunk
    assert exact_junction_stop(100, 100 + GAIN, 0) == 100 + GAIN
    assert exact_junction_stop(100, 99 + GAIN, 0) == 0
