"""Bad input and misbehaving clients, end to end through ``vllm-hybrid serve``.

One server for the module (tiny Zamba2, the hybrid cache with its integrity checks after every
scheduler step: a violated invariant raises in the engine core and kills the server, which
every test checks). Each bad request gets a 4xx with a message that says what is wrong; then a
prompt cached before it still hits and answers exactly as when it was computed without cache
(nothing cached was corrupted). Clients that drop a stream mid-way (while decoding, and during
a chunked prefill) are aborted, free their blocks, and what they cached is correct.

Bad settings at start: ``vllm-hybrid serve`` checks the ``vllm_hybrid`` settings and the model
directory before it starts vLLM, so these fail in about a second, naming the setting.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from vllm_hybrid.demo import SYSTEM_PROMPT, free_port, start_server, stop_server, wait_ready
from vllm_hybrid.testing.fixtures import tiny_model_dir
from vllm_hybrid.testing.server import greedy, post, scrape, wait_metric

pytestmark = pytest.mark.engine

DEBUG = json.dumps({"vllm_hybrid": {"debug": True}})
PROBE = SYSTEM_PROMPT + "\nQuestion: where are the brushes?\nAnswer:"
PROBE_TOKENS = 6  # enough to tell answers apart, short to keep the module fast
_salts = itertools.count()


class Server:
    def __init__(self, model_dir: Path, log: Path) -> None:
        self.port, self.log = free_port(), log
        self.base = f"http://127.0.0.1:{self.port}"
        flags = ("--additional-config", DEBUG, "--max-num-batched-tokens", "256")
        self.proc = start_server(model_dir, self.port, log, *flags)
        try:
            wait_ready(self.proc, self.port, log)
        except Exception:
            stop_server(self.proc)
            raise

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            return False
        with urllib.request.urlopen(f"{self.base}/health", timeout=5) as response:
            return response.status == 200

    def tail(self) -> str:
        return self.log.read_text()[-4000:]


@pytest.fixture(scope="module")
def server(model_root, tmp_path_factory):
    model_dir = tiny_model_dir("zamba2", model_root)
    srv = Server(model_dir, tmp_path_factory.mktemp("bad-input") / "server.log")
    try:
        yield srv
    finally:
        stop_server(srv.proc)


def uncached(base: str, prompt: str, max_tokens: int):
    """The prompt computed with no cache hit: under a salt no request used before."""
    reply = greedy(base, prompt=prompt, max_tokens=max_tokens, salt=f"fresh-{next(_salts)}")
    assert reply.status == 200 and reply.cached_tokens == 0, reply
    return reply


@pytest.fixture(scope="module")
def probe(server):
    """A prompt cached before the bad requests, and its uncached greedy answer."""
    reference = uncached(server.base, PROBE, PROBE_TOKENS)
    greedy(server.base, prompt=PROBE, max_tokens=PROBE_TOKENS)  # cache it (the salted one is apart)
    return reference.token_ids


def assert_still_serving(server, probe) -> None:
    assert server.alive(), server.tail()
    reply = greedy(server.base, prompt=PROBE, max_tokens=PROBE_TOKENS)
    assert reply.status == 200 and reply.cached_tokens > 0, reply
    assert reply.token_ids == probe, "a cached prompt answers differently after bad input"


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = {
    # name: (path, JSON body or raw bytes, words the error message must contain)
    "malformed json": (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", ', ["json"]),
    "malformed json chat": (CHAT, b'{"model": "tiny", "messages": [', ["json"]),
    "not an object": (COMPLETIONS, b"[1, 2, 3]", []),
    "oversized prompt": (
        COMPLETIONS,
        {"model": "tiny", "prompt": SYSTEM_PROMPT * 40, "max_tokens": 4},
        ["context length"],
    ),
    "oversized token prompt": (
        COMPLETIONS,
        {"model": "tiny", "prompt": [11] * 5000, "max_tokens": 4},
        ["context length"],
    ),
    "absurd max_tokens": (
        COMPLETIONS,
        {"model": "tiny", "prompt": "hi", "max_tokens": 10**12},
        ["max_tokens"],
    ),
    "absurd max_tokens chat": (CHAT, {"model": "tiny", "messages": HI, "max_tokens": 10**9}, []),
    "negative max_tokens": (
        COMPLETIONS,
        {"model": "tiny", "prompt": "hi", "max_tokens": -5},
        ["max_tokens"],
    ),
    "max_tokens not a number": (
        COMPLETIONS,
        {"model": "tiny", "prompt": "hi", "max_tokens": "ten"},
        ["max_tokens"],
    ),
    "negative temperature": (
        COMPLETIONS,
        {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": -1},
        ["temperature"],
    ),
    "token id out of vocabulary": (
        COMPLETIONS,
        {"model": "tiny", "prompt": [10, 10**9], "max_tokens": 4},
        ["token"],
    ),
    "empty cache_salt": (
        COMPLETIONS,
        {"model": "tiny", "prompt": "hi", "max_tokens": 4, "cache_salt": ""},
        ["cache_salt"],
    ),
    "missing prompt": (COMPLETIONS, {"model": "tiny", "max_tokens": 4}, ["prompt"]),
    "messages not a list": (CHAT, {"model": "tiny", "messages": "hi", "max_tokens": 4}, []),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_is_a_400_and_the_cache_survives(server, probe, name):
    path, body, words = BAD_REQUESTS[name]
    if isinstance(body, bytes):
        status, text = post(server.base + path, None, raw=body)
    else:
        status, text = post(server.base + path, body)
    assert 400 <= status < 500, f"{name}: HTTP {status} {text[:500]}"
    assert status != 404 and status != 405
    message = text.lower()
    assert message.strip(), f"{name}: an empty error body"
    for word in words:
        assert word in message, f"{name}: {word!r} not in {text[:500]}"
    assert_still_serving(server, probe)


def test_unknown_fields_are_ignored(server, probe):
    """vLLM accepts (and logs) fields it does not know: the answer is the same as without."""
    reply = greedy(server.base, prompt=PROBE, max_tokens=PROBE_TOKENS, frobnicate={"x": 1}, foo=3)
    assert reply.status == 200 and reply.token_ids == probe and reply.cached_tokens > 0
    assert_still_serving(server, probe)


def test_burst_of_bad_requests_between_good_ones(server, probe):
    """Bad requests from several clients at once, interleaved with good ones."""
    bodies = [b for _, b, _ in BAD_REQUESTS.values()]
    statuses: list[int] = []

    def bad(i: int) -> None:
        body = bodies[i % len(bodies)]
        path = COMPLETIONS if i % 2 else CHAT
        if isinstance(body, bytes):
            statuses.append(post(server.base + path, None, raw=body)[0])
        else:
            statuses.append(post(server.base + path, body)[0])

    good = []
    threads = [threading.Thread(target=bad, args=(i,)) for i in range(24)]
    threads.append(
        threading.Thread(
            target=lambda: good.extend(
                greedy(server.base, prompt=PROBE, max_tokens=PROBE_TOKENS) for _ in range(3)
            )
        )
    )
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(statuses) == 24 and all(400 <= s < 500 for s in statuses), statuses
    assert [r.token_ids for r in good] == [probe] * 3
    assert_still_serving(server, probe)


# ------------------------------------------------------------------ dropped connections
def stream_and_drop(base: str, prompt: str, chunks: int, max_tokens: int = 2000) -> int:
    """Stream a completion, read ``chunks`` events (0: close as soon as the headers are in,
    i.e. during the prefill), then drop the connection. Returns the events read."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    read = 0
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            assert response.status_code == 200
            if chunks:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        read += 1
                        if read >= chunks:
                            break
    return read  # leaving both blocks closes the socket mid-stream


