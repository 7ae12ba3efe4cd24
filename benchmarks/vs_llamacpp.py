"""Side by side with llama.cpp on CPU: prompt tokens served from cache, turn by turn.

The same random weights (a ``vllm_hybrid.testing`` model, Falcon-H1 by default) are served by
llama.cpp's ``llama-server`` (built by ``scripts/install_llamacpp.sh`` from the sources vendored
in llama-cpp-python 0.3.36; its defaults: slots, context checkpoints, ``--cache-ram``) and by
``vllm-hybrid serve`` (our defaults). Both get the same token ids, so no chat template or
re-tokenization stands between them: each turn's prompt is the previous prompt, the previous
answer as generated, and a new message. Three scenarios, each on fresh servers:

* ``chat``: one conversation, 5 turns;
* ``interleaved``: 4 conversations sharing a system prompt, 3 turns, taken in turn;
* ``document``: 6 questions over one long document.

Per turn: prompt tokens, tokens served from cache (llama-server: ``timings.cache_n``; ours:
``usage.prompt_tokens_details.cached_tokens``), and the time to the first streamed token with
the cache and without it (llama-server: ``cache_prompt: false``; ours: a fresh ``cache_salt``,
which shares no cached block). Greedy outputs with the cache are compared with those without it,
per server. Absolute speeds differ (GGUF kernels against vLLM's CPU backend): compare reuse and
the cached/uncached TTFT ratio. Writes JSON (``--json``) and prints tables::

    bash scripts/install_llamacpp.sh
    .venv/bin/python benchmarks/vs_llamacpp.py --json out/vs_llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_hybrid.core import common_prefix_tokens  # noqa: E402
from vllm_hybrid.demo import stop_server  # noqa: E402

LLAMA = ROOT / ".llama" / "llama.cpp"
SCENARIOS = ("chat", "interleaved", "document")


@dataclass
class Turn:
    scenario: str
    conversation: int
    turn: int
    prompt: int
    cached: int
    ttft_s: float
    uncached_ttft_s: float
    same_output: bool
    resumable: int  # longest common prefix with an earlier prompt + answer, at most prompt - 1


@dataclass
class Result:
    server: str
    turns: list[Turn] = field(default_factory=list)

    def reuse(self, scenario: str) -> float:
        """Share of prompt tokens served from cache after each scenario's first request."""
        rows = [t for t in self.turns if t.scenario == scenario][1:]
        return sum(t.cached for t in rows) / max(sum(t.prompt for t in rows), 1)


# ------------------------------------------------------------------------------ workloads
def scenario_plan(name: str, seed: int, vocab: int) -> list[tuple[int, list[int]]]:
    """(conversation, new tokens) per request, in order; a request's prompt is its
    conversation so far (earlier prompts and answers) plus the new tokens."""
    rng = random.Random(f"{name}-{seed}")

    def draw(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    if name == "chat":
        return [(0, draw(1770 if t == 0 else 60)) for t in range(5)]
    if name == "interleaved":
        system = draw(1770)
        return [(c, (system if t == 0 else []) + draw(60)) for t in range(3) for c in range(4)]
    if name == "document":
        document = draw(2000)
        return [(q, document + draw(40)) for q in range(6)]
    raise ValueError(f"unknown scenario {name!r}; valid: {', '.join(SCENARIOS)}")


# ------------------------------------------------------------------------------ clients
def _sse(url: str, body: dict[str, Any], timeout: float = 600) -> Iterator[dict[str, Any]]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data = line[5:].strip()
                if data and data != "[DONE]":
                    yield json.loads(data)


def ask_llama(port: int, prompt: list[int], tokens: int, cache: bool) -> tuple[int, float, list]:
    """(cached tokens, seconds to the first token, output ids) from llama-server."""
    body = {
        "prompt": prompt,
        "n_predict": tokens,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "stream": True,
        "cache_prompt": cache,
        "return_tokens": True,
    }
    start, first, out, cached = time.perf_counter(), None, [], 0
    for chunk in _sse(f"http://127.0.0.1:{port}/completion", body):
        if chunk.get("tokens") and first is None:
            first = time.perf_counter() - start
        out += chunk.get("tokens") or []
        if "timings" in chunk:
            cached = int(chunk["timings"].get("cache_n", 0))
    return cached, first if first is not None else float("nan"), out


def ask_ours(port: int, prompt: list[int], tokens: int, cache: bool) -> tuple[int, float, list]:
    """(cached tokens, seconds to the first token, output ids) from vllm-hybrid serve."""
    body: dict[str, Any] = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if not cache:
        body["cache_salt"] = uuid.uuid4().hex
    start, first, out, cached = time.perf_counter(), None, [], 0
    for chunk in _sse(f"http://127.0.0.1:{port}/v1/completions", body):
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter() - start
            out += ids
        usage = chunk.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or cached)
    return cached, first if first is not None else float("nan"), out


