"""Faults: a pool that runs out in the middle of a chunked prefill, and engine restarts.
Every test has an output oracle. (Clients that disconnect mid-stream are in
``test_serve_bad_input.py``, on its server.)

The mid-prefill test runs in-process (``LLM``) against caching off, on a pool so small that
blocks (KV and snapshots) are evicted, and requests preempted, between the prefill chunks of a
request; spies on the scheduler count that it happened. The hybrid cache runs with its
integrity checks after every scheduler step (``additional_config={"vllm_hybrid": {"debug":
true}}``; a violated invariant raises).

Restarts: in CI, a second engine started in the same process after the first (module state of
the plugin would survive there) starts with an empty cache, answers as before, then hits. Marked
slow (a second server start): ``vllm-hybrid serve`` stopped and started again does the same.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from pathlib import Path

import pytest

from tests.engine.conftest import engine, vllm
from vllm_hybrid.core.cache_stats import KV, SNAPSHOT
from vllm_hybrid.demo import SYSTEM_PROMPT, free_port, start_server, stop_server, wait_ready
from vllm_hybrid.testing.fixtures import tiny_model_dir
from vllm_hybrid.testing.server import greedy, scrape

pytestmark = pytest.mark.engine

DEBUG = json.dumps({"vllm_hybrid": {"debug": True}})
SERVER_FLAGS = ("--additional-config", DEBUG, "--max-num-batched-tokens", "256")


class Server:
    """One ``vllm-hybrid serve`` process that a test may restart."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir, self.log_dir, self.starts = model_dir, log_dir, 0
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> float:
        self.starts += 1
        self.log = self.log_dir / f"server-{self.starts}.log"
        began = time.monotonic()
        self.proc = start_server(self.model_dir, self.port, self.log, *SERVER_FLAGS)
        wait_ready(self.proc, self.port, self.log)
        return time.monotonic() - began

    def stop(self) -> None:
        stop_server(self.proc)

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            return False
        with urllib.request.urlopen(f"{self.base}/health", timeout=5) as response:
            return response.status == 200

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:]


@pytest.mark.slow  # a second server start (~20-40 s here); the in-process restart is in CI
def test_server_restart_rebuilds_the_cache_empty(model_root, tmp_path):
    server = Server(tiny_model_dir("zamba2", model_root), tmp_path)
    try:
        restart_checks(server)
    finally:
        server.stop()


def restart_checks(server: Server) -> None:
    prompts = [f"Shopper {i} asks. " + SYSTEM_PROMPT + "\nWhat is new?\nAnswer:" for i in (1, 2)]
    before = [greedy(server.base, prompt=p, max_tokens=16) for p in prompts]
    warm = [greedy(server.base, prompt=p, max_tokens=16) for p in prompts]
    assert all(r.cached_tokens > 0 for r in warm)  # cached before the restart

    server.stop()
    server.start()
    assert scrape(server.base).get("vllm:prefix_cache_hits_total", 0) == 0
    first = [greedy(server.base, prompt=p, max_tokens=16) for p in prompts]
    second = [greedy(server.base, prompt=p, max_tokens=16) for p in prompts]
    assert [r.cached_tokens for r in first] == [0, 0], "the cache must start empty"
    assert all(r.cached_tokens > 0 for r in second), "and fill again"
    assert [r.token_ids for r in first] == [r.token_ids for r in before]
    for i in range(2):  # one answer per prompt: before and after, cached or not
        assert len({r[i].token_ids for r in (before, warm, first, second)}) == 1
    assert server.alive(), server.log_tail()


# ------------------------------------------------------------------ out of room mid-prefill
TIGHT = {
    "num_gpu_blocks_override": 18,
    "max_model_len": 640,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 256,  # chunks of 1-2 blocks (align mode: whole blocks)
    # admit a request on its first chunk's blocks (vLLM's default reserves the whole prompt,
    # so only decode growth could run a prefill out of room)
    "scheduler_reserve_full_isl": False,
}


def tight_workload(seed: int = 11, vocab: int = 1000) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens): long prompts over two shared prefixes (so there is something
    cached to evict and to hit), 3-4 chunks each, every fourth decoding for longer (it holds
    its blocks while later requests prefill next to it); each prefix once more at the end,
    after the pool churned."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    prefixes = [draw(n) for n in (260, 300)]
    prompts = [rng.choice(prefixes) + draw(rng.randrange(100, 250)) for _ in range(6)]
    prompts += [p + draw(40) for p in prefixes]
    return [(p, 32 if i % 4 == 0 else 8) for i, p in enumerate(prompts)]


def run(llm, workload):
    params = [
        vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload
    ]
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