def test_client_disconnects_mid_stream(server, probe):
    prompt = SYSTEM_PROMPT + "\nQuestion: which aisle holds the valves?\nAnswer:"
    long_prompt = SYSTEM_PROMPT * 2 + "\nQuestion: do you sell rollers?\nAnswer:"
    before = scrape(server.base)

    # four clients drop their streams (two while decoding, two during the chunked prefill of
    # a longer prompt) while a fifth keeps asking, and gets its answers meanwhile
    served: list = []
    done = threading.Event()

    def steady() -> None:
        while not done.is_set():
            served.append(greedy(server.base, prompt=PROBE, max_tokens=PROBE_TOKENS))

    steady_thread = threading.Thread(target=steady)
    steady_thread.start()
    drops = [(prompt, 3), (prompt, 5), (long_prompt, 0), (long_prompt, 0)]
    threads = [threading.Thread(target=stream_and_drop, args=(server.base, p, c)) for p, c in drops]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    steady_thread.join(120)
    assert served and [r.token_ids for r in served] == [probe] * len(served)

    # the aborted requests leave the engine and free their blocks: nothing running, no block
    # in use (cached blocks count as free), far fewer tokens generated than the 4 x 2000 asked
    wait_metric(server.base, "vllm:num_requests_running", lambda v: v == 0)
    after = wait_metric(server.base, "vllm:kv_cache_usage_perc", lambda v: v == 0)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    generated -= sum(len(r.token_ids) for r in served)  # the steady client's
    assert generated < 1000, f"{generated} tokens: the dropped streams were not aborted"

    # what the aborted requests cached is correct: their prompts hit and answer as uncached
    for p in (prompt, long_prompt):
        hit = greedy(server.base, prompt=p, max_tokens=16)
        assert hit.status == 200 and hit.cached_tokens > 0, hit
        assert hit.token_ids == uncached(server.base, p, 16).token_ids
    assert_still_serving(server, probe)


