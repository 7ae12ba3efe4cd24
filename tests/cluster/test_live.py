"""The live cluster: a local Ray cluster with 2 replicas of the tiny Zamba2 behind the OpenAI
ingress (``cluster/app.py``), routed by ``state``. Multi-turn chats from concurrent clients,
cache_salt tenants included. Oracles: every answer equals a caching-off single engine's on the
same prompt token for token; every later turn lands on the replica of its conversation's
previous turn (the router logged no overload) and hits there (that replica holds the state);
the router's view of both replicas came from their digests."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the cluster tests need the cluster extra")
pytest.importorskip("vllm", reason="the cluster tests need the cpu extra")

from vllm_hybrid.cluster import live  # noqa: E402
from vllm_hybrid.testing.fixtures import model_cache_root, tiny_model_dir  # noqa: E402
from vllm_hybrid.testing.oracle import caching_off_outputs  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.engine]

MAX_TOKENS = 6


def check_chats(model, conversations, state):
    turns = [t for c in conversations for t in c.turns]
    assert all(t.status == 200 for t in turns), [t.body for t in turns if t.status != 200]
    assert set(state["digests"]) == set(state["live"]) and len(state["live"]) == 2
    layouts = [d["layout"] for d in state["digests"].values()]  # what bench replay simulates
    assert all(x["blocks"] > 0 and x["model_type"] == "zamba2" for x in layouts), layouts
    assert not state["warnings"], state["warnings"]
    summary = live.summarize(conversations, state)
    assert not state["overloads"]
    assert not summary["later_turns_moved"], summary["later_turns_moved"]
    for c in conversations:
        for t in c.turns[1:]:
            assert t.cached_tokens > 0, (c.index, t.turn, t.replica)
    expected = caching_off_outputs(model, [t.prompt_ids for t in turns], MAX_TOKENS)
    assert [t.token_ids for t in turns] == expected
    return summary


def test_two_replicas_chats_follow_their_state_and_equal_caching_off(tmp_path_factory):
    model = tiny_model_dir("zamba2", model_cache_root(tmp_path_factory.mktemp("models")))
    conversations = live.make_conversations(4, 3, seed=1)
    with live.local_cluster(str(model), 2, "state") as base:
        live.wait_digests(base, 2)
        live.run_chats(base, conversations, clients=4, max_tokens=MAX_TOKENS)
        state = live.get_json(f"{base}/v1/hybrid/cluster")
    summary = check_chats(model, conversations, state)
    assert len(summary["per_replica"]) == 2  # both replicas served
