"""cache_control marks in OpenAI chat and Anthropic /v1/messages bodies: found, validated,
stripped, and the prefix up to each (moved from tests/core/test_breakpoints.py with the code)."""

from __future__ import annotations

import pytest

from vllm_hybrid.core.breakpoints import MAX_BREAKPOINTS, CacheOptionError
from vllm_hybrid.serving.messages import (
    AnthropicMarker,
    Marker,
    anthropic_markers,
    anthropic_prefix,
    chat_markers,
    prefix_messages,
    strip_anthropic_cache_control,
    strip_cache_control,
)

EPHEMERAL = {"type": "ephemeral"}


def test_chat_markers_on_messages_and_blocks() -> None:
    messages = [
        {"role": "system", "content": "s", "cache_control": EPHEMERAL},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a", "cache_control": {**EPHEMERAL, "ttl": "1h"}},
                {"type": "text", "text": "b"},
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "c", "cache_control": EPHEMERAL}]},
        {"role": "assistant", "content": "no mark"},
    ]
    assert chat_markers(messages) == [
        Marker(0, None, True),
        Marker(1, 0, last_block=False),
        Marker(2, 0, last_block=True),
    ]
    stripped = strip_cache_control(messages)
    assert "cache_control" not in str(stripped) and "cache_control" in str(messages)
    head, cut = prefix_messages(messages, Marker(1, 0, False))
    assert cut and head[-1]["content"] == [{"type": "text", "text": "a"}] and len(head) == 2
    head, cut = prefix_messages(messages, Marker(0, None, True))
    assert not cut and head == [{"role": "system", "content": "s"}]


@pytest.mark.parametrize(
    ("mark", "message"),
    [
        ("yes", "cache_control must be an object"),
        ({"type": "persistent"}, "type 'persistent' is not supported"),
        ({"type": "ephemeral", "ttl": "1d"}, "ttl '1d' must be one of 5m, 1h"),
        ({"type": "ephemeral", "scope": "x"}, r"unknown field\(s\) \['scope'\]"),
    ],
)
def test_bad_marks_name_their_place(mark: object, message: str) -> None:
    with pytest.raises(CacheOptionError, match=r"messages\[0\].*" + message):
        chat_markers([{"role": "system", "content": "s", "cache_control": mark}])
    with pytest.raises(CacheOptionError, match=r"messages\[0\]\.content\[0\]"):
        chat_markers([{"role": "user", "content": [{"type": "text", "cache_control": mark}]}])


def test_too_many_marks_and_bad_messages() -> None:
    many = [{"role": "user", "content": "x", "cache_control": EPHEMERAL}] * (MAX_BREAKPOINTS + 1)
    with pytest.raises(CacheOptionError, match="at most 8 cache_control marks"):
        chat_markers(many)
    with pytest.raises(CacheOptionError, match="messages must be a list"):
        chat_markers("hi")


def test_anthropic_markers_strip_and_prefix() -> None:
    body = {
        "system": [
            {"type": "text", "text": "s1"},
            {"type": "text", "text": "s2", "cache_control": EPHEMERAL},
        ],
        "messages": [
            {"role": "user", "content": "plain"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a", "cache_control": EPHEMERAL},
                    {"type": "text", "text": "b"},
                ],
            },
        ],
        "tools": [{"name": "t", "input_schema": {}, "cache_control": EPHEMERAL}],
    }
    markers = anthropic_markers(body)
    assert markers == [AnthropicMarker(None, 1), AnthropicMarker(1, 0)]
    clean = strip_anthropic_cache_control(body)
    assert "cache_control" not in str(clean) and "cache_control" in str(body)
    head = anthropic_prefix(clean, markers[0])
    assert head["messages"] == [] and len(head["system"]) == 2
    head = anthropic_prefix(clean, markers[1])
    assert len(head["messages"]) == 2 and head["messages"][1]["content"] == [
        {"type": "text", "text": "a"}
    ]
    with pytest.raises(CacheOptionError, match=r"system\[0\]: cache_control type 'x'"):
        anthropic_markers(
            {"system": [{"type": "text", "text": "s", "cache_control": {"type": "x"}}]}
        )
