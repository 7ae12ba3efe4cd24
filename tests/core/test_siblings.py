"""core/siblings.py: where a producer stops for a waiting sibling, and who waits for whom."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_hybrid.core import Sibling, SiblingWaits, common_prefix_tokens, shared_hash_units
from vllm_hybrid.core.siblings import (
    MAX_SIBLING_STOPS,
    MAX_SIBLING_WAITS,
    SIBLING_LOOKAHEAD,
    sibling_stop,
    sibling_stops,
)


def chain(tokens: list[int], unit: int, salt: str = "") -> list[bytes]:
    """Chained hashes of ``tokens``, one per full ``unit`` tokens (as vLLM's block hashes)."""
    out, parent = [], salt.encode()
    for i in range(len(tokens) // unit):
        parent = hashlib.sha256(parent + repr(tokens[i * unit : (i + 1) * unit]).encode()).digest()
        out.append(parent)
    return out


@given(
    st.lists(st.integers(0, 3), max_size=60),
    st.lists(st.integers(0, 3), max_size=60),
    st.integers(1, 8),
)
def test_shared_hash_units_is_the_common_prefix_floored_to_the_unit(a, b, unit):
    shared = common_prefix_tokens(a, b)
    assert shared_hash_units(chain(a, unit), chain(b, unit)) == min(
        shared // unit, len(a) // unit, len(b) // unit
    )


def test_salts_share_nothing():
    tokens = list(range(100))
    assert shared_hash_units(chain(tokens, 1, "t0"), chain(tokens, 1, "t1")) == 0
    assert shared_hash_units(chain(tokens, 1, "t0"), chain(tokens, 1, "t0")) == 100


def test_sibling_stop():
    # floored to the unit, at least the gain past the producer's progress
    assert sibling_stop(600, 0, 700, 650, 1, 128) == 600
    assert sibling_stop(600, 0, 700, 650, 128, 128) == 512
    assert sibling_stop(600, 500, 700, 650, 1, 128) == 0  # saves 100 < 128
    assert sibling_stop(600, 472, 700, 650, 1, 128) == 600  # saves exactly 128
    # never a one-token prefill chunk left for either request
    assert sibling_stop(900, 0, 1000, 700, 1, 128) == 698
    # inside the producer's last prompt block: floored to the block
    assert sibling_stop(690, 0, 700, 900, 1, 128) == 640
    # a consumer that extends the producer's whole prompt resumes at its prompt end instead
    assert sibling_stop(699, 0, 700, 900, 1, 128) == 0
    assert sibling_stop(700, 0, 700, 700, 128, 128) == 0
    assert sibling_stop(600, 0, 640, 700, 1, 128) == 512
    assert sibling_stop(600, 0, 641, 700, 1, 128) == 600
    assert sibling_stop(0, 0, 10, 10, 1, 1) == 0
    for unit, block in ((0, 128), (48, 128)):
        with pytest.raises(ValueError):
            sibling_stop(600, 0, 700, 650, unit, block)


def _waits(unit: int = 1, stop: int = 1, block: int = 128) -> SiblingWaits:
    return SiblingWaits(hash_tokens=unit, stop_tokens=stop, block_tokens=block)


def _request(key: str, tokens: list[int], done: int = 0, pending: int = 0) -> Sibling:
    return Sibling(key, chain(tokens, 1), len(tokens), done, pending)


def test_stops_look_ahead_at_the_waiting_siblings():
    rng = random.Random(0)
    prefix = [rng.randrange(100) for _ in range(600)]
    a = _request("a", prefix + [1] * 50)
    siblings = [
        _request("b", prefix + [2] * 50),  # diverges at 600
        _request("c", prefix[:300] + [3] * 400),  # at 300
        _request("d", prefix[:700] + [4] * 10),  # at 600 too
        _request("e", [5] * 700),  # shares nothing
        _request("f", prefix[:450] + [6] * 10),  # at 450
    ]
    waits = _waits()
    # the two deepest distinct stops, ascending; the producer itself is skipped
    assert waits.stops(a, [a, *siblings]) == [300, 450, 600][-MAX_SIBLING_STOPS:]
    assert waits.stops(_request("a", prefix + [1] * 50, done=500), siblings) == []
    assert _waits(stop=128).stops(a, siblings) == [384, 512]  # 300, 450, 600 floored
    # the producer at the head of vLLM's queue does not count against the lookahead
    others = [_request(f"u{i}", [5] * 700) for i in range(SIBLING_LOOKAHEAD - 1)]
    assert waits.stops(a, [a, *others, siblings[0]]) == [600]
    assert waits.stops(a, [a, *others, siblings[4], siblings[0]]) == [450]
    # only as many as can start beside it: the running slots left after its own
    assert waits.stops(a, [a, *siblings], slots=2) == [300, 600]
    assert waits.stops(a, [a, *siblings], slots=0) == []


def test_sibling_stops_is_the_simulators_entry():
    """(shared tokens, prompt) per waiting request, as the simulator gives them."""
    consumers = [(600, 650), (300, 700), (600, 710), (0, 700), (450, 460)]
    assert sibling_stops(0, 650, consumers, 1, 128) == [450, 600]
    assert sibling_stops(0, 650, consumers, 128, 128) == [384, 512]
    assert sibling_stops(400, 650, consumers, 1, 128) == [600]
    assert sibling_stops(0, 650, [(0, 700)] * SIBLING_LOOKAHEAD + [(600, 650)], 1, 128) == []


def test_wait_for_names_the_producer_and_the_stop_to_add():
    rng = random.Random(1)
    prefix = [rng.randrange(100) for _ in range(600)]
    waits = _waits()
    consumer = _request("w", prefix + [2] * 40)
    producer = _request("p", prefix + [1] * 100)
    unrelated = _request("u", [7] * 640)
    assert waits.wait_for(consumer, [("U", unrelated)]) is None
    assert waits.wait_for(consumer, [("U", unrelated), ("P", producer)]) == ("P", 600)
    # a pending stop at or below the junction is already what the consumer needs
    pending = _request("p", prefix + [1] * 100, done=0, pending=512)
    assert waits.wait_for(consumer, [("P", pending)]) == ("P", 0)
    beyond = _request("p", prefix + [1] * 100, done=0, pending=620)
    assert waits.wait_for(consumer, [("P", beyond)]) == ("P", 600)
    # a producer past the junction gives nothing to wait for
    assert waits.wait_for(consumer, [("P", _request("p", prefix + [1] * 100, done=600))]) is None
    assert waits.waits["w"] == 3


def test_a_consumer_of_the_whole_prompt_waits_for_its_end():
    """A next turn or a repeat of a producer still in its prompt waits, adding no stop, for
    the producer's prompt-end state, while that is a block or more away."""
    rng = random.Random(2)
    prompt = [rng.randrange(100) for _ in range(700)]
    waits = _waits()
    for consumer in (_request("w", prompt), _request("w", prompt + [3] * 50)):
        assert waits.wait_for(consumer, [("P", _request("p", prompt, done=512))]) == ("P", 0)
        assert waits.wait_for(consumer, [("P", _request("p", prompt, done=600))]) is None
        assert waits.stops(_request("p", prompt), [consumer]) == []


def test_a_consumer_waits_a_bounded_number_of_steps():
    prefix = list(range(400))
    waits = _waits()
    consumer = _request("w", prefix + [1] * 10)
    producer = [("P", _request("p", prefix + [2] * 10))]
    for _ in range(MAX_SIBLING_WAITS):
        assert waits.wait_for(consumer, producer) is not None
    assert waits.wait_for(consumer, producer) is None
    waits.producers["w"] = object()
    waits.forget("w")
    assert "w" not in waits.waits and "w" not in waits.producers


def test_bad_units_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        SiblingWaits(hash_tokens=16, stop_tokens=24, block_tokens=128)
    with pytest.raises(ValueError):
        SiblingWaits(hash_tokens=0, stop_tokens=128, block_tokens=128)
    with pytest.raises(ValueError):
        SiblingWaits(hash_tokens=16, stop_tokens=32, block_tokens=48)