# ------------------------------------------------------------------ bad settings at start
def serve(model: str | Path, *args: str, env: dict | None = None) -> tuple[int, str, float]:
    """Run ``vllm-hybrid serve`` expecting it to fail; returns (exit code, output, seconds)."""
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_hybrid.cli", "serve", str(model), "--port", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - began


BAD_SETTINGS = {
    "unknown policy": ({"policy": "lfu"}, "policy 'lfu' is not a policy"),
    "bad snapshot_every": ({"snapshot_every": "often"}, "snapshot_every 'often'"),
    "negative snapshot_every": ({"snapshot_every": -128}, "snapshot_every -128"),
    "unknown key": ({"polcy": "flop"}, "unknown setting(s) ['polcy']"),
    "bad debug flag": ({"debug": "maybe"}, "debug 'maybe'"),
    "not an object": (["flop"], 'additional_config["vllm_hybrid"] must be an object'),
}


@pytest.mark.parametrize("name", list(BAD_SETTINGS))
def test_bad_setting_fails_at_once_naming_it(model_root, name):
    settings, message = BAD_SETTINGS[name]
    model = tiny_model_dir("zamba2", model_root)
    config = json.dumps({"vllm_hybrid": settings})
    code, out, seconds = serve(model, "--additional-config", config)
    assert code != 0 and message in out, out[-2000:]
    assert seconds < 30, f"took {seconds:.1f}s"  # before vLLM starts (it takes ~20-80 s here)


def test_bad_environment_setting_fails_at_once(model_root):
    model = tiny_model_dir("zamba2", model_root)
    code, out, _ = serve(model, env={"VLLM_HYBRID_POLICY": "nope"})
    assert code != 0 and "policy 'nope' is not a policy" in out, out[-2000:]


def test_unsupported_model_directory(tmp_path, model_root):
    code, out, seconds = serve(tmp_path / "nowhere")
    assert code != 0 and "not found" in out
    empty = tmp_path / "no-config"
    empty.mkdir()
    (empty / "tokenizer.json").write_text("{}")
    code, out, seconds = serve(empty)
    assert code != 0 and "has no config.json" in out, out[-2000:]
    assert seconds < 30


@pytest.mark.slow  # vLLM itself refuses it, after ~20 s of start-up
def test_unknown_architecture_is_refused_by_vllm(tmp_path, model_root):
    model = tiny_model_dir("zamba2", model_root)
    bogus = tmp_path / "bogus"
    bogus.mkdir()
    for f in model.iterdir():
        if f.is_file():
            (bogus / f.name).write_bytes(f.read_bytes())
    config = json.loads((bogus / "config.json").read_text())
    config["architectures"] = ["NoSuchHybridForCausalLM"]
    (bogus / "config.json").write_text(json.dumps(config))
    code, out, _ = serve(bogus, "--dtype", "float32", "--enforce-eager")
    assert code != 0 and "NoSuchHybridForCausalLM" in out, out[-3000:]
