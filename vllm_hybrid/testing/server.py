"""Small HTTP helpers for tests and tools that talk to a running ``vllm-hybrid serve``.

Standard library only (``urllib``, ``json``, ``/proc``), so a soak client adds no dependency:
greedy completions that return token ids and the cached-token count, ``/metrics`` scraped into
numbers, and the resident memory of the server and its engine-core child.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Reply:
    """One answer: HTTP status, generated token ids, prompt tokens, cached prompt tokens."""

    status: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    body: str = ""  # the raw body of an error reply


def post(url: str, payload: Any, timeout: float = 300, raw: bytes | None = None) -> tuple[int, str]:
    """POST JSON (or ``raw`` bytes as JSON) to ``url``; returns (status, body) for any status."""
    data = raw if raw is not None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def greedy(
    base: str,
    *,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
    max_tokens: int = 16,
    salt: str | None = None,
    model: str = "tiny",
    timeout: float = 300,
    **extra: Any,
) -> Reply:
    """A greedy completion (``prompt``) or chat completion (``messages``) with token ids."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        **extra,
    }
    if salt is not None:
        body["cache_salt"] = salt
    if messages is not None:
        body["messages"] = messages
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    status, text = post(base + path, body, timeout)
    if status != 200:
        return Reply(status, body=text)
    out = json.loads(text)
    choice = out["choices"][0]
    usage = out.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    content = choice.get("text")
    if content is None:
        content = (choice.get("message") or {}).get("content") or ""
    return Reply(
        200,
        tuple(choice.get("token_ids") or ()),
        content,
        usage.get("prompt_tokens", 0),
        details.get("cached_tokens") or 0,
    )


def scrape(base: str, timeout: float = 10) -> dict[str, float]:
    """``/metrics`` as {name or name{labels}: value}; each name also summed over its labels."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        labelled, _, value = line.rpartition(" ")
        name = labelled.split("{")[0]
        out[name] = out.get(name, 0.0) + float(value)
        if "{" in labelled:
            out[labelled] = float(value)
    return out


def wait_metric(
    base: str, name: str, predicate: Any, timeout: float = 30, poll: float = 0.25
) -> dict[str, float]:
    """Scrape until ``predicate(value of name)`` holds; returns the last scrape (raises
    TimeoutError with the last value otherwise)."""
    deadline = time.monotonic() + timeout
    got: dict[str, float] = {}
    while time.monotonic() < deadline:
        got = scrape(base)
        if name in got and predicate(got[name]):
            return got
        time.sleep(poll)
    raise TimeoutError(f"{name} = {got.get(name)} after {timeout}s")


def children(pid: int) -> list[int]:
    """Every descendant process of ``pid`` (Linux ``/proc``)."""
    out: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            stack += kids
    return out


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (``VmRSS``), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def process_rss(pid: int) -> dict[str, int]:
    """RSS in KiB of ``pid`` and each of its descendants, by ``pid:name``."""
    out = {}
    for p in [pid, *children(pid)]:
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        out[f"{p}:{name}"] = rss_kib(p)
    return out