def run_scenario(name: str, server: str, port: int, args: argparse.Namespace) -> list[Turn]:
    ask = ask_llama if server == "llama-server" else ask_ours
    history: dict[int, list[int]] = {}
    seen: list[list[int]] = []
    turns: list[Turn] = []
    counts: dict[int, int] = {}
    for conversation, new in scenario_plan(name, args.seed, args.vocab):
        prompt = history.get(conversation, []) + new
        cached, ttft, out = ask(port, prompt, args.tokens, True)
        _, cold_ttft, cold = ask(port, prompt, args.tokens, False)
        lcp = max((common_prefix_tokens(prompt, s) for s in seen), default=0)
        counts[conversation] = counts.get(conversation, 0) + 1
        turns.append(
            Turn(
                name,
                conversation,
                counts[conversation],
                len(prompt),
                cached,
                ttft,
                cold_ttft,
                out == cold,
                min(lcp, len(prompt) - 1),
            )
        )
        seen.append(prompt + out)
        if name != "document":
            history[conversation] = prompt + out
    return turns


# ------------------------------------------------------------------------------ servers
def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); log: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"no answer from {url} after {timeout_s}s; see {log}")


def start_server(server: str, model_dir: Path, gguf: Path, port: int, out: Path) -> Any:
    log = out / f"{server}-{port}.log"
    env = dict(os.environ)
    if server == "llama-server":
        # Its defaults but the context: 4 slots of 8,192 tokens (the model's length), unified.
        cmd = [str(LLAMA / "build" / "bin" / "llama-server"), "-m", str(gguf), "--port", str(port)]
        cmd += ["--host", "127.0.0.1", "-c", "32768", "-t", str(os.cpu_count() or 2)]
        health = f"http://127.0.0.1:{port}/health"
        libs = str(LLAMA / "build" / "bin")  # its shared libraries sit beside it
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libs, env.get("LD_LIBRARY_PATH")]))
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        cmd = [sys.executable, "-m", "vllm_hybrid.cli", "serve", str(model_dir)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m"]
        cmd += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "8192"]
        cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
        health = f"http://127.0.0.1:{port}/health"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    wait_http(health, proc, log)
    return proc


def convert(model_dir: Path, gguf: Path) -> None:
    """The vendored converter (``convert_hf_to_gguf.py``, f32). Our locally trained tokenizer's
    pre-tokenizer is none the converter knows by its hash; the requests here are token ids, so
    llama.cpp's ``default`` pre-tokenizer is declared instead (one patched method, here)."""
    code = (
        "import sys, conversion.base as b\n"
        "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'\n"
        "import convert_hf_to_gguf as c\n"
        f"sys.argv = ['convert', {str(model_dir)!r}, '--outtype', 'f32', '--outfile', "
        f"{str(gguf)!r}]\n"
        "c.main()\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{LLAMA}:{LLAMA / 'gguf-py'}")
    subprocess.run([sys.executable, "-c", code], cwd=LLAMA, env=env, check=True)


# ------------------------------------------------------------------------------ report
def print_tables(results: list[Result]) -> None:
    by = {r.server: r for r in results}
    for name in SCENARIOS:
        per = [[t for t in r.turns if t.scenario == name] for r in results]
        if not per or not per[0]:
            continue
        print(
            f"\n{name}: per request (conversation.turn): prompt tokens; per server: resumable "
            "(longest common prefix with an earlier prompt + answer, at most prompt - 1), "
            "cached, TTFT with the cache and without (ms), output with == without"
        )
        head = f"{'req':>6} {'prompt':>7}"
        for r in results:
            head += f" | {r.server:>12} resumable cached  ttft  cold  same"
        print(head)
        for i, first in enumerate(per[0]):
            line = f"{first.conversation}.{first.turn:<4} {first.prompt:>7}"
            for turns in per:
                t = turns[i]
                line += (
                    f" | {'':>12} {t.resumable:>9} {t.cached:>6} {t.ttft_s * 1000:>5.0f} "
                    f"{t.uncached_ttft_s * 1000:>5.0f} {'yes' if t.same_output else 'NO':>5}"
                )
            print(line)
        print(
            "reuse after the first request: "
            + ", ".join(f"{server} {by[server].reuse(name):.1%}" for server in by)
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", default="falcon_h1")
    p.add_argument("--size", default="small", choices=("tiny", "small"))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--servers", default="llama-server,ours")
    p.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4000, help="token ids drawn below this")
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--out", default="out/vs_llamacpp")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    scenarios = args.scenarios.split(",")
    servers = args.servers.split(",")
    bad = [s for s in scenarios if s not in SCENARIOS]
    bad += [s for s in servers if s not in ("llama-server", "ours")]
    if bad:
        p.error(
            f"unknown scenario or server {bad}; scenarios: {', '.join(SCENARIOS)}; "
            "servers: llama-server, ours"
        )
    if "llama-server" in servers and not (LLAMA / "build" / "bin" / "llama-server").exists():
        p.error("llama-server is not built: run bash scripts/install_llamacpp.sh first")
    from vllm_hybrid.testing.make_model import build_model

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(
        build_model(args.arch, ROOT / "models" / f"{args.size}-{args.arch}", args.size)
    )
    gguf = out / f"{args.arch}-{args.size}-f32.gguf"
    if "llama-server" in servers and not gguf.exists():
        convert(model_dir, gguf)
    results = [Result(server) for server in servers]
    for name in scenarios:
        for result in results:
            proc = start_server(result.server, model_dir, gguf, args.port, out)
            try:
                result.turns += run_scenario(name, result.server, args.port, args)
            finally:
                stop_server(proc)
    print_tables(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": [asdict(r) for r in results]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
