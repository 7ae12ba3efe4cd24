"""The README demo: a tiny local hybrid model, served by vLLM with the plugin, and a chat.

Builds a random-weight tiny model (no download), starts ``vllm-hybrid serve`` on loopback,
holds a multi-turn conversation through the OpenAI client, then opens a second conversation
with the same system prompt, and prints the prompt tokens served from cache for every turn
(``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SYSTEM_PROMPT = (
    "You are a careful assistant for a hardware store. Answer questions about tools, paint, "
    "garden supplies and plumbing. Keep answers short, name the aisle where an item can be "
    "found, and suggest one related item. Aisle one holds hammers, saws and drills. Aisle two "
    "holds screws, nails, bolts and anchors. Aisle three holds paint, brushes, rollers and tape. "
    "Aisle four holds hoses, seeds, soil and pots. Aisle five holds pipes, valves and fittings. "
) * 3
QUESTIONS = [
    "Where can I find a cordless drill?",
    "And what screws should I use for a wooden shelf?",
    "Which paint works in a bathroom?",
    "Do you sell tomato seeds?",
    "What do I need to fix a leaking tap?",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(model_dir: Path, port: int, log_path: Path, *extra: str) -> subprocess.Popen:
    """Start ``vllm-hybrid serve`` on 127.0.0.1:port; its output goes to log_path."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    command = [
        sys.executable,
        "-m",
        "vllm_hybrid.cli",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "4096",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        *extra,
    ]
    log = open(log_path, "w")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(proc: subprocess.Popen, port: int, log_path: Path, timeout_s: float = 600) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text()[-3000:]
            raise RuntimeError(f"server exited with {proc.returncode}; log tail:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"server not ready after {timeout_s}s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def chat(
    client: Any, turns: list[str], seen: list[list[int]], max_tokens: int = 24
) -> list[tuple[int, int, int, float]]:
    """One conversation; returns (prompt tokens, cached tokens, exact resume, seconds) per
    turn. ``exact``: what a cache keeping every state could serve, the longest common prefix
    with an earlier prompt + its generated tokens (``seen``, from the server's
    ``return_token_ids``), at most the prompt minus its last token (always recomputed)."""
    from vllm_hybrid.core import common_prefix_tokens

    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    rows = []
    for question in turns:
        messages.append({"role": "user", "content": question})
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"return_token_ids": True},
        )
        elapsed = time.perf_counter() - start
        usage = reply.usage
        details = usage.prompt_tokens_details
        prompt_ids = list(getattr(reply, "prompt_token_ids", None) or [])
        output_ids = list(getattr(reply.choices[0], "token_ids", None) or [])
        lcp = max((common_prefix_tokens(prompt_ids, s) for s in seen), default=0)
        exact = min(lcp, usage.prompt_tokens - 1)
        seen.append(prompt_ids + output_ids)
        cached = details.cached_tokens if details else 0
        rows.append((usage.prompt_tokens, cached or 0, exact, elapsed))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return rows


def run_demo(arch: str = "zamba2", workdir: str = "models", port: int = 0) -> int:
    from openai import OpenAI

    from vllm_hybrid.testing.make_model import build_model

    model_dir = build_model(arch, Path(workdir) / f"tiny-{arch}", size="tiny")
    port = port or free_port()
    log_path = Path(workdir) / f"server-{arch}.log"
    print(f"[demo] serving {model_dir} on 127.0.0.1:{port} (log: {log_path})", flush=True)
    proc = start_server(model_dir, port, log_path)
    try:
        wait_ready(proc, port, log_path)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        print(
            f"{'conversation':>12} {'turn':>4} {'prompt':>7} {'cached':>7} {'exact':>7} "
            f"{'seconds':>8}"
        )
        seen: list[list[int]] = []
        for name, turns in (("first", QUESTIONS), ("second", QUESTIONS[2:4])):
            rows = chat(client, turns, seen)
            for turn, (prompt, cached, exact, secs) in enumerate(rows, start=1):
                print(
                    f"{name:>12} {turn:>4} {prompt:>7} {cached:>7} {exact:>7} {secs:>8.2f}",
                    flush=True,
                )
        print(
            "[demo] cached: prompt tokens served from cache; exact: the longest common prefix "
            "with an earlier prompt + answer (at most prompt - 1)"
        )
    finally:
        stop_server(proc)
    return 0
