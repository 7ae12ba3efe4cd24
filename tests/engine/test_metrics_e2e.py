"""Hybrid cache metrics through vLLM's own stats path, on a tiny Zamba2.

In-process engine: the totals that reach a stat logger (``SchedulerStats.vllm_hybrid``) equal
the pool's counters, the exported Prometheus samples equal those totals, and vLLM's own
``prefix_cache_*`` stats and each request's ``num_cached_tokens`` agree with our hit tokens.
And a real ``vllm serve`` (engine core in its own process, so the totals cross vLLM's msgpack
transport) whose ``/metrics`` shows ``vllm_hybrid:`` lines that agree with
``vllm:prefix_cache_*``; ~30 s on the 2-core build machine, so not marked slow.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest

from tests.engine.conftest import engine, greedy
from tests.engine.test_hybrid_scheduler import SMALL_POOL, scheduler_of, workload
from vllm_hybrid.adapters.vllm import metrics
from vllm_hybrid.core.cache_stats import METRICS, PREFIX
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine


class VllmPrefixStats:
    """A stat logger that sums vLLM's own prefix cache stats (``PrefixCacheStats``)."""

    def __init__(self) -> None:
        self.queries = self.hits = self.preempted = 0

    def record(self, scheduler_stats: Any, *args: Any, **kwargs: Any) -> None:
        if scheduler_stats is not None:
            s = scheduler_stats.prefix_cache_stats
            self.queries += s.queries
            self.hits += s.hits
            self.preempted += s.preempted_requests

    def log(self) -> None:
        """Nothing to print: the test reads the sums."""


def exported(name: str, model: str) -> float | None:
    return REGISTRY.get_sample_value(PREFIX + name, {"model_name": model, "engine": "0"})


def test_stats_path_matches_the_pool_and_vllms_counters(model_root, monkeypatch):
    monkeypatch.setenv("VLLM_HYBRID_DEBUG", "1")  # also checks the page counts against the mirror
    model_dir = tiny_model_dir("zamba2", model_root)
    with engine(
        model_dir, enable_prefix_caching=True, disable_log_stats=False, **SMALL_POOL
    ) as llm:
        sched = scheduler_of(llm)
        pool = sched.hybrid_pool
        assert pool is not None, "the plugin selects our scheduler for a hybrid"
        if not pool.hybrid.block_bytes:  # until activate() sets it
            pool.hybrid.block_bytes = metrics.block_bytes(sched.kv_cache_config)
        groups = sched.kv_cache_config.kv_cache_groups
        pages = {g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups}
        assert pages == {pool.hybrid.block_bytes}  # one page size: what a block id holds
        exporter = metrics.HybridStatLogger(llm.llm_engine.vllm_config)
        vllm_side = VllmPrefixStats()
        llm.llm_engine.logger_manager.stat_loggers += [exporter, vllm_side]
        outs = [o for wave in workload(seed=3) for o in greedy(llm, wave, max_tokens=6)]

        totals = exporter.last[0]
        assert totals == metrics.hybrid_totals(pool)
        counters = pool.hybrid.feed.counters
        assert totals["requests"] == counters.requests == len(outs)
        assert totals["hit_tokens"] == counters.hit_tokens > 0
        assert totals["snapshot_hits"] + totals["snapshot_misses"] == len(outs)
        assert totals["policy_evicted_pages"] == pool.hybrid.policy_pages > 0
        assert 0 < totals["prefill_flops_saved"] < totals["prefill_flops"]
        assert totals["kv_pages_evicted"] > 0
        assert totals["kv_bytes"] == totals["kv_pages"] * pool.hybrid.block_bytes > 0
        for spec in METRICS:
            suffix = "_total" if spec.kind == "counter" else ""
            got = exported(spec.key + suffix, llm.llm_engine.model_config.served_model_name)
            assert got == totals[spec.key], spec.key

        # vLLM's own numbers agree with ours (no preemption in this workload)
        assert vllm_side.preempted == 0
        assert vllm_side.queries == totals["prompt_tokens"]
        assert vllm_side.hits == totals["hit_tokens"]
        assert sum(o.num_cached_tokens for o in outs) == totals["hit_tokens"]
        assert totals["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
        lines = generate_latest(REGISTRY).decode().splitlines()
        print("\n".join(x for x in lines if x.startswith(PREFIX)), file=sys.stderr)  # docs example


# ------------------------------------------------------------------------- the OpenAI server
STAT_LOGGER_GROUP = "vllm.stat_logger_plugins"


def shim_entry_points(root: Path) -> Path:
    """A metadata-only distribution declaring our stat logger and the transport patch, for a
    checkout whose installed metadata predates them (pyproject.toml declares them)."""
    info = root / "vllm_hybrid_metrics_shim-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-hybrid-metrics-shim\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(
        f"[{STAT_LOGGER_GROUP}]\n"
        "vllm_hybrid = vllm_hybrid.adapters.vllm.metrics:HybridStatLogger\n"
        "[vllm.general_plugins]\n"
        "vllm_hybrid_metrics = vllm_hybrid.adapters.vllm.metrics:carry_hybrid_stats\n"
    )
    return root


def scrape(url: str) -> tuple[dict[str, float], str]:
    """(metric name -> value summed over labels, the raw ``/metrics`` text)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            labelled, _, value = line.rpartition(" ")
            name = labelled.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out, text


def test_openai_server_exports_hybrid_metrics(model_root, tmp_path, monkeypatch):
    import openai

    from vllm_hybrid.demo import SYSTEM_PROMPT, free_port, start_server, stop_server, wait_ready

    if not any(ep.name == "vllm_hybrid" for ep in entry_points(group=STAT_LOGGER_GROUP)):
        path = [str(shim_entry_points(tmp_path / "shim")), os.environ.get("PYTHONPATH", "")]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    port, log = free_port(), tmp_path / "server.log"
    proc = start_server(tiny_model_dir("zamba2", model_root), port, log)
    try:
        wait_ready(proc, port, log)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        prompt = SYSTEM_PROMPT + "\nQuestion: where are the hoses?\nAnswer:"
        for _ in range(2):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        deadline, got, text = time.monotonic() + 30, {}, ""
        while time.monotonic() < deadline:
            got, text = scrape(url)
            if got.get(PREFIX + "requests_total") == 2:
                break
            time.sleep(0.5)
        assert got.get(PREFIX + "requests_total") == 2, log.read_text()[-3000:]
        assert got[PREFIX + "hit_tokens_total"] > 0
        assert got[PREFIX + "hit_tokens_total"] == got["vllm:prefix_cache_hits_total"]
        assert got[PREFIX + "prompt_tokens_total"] == got["vllm:prefix_cache_queries_total"]
        assert got[PREFIX + "snapshot_hits_total"] == 1
        assert got[PREFIX + "snapshot_pages"] >= 1
        ours = [line for line in text.splitlines() if PREFIX in line]
        print("\n".join(ours), file=sys.stderr)  # the example in docs/metrics.md
    finally:
        stop_server(proc)
