"""Hybrid cache metrics without an engine: page counting on a hand-driven vLLM ``BlockPool``, the
eviction debug line, the totals surviving vLLM's msgpack transport, and the Prometheus export."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the cpu extra")

from prometheus_client import REGISTRY  # noqa: E402

from tests.adapters.test_scheduler_pool import KV, STATE, make_pool, request, run_request  # noqa: E402
from vllm_hybrid.adapters.vllm import metrics  # noqa: E402
from vllm_hybrid.core.cache_stats import KV as KIND_KV  # noqa: E402
from vllm_hybrid.core.cache_stats import (  # noqa: E402
    METRICS,
    PREFIX,
    SNAPSHOT,
    CounterDeltas,
    PageCounts,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def totals(pool) -> dict[str, float]:
    return metrics.hybrid_totals(pool)


def test_pages_cached_and_evicted_by_kind() -> None:
    pool = make_pool(n_blocks=12)
    a, b = request("a", 3), request("b", 3)
    run_request(pool, a, snap_at=3)  # 3 KV pages + 1 kept snapshot (2 transient state pages)
    pool.hybrid.mirror.tick()
    run_request(pool, b, snap_at=3)
    t = totals(pool)
    assert (t["kv_pages_cached"], t["snapshot_pages_cached"]) == (6, 2)
    assert (t["kv_pages"], t["snapshot_pages"]) == (6, 2)
    pool.get_new_blocks(4)  # one more than the uncached free blocks: a whole leaf goes
    pool.hy_check_integrity()  # includes hy_pages == the mirror's pages by kind
    t = totals(pool)
    assert t["policy_evicted_pages"] == t["kv_pages_evicted"] + t["snapshot_pages_evicted"] >= 2
    assert t["snapshot_pages_evicted"] == 1 and t["eviction_batches"] == 1
    assert t["kv_pages"] == t["kv_pages_cached"] - t["kv_pages_evicted"]
    assert t["lru_fallback_pages"] == 0


def test_move_keeps_counts_and_reset_evicts_everything() -> None:
    pool = make_pool(n_blocks=12)
    blocks = run_request(pool, request("a", 2), snap_at=2)
    fresh = pool.get_new_blocks(1)[0]
    pool.touch([blocks["state"]])  # a running request holds the snapshot
    pool.move_block_hashes(blocks["state"], fresh)  # copy-on-write: same pages held
    pool.hy_check_integrity()
    assert totals(pool)["snapshot_pages"] == 1 and totals(pool)["snapshot_pages_evicted"] == 0
    pool.free_blocks([blocks["state"], fresh])
    assert pool.reset_prefix_cache()
    pool.hy_check_integrity()
    t = totals(pool)
    assert (t["kv_pages"], t["snapshot_pages"]) == (0, 0)
    assert (t["kv_pages_evicted"], t["snapshot_pages_evicted"]) == (2, 1)


def test_bytes_gauges_use_the_pool_page_size() -> None:
    pool = make_pool(n_blocks=12)
    run_request(pool, request("a", 2), snap_at=2)
    assert totals(pool)["kv_bytes"] == 0  # page size unknown: bytes read 0
    # one aliased tensor per group, each bytes_per_block * num_blocks (vLLM 0.32.0)
    config = SimpleNamespace(
        kv_cache_tensors=[SimpleNamespace(size=12 * 8192), SimpleNamespace(size=12 * 8192)],
        num_blocks=12,
    )
    pool.hybrid.block_bytes = metrics.block_bytes(config)
    t = totals(pool)
    assert (t["kv_bytes"], t["snapshot_bytes"]) == (2 * 8192, 8192)


def test_one_debug_line_per_eviction_batch(caplog: pytest.LogCaptureFixture) -> None:
    pool = make_pool(n_blocks=12)
    run_request(pool, request("a", 3), snap_at=3)
    pool.hybrid.mirror.tick()
    run_request(pool, request("b", 3), snap_at=3)
    with caplog.at_level(logging.DEBUG, logger="vllm_hybrid"):
        pool.get_new_blocks(4)
    lines = [r.getMessage() for r in caplog.records if "eviction batch" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    got = re.search(r"(\d+) pages \(KV (\d+), snapshot (\d+)\)", lines[0])
    assert got is not None
    n, kv, snap = map(int, got.groups())
    t = totals(pool)
    assert (n, kv, snap) == (t["policy_evicted_pages"], t["kv_pages_evicted"], 1)
    assert "KV units 1" in lines[0] and "snapshot units 0" in lines[0]


def test_page_counts_reject_unknown_groups_and_check_integrity() -> None:
    counts = PageCounts([KV], [STATE])
    counts.on_cached(KV)
    counts.on_cached(STATE)
    counts.on_dropped(STATE)
    assert (counts.held(KIND_KV), counts.held(SNAPSHOT)) == (1, 0)
    counts.check_integrity()
    with pytest.raises(ValueError):
        counts.on_cached(7)
    counts.on_dropped(STATE)  # more dropped than cached breaks invariant 1
    with pytest.raises(AssertionError):
        counts.check_integrity()


def test_counter_deltas_per_engine_and_after_restart() -> None:
    deltas = CounterDeltas()
    assert deltas.update(0, {"hit_tokens": 10, "kv_pages": 5})["hit_tokens"] == 10
    assert "kv_pages" not in deltas.update(0, {"hit_tokens": 10})  # gauges are not counters
    assert deltas.update(0, {"hit_tokens": 25})["hit_tokens"] == 15
    assert deltas.update(1, {"hit_tokens": 3})["hit_tokens"] == 3  # another engine
    assert deltas.update(0, {"hit_tokens": 4})["hit_tokens"] == 4  # engine 0 restarted


def test_totals_survive_vllms_msgpack_transport() -> None:
    """Engine core -> frontend as ``vllm/v1/engine/core_client.py`` decodes it; the field must
    be declared before the decoder is built (the plugin does it at load time)."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    assert metrics.carry_hybrid_stats() and metrics.carry_hybrid_stats()  # idempotent
    pool = make_pool(n_blocks=12)
    run_request(pool, request("a", 3), snap_at=3)
    stats = SchedulerStats()
    assert metrics.hybrid_stats_of(stats) is None  # a stock engine's stats
    metrics.attach_hybrid_stats(pool, stats)
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    got = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats
    assert metrics.hybrid_stats_of(got) == totals(pool)
    plain = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=SchedulerStats()))
    assert metrics.hybrid_stats_of(MsgpackDecoder(EngineCoreOutputs).decode(plain)) is None


