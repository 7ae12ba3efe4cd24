"""End to end against a real `vllm-hybrid serve` process on loopback, via the openai client.

One server per module (start-up dominates on 2 cores). Oracles: cached tokens are reported
and grow turn by turn; streamed == non-streamed text; concurrent clients get the same greedy
outputs as one client alone; bad requests get a 4xx and the server keeps serving.
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.engine.test_examples import load_example
from vllm_hybrid.demo import (
    QUESTIONS,
    SYSTEM_PROMPT,
    free_port,
    start_server,
    stop_server,
    wait_ready,
)
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(model_root, tmp_path_factory):
    port, log = free_port(), tmp_path_factory.mktemp("server") / "server.log"
    proc = start_server(tiny_model_dir("zamba2", model_root), port, log)
    try:
        wait_ready(proc, port, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none")


def converse(client, questions, system=SYSTEM_PROMPT, stream=False):
    """A multi-turn chat; returns (replies, cached tokens per turn)."""
    messages = [{"role": "system", "content": system}]
    replies, cached = [], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        kwargs = dict(model="tiny", messages=messages, max_tokens=16, temperature=0.0)
        if stream:
            chunks = list(
                client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kwargs
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            reply = client.chat.completions.create(**kwargs)
            text, usage = reply.choices[0].message.content, reply.usage
        replies.append(text)
        cached.append(usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": text})
    return replies, cached


def test_five_turn_chat_cached_tokens_grow(client):
    _, cached = converse(client, QUESTIONS, system=SYSTEM_PROMPT + " (five turns)")
    assert cached[0] == 0
    assert all(c > 0 for c in cached[1:])
    assert cached == sorted(cached) and cached[-1] > cached[1]


def test_streaming_equals_non_streaming(client):
    system = SYSTEM_PROMPT + " (stream check)"
    plain, _ = converse(client, QUESTIONS[:3], system=system)
    streamed, cached = converse(client, QUESTIONS[:3], system=system, stream=True)
    assert streamed == plain
    assert cached[0] > 0  # the same conversation again: served from cache


def test_completions_stream_and_not(client):
    prompt = SYSTEM_PROMPT + "\nQuestion: where are the hoses?\nAnswer:"
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == first.choices[0].text
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_concurrent_clients_match_sequential(client):
    systems = [f"{SYSTEM_PROMPT} (client {i})" for i in range(4)]
    sequential = [converse(client, QUESTIONS[:2], system=s)[0] for s in systems]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(lambda s: converse(client, QUESTIONS[:2], system=s)[0], systems))
    assert concurrent == sequential


def test_metrics_expose_prefix_cache_counters(client, server):
    converse(client, QUESTIONS[:2], system=SYSTEM_PROMPT + " (metrics)")
    with urllib.request.urlopen(f"{server}/metrics", timeout=10) as response:
        text = response.read().decode()
    hits = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits")]
    assert hits and float(hits[0].split()[-1]) > 0


def test_bad_request_is_a_4xx_and_server_keeps_serving(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", max_tokens=10**6, messages=[{"role": "user", "content": "hi"}]
        )
    replies, _ = converse(client, QUESTIONS[:1])
    assert replies[0]


def test_chat_client_example(server):
    cached = load_example("chat_client").main(f"{server}/v1", "tiny")
    assert cached[0] == 0 and cached[1] > 0 and cached[2] >= cached[1]


def test_cache_salt_isolates_tenants(client):
    """Identical prompts under different cache_salt never share cached blocks or states."""
    prompt = SYSTEM_PROMPT + "\nQuestion: which aisle has rollers?\nAnswer:"

    def cached(salt):
        reply = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            extra_body={"cache_salt": salt},
        )
        return reply.usage.prompt_tokens_details.cached_tokens, reply.choices[0].text

    first_a, text_a = cached("tenant-a")
    again_a, _ = cached("tenant-a")
    first_b, text_b = cached("tenant-b")
    assert again_a > 0, "the same tenant should hit its own cache"
    assert first_b == 0, "another tenant must not hit tenant-a's cache"
    assert text_a == text_b
