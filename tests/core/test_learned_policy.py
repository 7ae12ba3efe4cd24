"""``learned``: its labels (hits, ghost hits, expired ghosts) and its oracles on a replay."""

from __future__ import annotations

import pytest

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.learned import LearnedPolicy
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policies import POLICIES
from vllm_hybrid.core.policy import AdmitContext
from vllm_hybrid.core.shapes import load_shape
from vllm_hybrid.sim.generators import gen_agent, gen_chat
from vllm_hybrid.sim.replay import replay
from vllm_hybrid.sim.trace import KeyedRequest

COST = CostModel(load_shape("zamba2-7b"), 64)


def _ctx(t: int, prompt: int, hit: int, keys: dict[int, str]) -> AdmitContext:
    return AdmitContext(t, prompt, prompt, hit, hit, False, 64, False, lambda p: keys.get(p))


def test_registered_for_simulate_and_the_engine() -> None:
    assert POLICIES["learned"] is LearnedPolicy
    assert LearnedPolicy(COST).reuse_probability(Node("n", None, 0, 64, 0)) == 0.5  # no data


def test_hits_are_positives_ghosts_label_late_positives_and_negatives() -> None:
    pol = LearnedPolicy(COST)
    node = Node("a", None, 0, 64, 0)
    node.has_snapshot, node.origin = True, 0
    node.snap_hits = node.hits = 1  # the index counts the hit before observe
    pol.observe(_ctx(1, 200, 64, {64: "a"}), node)
    assert pol.examples == [0, 1]
    assert pol.reuse_probability(node) > 0.5  # learned from the hit
    # Evicted at request 5 (residence 5); a request through its key is a late positive.
    pol._now = 5
    pol.on_evicted(node, False, 10)
    assert len(pol.ghost_labels) == 1 and pol.horizon == 5
    pol.observe(_ctx(6, 200, 0, {64: "a"}), Node("root", None, 0, 0, 0))
    assert pol.examples == [0, 2] and len(pol.ghost_labels) == 0
    # Evicted again and never asked for within the horizon: a negative.
    pol._now = 7
    pol.on_evicted(node, False, 10)
    pol.observe(_ctx(7 + 7, 200, 0, {}), Node("root", None, 0, 0, 0))
    assert pol.examples == [1, 2] and len(pol.ghost_labels) == 0


@pytest.mark.parametrize("gen", [gen_chat, gen_agent])
@pytest.mark.parametrize("budget_gb", [0.05, 0.5, 2.0])
def test_replay_keeps_integrity_and_budget(gen, budget_gb: float) -> None:
    """Integrity checked after every request (``check_every=1``); the replay raises on any
    overrun; a hit never exceeds its prompt."""
    keyed = [KeyedRequest(r, 64) for r in gen()[:120]]
    budget = int(budget_gb * 1e9)
    pol = LearnedPolicy(COST)
    stats = replay(keyed, COST, pol, budget, check_every=1)
    assert stats.peak_bytes <= budget
    assert 0 <= stats.hit_tokens <= stats.prompt_tokens
    if budget_gb >= 0.5:  # (at 0.05 GB no state fits: nothing to learn from)
        assert sum(pol.examples) > 0  # it learned from what it observed
