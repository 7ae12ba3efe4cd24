"""``flop``'s ARC-style recency/value balance (core/ghosts.py), by hand, plus bounds."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hybrid.core.ghosts import RECENCY, VALUE, GhostBalance
from vllm_hybrid.core.policy import AdmitContext

B = 64


def _ctx(prompt: int, hit: int, probe=None) -> AdmitContext:  # type: ignore[no-untyped-def]
    return AdmitContext(0, prompt, prompt, hit, hit, False, B, True, lambda p: ("full", p), probe)


def test_scale_interpolates_recency_and_value() -> None:
    g = GhostBalance(B, eff_ref=10.0, gamma=0.0)
    assert g.scale(1000.0) == 1.0 and g.scale(0.0) == 0.0  # recency: every entry alike
    g.gamma = 1.0
    assert math.isclose(g.scale(1000.0), 100.0)  # value: efficiency over the unit
    g.gamma = 0.5
    assert math.isclose(g.scale(1000.0), 10.0)


def test_evictions_are_classed_by_what_made_them() -> None:
    g = GhostBalance(B, eff_ref=1.0)
    g.on_evicted("first", 64, eff=1.0, age=10, live=10)  # at the averages: no ghost
    assert len(g) == 0
    g.on_evicted("young-cheap", 128, eff=1.0, age=1, live=10)  # value eviction
    g.on_evicted("old-rich", 192, eff=math.e**3, age=50, live=10)  # recency eviction
    g.on_evicted("old-cheap", 256, eff=1e-3, age=99, live=10)  # both agree: forgotten
    assert list(g._ghosts[VALUE]) == ["young-cheap"]
    assert list(g._ghosts[RECENCY]) == ["old-rich"]


def test_ghost_hit_moves_gamma_by_the_arc_step() -> None:
    g = GhostBalance(B, eff_ref=1.0)
    g.on_evicted("a", 64, eff=1.0, age=10, live=4)  # mean log eff 0, mean age 10
    g.on_evicted(("full", 128), 128, eff=math.e, age=20, live=4)  # old, rich: RECENCY
    mean = g.mean_log_eff  # (0 + 1) / 2
    # A request whose prompt reaches block 128 but that resumed from nothing: a ghost hit.
    assert g.observe(_ctx(300, 0)) == RECENCY
    step = max(1.0, 0 / 1) / 4 * math.exp(1.0 - mean)
    assert math.isclose(g.gamma, 0.5 + step)
    assert g.ghost_hits == [1, 0] and len(g) == 0
    assert g.observe(_ctx(300, 0)) is None  # a ghost is hit once


def test_ghost_behind_the_real_hit_or_past_the_prompt_is_no_hit() -> None:
    g = GhostBalance(B, eff_ref=1.0)
    g.on_evicted("a", 64, eff=1.0, age=10, live=8)
    g.on_evicted(("full", 128), 128, eff=math.e, age=20, live=8)
    assert g.observe(_ctx(300, 192)) is None  # resumed deeper than the ghost anyway
    assert g.observe(_ctx(128, 0)) is None  # the last prompt token must be computed
    assert g.gamma == 0.5


def test_exact_end_ghosts_match_through_the_probe() -> None:
    g = GhostBalance(B, eff_ref=1.0)
    g.on_evicted("a", 64, eff=math.e, age=30, live=8)
    g.on_evicted(("part", 2, 10), 138, eff=1.0, age=1, live=8)  # young, cheap: VALUE
    assert g._ends == {1: {0: 1}, 2: {10: 1}}  # block 1 end 64 (full), block 2 + 10
    assert g.observe(_ctx(300, 64, probe=lambda i, n: ("part", i, n))) == VALUE
    assert g.gamma < 0.5 and g._ends == {1: {0: 1}}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.floats(1e-6, 1e6), st.integers(0, 50), st.integers(1, 6)),
        max_size=80,
    ),
    st.lists(st.tuples(st.integers(2, 2000), st.integers(0, 2000)), max_size=40),
)
def test_ghosts_stay_bounded_and_gamma_in_range(evictions, requests) -> None:  # type: ignore[no-untyped-def]
    g = GhostBalance(B, eff_ref=1.0)
    for (block, eff, age, live), (prompt, hit) in zip(
        evictions, requests + [(2, 0)] * 80, strict=False
    ):
        end = block * B + (block % 3) * 7  # some exact ends
        key = ("part", block, block % 3 * 7) if end % B else ("full", end)
        g.on_evicted(key, end, eff, age, live)
        assert len(g) <= max(1, live)
        probe = lambda i, n: ("part", i, n)  # noqa: E731
        g.observe(_ctx(prompt, min(hit, prompt - 1) // B * B, probe))
        assert 0.0 <= g.gamma <= 1.0
        assert sum(sum(s.values()) for s in g._ends.values()) == len(g)