@pytest.fixture(scope="module")
def reference(model_root):
    """Greedy outputs of the tight workload with prefix caching off."""
    with engine(tiny_model_dir("zamba2", model_root), enable_prefix_caching=False, **TIGHT) as llm:
        return run(llm, tight_workload())[0]


def cached_engine(model_root):
    # integrity checks after every scheduler step; prompt-end states at P - 1 (off by default)
    # so that a repeat of a prompt shorter than a block hits
    config = {"vllm_hybrid": {"debug": True, "exact_prompt_end": True}}
    model_dir = tiny_model_dir("zamba2", model_root)
    return engine(model_dir, enable_prefix_caching=True, additional_config=config, **TIGHT)


def test_out_of_room_between_prefill_chunks(model_root, reference):
    prompts = tight_workload()
    with cached_engine(model_root) as llm:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        pool, kvm = sched.hybrid_pool, sched.kv_cache_manager
        assert pool is not None and pool.hybrid.debug
        assert not llm.llm_engine.vllm_config.scheduler_config.scheduler_reserve_full_isl
        seen = {"evictions": 0, "evictions mid-prefill": 0, "no room mid-prefill": 0}
        seen.update({"preemptions": 0, "preemptions mid-prefill": 0})

        def mid_prefill(request) -> bool:
            return 0 < request.num_computed_tokens < request.num_prompt_tokens

        allocate = kvm.allocate_slots

        def spy_allocate(request, *args, **kwargs):
            calls, mid = pool.hybrid.evict_calls, mid_prefill(request)
            out = allocate(request, *args, **kwargs)
            evicted = pool.hybrid.evict_calls > calls
            seen["evictions"] += evicted
            seen["evictions mid-prefill"] += evicted and mid
            seen["no room mid-prefill"] += out is None and mid
            return out

        preempt = sched._preempt_request

        def spy_preempt(request, *args, **kwargs):
            seen["preemptions"] += 1
            seen["preemptions mid-prefill"] += mid_prefill(request)
            return preempt(request, *args, **kwargs)

        kvm.allocate_slots, sched._preempt_request = spy_allocate, spy_preempt
        got, outs = run(llm, prompts)

        print(f"\nmid-prefill pressure: {seen}, pages evicted {pool.hybrid.pages.evicted}")
        assert got == reference
        assert seen["evictions mid-prefill"] > 0, seen  # a chunk's blocks came from evicting
        assert seen["no room mid-prefill"] > 0, seen  # and a chunk found no room at all
        assert seen["preemptions mid-prefill"] > 0, seen  # a half-prefilled request preempted
        assert pool.hybrid.pages.evicted[SNAPSHOT] > 0 and pool.hybrid.pages.evicted[KV] > 0
        assert sum(o.num_cached_tokens for o in outs) > 0  # and the cache still served hits
        assert sched.hybrid_checks > 50  # integrity held at every step


def test_engine_restart_in_process_rebuilds_the_cache_empty(model_root, reference):
    """Two engines one after the other in one process (so module state of the plugin would
    survive): the second starts with an empty cache, answers as before, then hits again."""
    workload = tight_workload()[-2:]  # two prompts on different prefixes
    expected = reference[-2:]
    hits = []
    for _ in range(2):  # start, serve twice, shut down; then again
        with cached_engine(model_root) as llm:
            for _ in range(2):
                got, outs = run(llm, workload)
                assert got == expected
                hits.append([o.num_cached_tokens for o in outs])
            assert llm.llm_engine.engine_core.engine_core.scheduler.hybrid_checks > 0
    assert hits[0] == hits[2] == [0, 0], f"each engine starts empty: {hits}"
    assert all(h > 0 for h in hits[1] + hits[3]), f"and fills: {hits}"


@pytest.mark.slow  # two server starts and half a minute of traffic: ~3-5 min on 2 cores
def test_short_soak(model_root, tmp_path):
    """``tools/soak.py`` for half a minute: no error, no mismatch with caching off."""
    import subprocess
    import sys

    tool = Path(__file__).resolve().parents[2] / "tools" / "soak.py"
    out = tmp_path / "soak.json"
    argv = ["--minutes", "0.5", "--clients", "3", "--sample-every", "5"]
    argv += ["--models", str(model_root), "--logs", str(tmp_path), "--json", str(out)]
    done = subprocess.run([sys.executable, str(tool), *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["requests"] > 10 and report["errors"] == report["mismatches"] == 0
    assert report["compared"] == report["ok"] == report["requests"]
    assert report["counters"]["vllm_hybrid:policy_evicted_pages_total"] > 0  # eviction ran
    assert report["cached_tokens"] > 0 and report["salted_requests"] > 0
