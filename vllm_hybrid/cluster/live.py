"""Run the cluster app in this process's Ray and drive it: what the live test and
``benchmarks/cluster_live.py`` share (multi-turn chats from concurrent clients, cache_salt
tenants, per-turn replica and cached tokens; one caching-off engine as the oracle)."""

from __future__ import annotations

import json
import os
import random
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vllm_hybrid.cluster.app import REPLICA_HEADER

#: vLLM flags of the tiny models the tests use (fp32 equals HF; see testing/fixtures.py).
TINY_FLAGS = [
    "--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager",
    "--max-model-len", "4096", "--enable-prefix-caching", "--enable-prompt-tokens-details",
]  # fmt: skip
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_cluster(
    model: str,
    replicas: int,
    router: str,
    extra_flags: list[str] | None = None,
    log_to_driver: bool = True,
    **app_kwargs: Any,
) -> Any:
    """Ray + the app on a free port; yields the base URL; shuts everything down.
    ``log_to_driver=False``: the replicas' logs stay in Ray's session directory
    (``/tmp/ray/session_latest/logs``) instead of this process's stdout."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    import ray
    from ray import serve

    from vllm_hybrid.cluster.app import build_app

    port = free_port()
    ray.init(
        num_cpus=max(os.cpu_count() or 2, 2),
        include_dashboard=False,
        ignore_reinit_error=True,
        log_to_driver=log_to_driver,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = build_app(
            model, [*TINY_FLAGS, *(extra_flags or [])], replicas=replicas, router=router,
            **app_kwargs,
        )  # fmt: skip
        serve.run(app, name="vllm-hybrid", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def post(url: str, payload: Any, timeout: float = 300) -> tuple[int, dict[str, Any], str]:
    """(status, headers, body) for any status."""
    data = json.dumps(payload).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def get_json(url: str, timeout: float = 30) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@dataclass
class Turn:
    conversation: int
    turn: int
    status: int
    replica: str | None
    prompt_tokens: int
    cached_tokens: int
    token_ids: tuple[int, ...]
    body: str = ""
    prompt_ids: tuple[int, ...] = ()


@dataclass
class Conversation:
    index: int
    system: str
    questions: list[str]
    salt: str | None = None
    turns: list[Turn] = field(default_factory=list)


WORDS = (
    "state cache prefix replica router block token turn chat model engine layer scan "
    "snapshot kernel queue prefill decode hybrid attention recurrent mamba batch"
).split()


def make_conversations(
    n: int, turns: int, seed: int = 0, tenants: int = 2, shared_systems: int = 2
) -> list[Conversation]:
    """``n`` chats of ``turns`` turns: chat ``i`` has system prompt ``i % shared_systems``
    (~300 tokens each); chats with ``(i // 2)`` odd are in cache_salt tenant
    ``t{(i // 4) % tenants}``, the others unsalted (so salts cut across system prompts: 8 chats
    give 2 unsalted per system prompt and 4 salted ones); questions random words."""
    rng = random.Random(seed)
    systems = [
        f"You are assistant {k}. " + " ".join(rng.choice(WORDS) for _ in range(220))
        for k in range(shared_systems)
    ]
    out = []
    for i in range(n):
        questions = [
            f"Question {t} of chat {i}: " + " ".join(rng.choice(WORDS) for _ in range(40))
            for t in range(turns)
        ]
        salt = f"t{(i // 4) % tenants}" if (i // 2) % 2 else None
        out.append(Conversation(i, systems[i % shared_systems], questions, salt))
    return out


def chat_turn(
    base: str, conv: Conversation, messages: list[dict[str, str]], max_tokens: int
) -> Turn:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if conv.salt is not None:
        body["cache_salt"] = conv.salt
    status, headers, text = post(f"{base}/v1/chat/completions", body)
    replica = {k.lower(): v for k, v in headers.items()}.get(REPLICA_HEADER)
    if status != 200:
        return Turn(conv.index, len(conv.turns), status, replica, 0, 0, (), text)
    data = json.loads(text)
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    choice = data["choices"][0]
    ids = tuple(choice.get("token_ids") or ())
    messages.append({"role": "assistant", "content": choice["message"]["content"] or ""})
    return Turn(
        conv.index,
        len(conv.turns),
        status,
        replica,
        int(usage.get("prompt_tokens", 0)),
        int(details.get("cached_tokens") or 0),
        ids,
        prompt_ids=tuple(data.get("prompt_token_ids") or ()),
    )


def run_chats(
    base: str, conversations: list[Conversation], clients: int, max_tokens: int = 8
) -> list[Conversation]:
    """Each conversation's turns in order, ``clients`` conversations at a time."""

    def one(conv: Conversation) -> Conversation:
        messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}]
        for question in conv.questions:
            messages.append({"role": "user", "content": question})
            conv.turns.append(chat_turn(base, conv, messages, max_tokens))
        return conv

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, conversations))


def summarize(conversations: list[Conversation], router_state: dict[str, Any]) -> dict[str, Any]:
    turns = [t for c in conversations for t in c.turns]
    ok = [t for t in turns if t.status == 200]
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    moved, followed = [], 0
    for c in conversations:
        for prev, cur in zip(c.turns, c.turns[1:], strict=False):
            if cur.replica == prev.replica:
                followed += 1
            else:
                moved.append((c.index, cur.turn, prev.replica, cur.replica))
    per_replica: dict[str, int] = {}
    for t in ok:
        per_replica[t.replica or "?"] = per_replica.get(t.replica or "?", 0) + 1
    return {
        "requests": len(turns),
        "ok": len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "later_turns_followed": followed,
        "later_turns_moved": moved,
        "overloads": router_state.get("overloads", []),
        "per_replica": per_replica,
        "counts": router_state.get("counts", {}),
        "digest_age_s": router_state.get("digest_age_s"),
        "warnings": router_state.get("warnings", []),
    }


def wait_digests(base: str, replicas: int, timeout_s: float = 60) -> dict[str, Any]:
    """Wait until the router holds a digest of every replica (after a first request)."""
    deadline = time.monotonic() + timeout_s
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = get_json(f"{base}/v1/hybrid/cluster")
        if len(state.get("digests", {})) >= replicas:
            return state
        post(f"{base}/v1/completions", {"model": "tiny", "prompt": "warm up", "max_tokens": 1})
        time.sleep(0.5)
    return state