def sample(name: str, engine: str = "0") -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": "tiny", "engine": engine})


def test_stat_logger_exports_counters_and_gauges() -> None:
    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name="tiny"))
    exporter = metrics.HybridStatLogger(config, engine_indexes=[0, 1])
    pool = make_pool(n_blocks=12)
    run_request(pool, request("a", 3), snap_at=3)
    stats = SimpleNamespace()
    metrics.attach_hybrid_stats(pool, stats)
    exporter.record(stats, None, engine_idx=0)
    exporter.record(stats, None, engine_idx=0)  # the same totals again: no double count
    exporter.record(SimpleNamespace(), None, engine_idx=1)  # a stock engine: nothing
    assert sample(f"{PREFIX}kv_pages_cached_total") == 3
    assert sample(f"{PREFIX}snapshot_pages") == 1
    assert sample(f"{PREFIX}kv_pages_cached_total", engine="1") == 0
    metrics.HybridStatLogger(config)  # a second logger replaces the first's collectors
    assert sample(f"{PREFIX}kv_pages_cached_total") == 0
    assert sample(f"{PREFIX}kv_pages_cached_total", engine="1") is None


def test_docs_list_every_metric() -> None:
    text = DOCS.read_text()
    for spec in METRICS:
        name = PREFIX + spec.key + ("_total" if spec.kind == "counter" else "")
        assert f"`{name}`" in text, name
