"""Per-request records, per-policy summaries, the side-by-side table and the JSON file.

What is measured, per request: ``ttft_s`` = wall time from the request's (scaled) arrival to
its first output token, ``latency_s`` = arrival to last token, ``cached_tokens`` = prompt tokens
the engine served from its prefix cache (vLLM's ``num_cached_tokens``). Per policy:

* token hit rate = sum(cached tokens) / sum(prompt tokens);
* prefill tokens computed = sum(prompt tokens) - sum(cached tokens);
* throughput = (prompt + output tokens) / wall seconds of the replay (first arrival to last
  token), and requests / wall seconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RequestRecord:
    """One replayed request as measured (times in seconds from the replay's start)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    output_token_ids: list[int]
    #: Requests running in the engine just after the step that first scheduled this one
    #: (itself included; offline rows only): the concurrency its cache lookup met.
    running_at_start: int | None = None


@dataclass
class RowResult:
    """One policy's replay: the engine's pool size, its wall time and every request.
    ``evictions``: blocks the core's policy evicted and blocks taken in vLLM's LRU order when it
    could not free enough (HybridScheduler rows only)."""

    policy: str
    blocks: int | None
    wall_s: float
    time_scale: float
    records: list[RequestRecord]
    evictions: dict[str, int] = field(default_factory=dict)
    #: The engine's pool as the cost model sees it (``predict.PoolLayout``), for the simulator.
    layout: dict[str, Any] | None = None
    #: The simulator's token hit rate for this row (filled in by the parent process), with
    #: ``sim_in_flight`` requests in flight (the engine's mean running count).
    sim_hit_rate: float | None = None
    sim_in_flight: int | None = None
    #: The simulator's token hit rate one request at a time with the whole pool.
    sim_hit_rate_1: float | None = None
    #: A live cluster row (``bench/cluster.py``): router, replicas, requests per replica live
    #: and simulated, the router's decisions.
    cluster: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RowResult:
        records = [RequestRecord(**r) for r in obj["records"]]
        head = (obj["policy"], obj["blocks"], obj["wall_s"], obj["time_scale"])
        return cls(
            *head,
            records,
            obj.get("evictions") or {},
            obj.get("layout"),
            obj.get("sim_hit_rate"),
            obj.get("sim_in_flight"),
            obj.get("sim_hit_rate_1"),
            obj.get("cluster"),
        )


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(row: RowResult) -> dict[str, Any]:
    """The summary numbers of one row (see the module docstring for their meaning)."""
    recs = row.records
    prompt = sum(r.prompt_tokens for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    output = sum(r.output_tokens for r in recs)
    ttft = [r.ttft_s for r in recs]
    wall = max(row.wall_s, 1e-9)
    return {
        "policy": row.policy,
        "blocks": row.blocks,
        "requests": len(recs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "prefill_tokens_computed": prompt - cached,
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p95_ms": 1000 * percentile(ttft, 95),
        "latency_p50_ms": 1000 * percentile([r.latency_s for r in recs], 50),
        "throughput_tok_s": (prompt + output) / wall,
        "requests_per_s": len(recs) / wall,
        "wall_s": row.wall_s,
        "time_scale": row.time_scale,
        "evictions": row.evictions,
        "sim_hit_rate": row.sim_hit_rate,
        "sim_in_flight": row.sim_in_flight,
        "sim_hit_rate_1": row.sim_hit_rate_1,
    }


def outputs_identical(rows: list[RowResult]) -> dict[str, Any]:
    """The oracle: greedy outputs must not depend on the cache. Compares every request's output
    token ids across rows; ``identical`` is None with fewer than two rows."""
    if len(rows) < 2:
        return {"identical": None, "compared": 0, "differing": []}
    by_row = [{r.index: r.output_token_ids for r in row.records} for row in rows]
    common = sorted(set.intersection(*(set(d) for d in by_row)))
    differing = [i for i in common if any(d[i] != by_row[0][i] for d in by_row[1:])]
    return {"identical": not differing, "compared": len(common), "differing": differing}


_COLUMNS = (
    ("policy", "{:<10}", "{:<10}"),
    ("blocks", "{:>6}", "{:>6}"),
    ("requests", "{:>8}", "{:>8}"),
    ("token_hit_rate", "{:>8}", "{:>8.3f}"),
    ("sim_hit_rate", "{:>8}", "{:>8.3f}"),
    ("prefill_tokens_computed", "{:>9}", "{:>9}"),
    ("ttft_p50_ms", "{:>11}", "{:>11.1f}"),
    ("ttft_p95_ms", "{:>11}", "{:>11.1f}"),
    ("throughput_tok_s", "{:>9}", "{:>9.0f}"),
    ("wall_s", "{:>7}", "{:>7.1f}"),
)
_HEADERS = ("policy", "blocks", "requests", "hit rate", "sim hit", "computed")
_HEADERS += ("TTFT p50 ms", "TTFT p95 ms", "tok/s", "wall s")


def format_table(summaries: list[dict[str, Any]]) -> str:
    """The side-by-side table, one row per policy."""
    head = " ".join(fmt.format(h) for (_, fmt, _), h in zip(_COLUMNS, _HEADERS, strict=True))
    lines = [head]
    for s in summaries:
        cells = [
            head_fmt.format("-") if s[k] is None else fmt.format(s[k])
            for k, head_fmt, fmt in _COLUMNS
        ]
        lines.append(" ".join(cells))
    return "\n".join(lines)


def ratio_line(summaries: list[dict[str, Any]], num: str = "ours", den: str = "stock") -> str:
    """``ours/stock`` for TTFT p50 and prefill tokens computed; empty if a row is missing."""
    rows = {s["policy"]: s for s in summaries}
    if num not in rows or den not in rows:
        return ""
    a, b = rows[num], rows[den]

    def ratio(key: str) -> str:
        return f"{a[key] / b[key]:.2f}x" if b[key] else "n/a"

    ttft, computed = ratio("ttft_p50_ms"), ratio("prefill_tokens_computed")
    return f"{num}/{den}: TTFT p50 {ttft}, prefill tokens computed {computed}"


def evictions_line(summaries: list[dict[str, Any]]) -> str:
    """Blocks evicted by the core's policy / taken in LRU order, for the rows that report it."""
    parts = [
        f"{s['policy']} {s['evictions']['policy_pages']}/{s['evictions']['fallback_pages']}"
        for s in summaries
        if {"policy_pages", "fallback_pages"} <= set(s.get("evictions") or {})
    ]
    return "blocks evicted by policy/LRU fallback: " + ", ".join(parts) if parts else ""


def host_line(summaries: list[dict[str, Any]]) -> str:
    """Host tier snapshots demoted / promoted (host hits) / slots, for the rows with one."""
    parts = [
        f"{s['policy']} {e['host_demotes']}/{e['host_promotes']}/{e['host_slots']}"
        for s in summaries
        if {"host_demotes", "host_promotes", "host_slots"} <= set(e := s.get("evictions") or {})
    ]
    return "host tier snapshots demoted/promoted/slots: " + ", ".join(parts) if parts else ""


def sim_line(summaries: list[dict[str, Any]]) -> str:
    """How the ``sim hit`` column was simulated: requests in flight per row, and the
    one-request-at-a-time prediction next to it; empty without predictions."""
    parts = [
        f"{s['policy']} {s['sim_in_flight']} in flight"
        + ("" if s.get("sim_hit_rate_1") is None else f" (one at a time {s['sim_hit_rate_1']:.3f})")
        for s in summaries
        if s.get("sim_in_flight") is not None
    ]
    return "sim hit simulated with: " + ", ".join(parts) if parts else ""


def oracle_line(oracle: dict[str, Any]) -> str:
    if oracle["identical"] is None:
        return ""
    if oracle["identical"]:
        return f"greedy outputs identical across policies: yes ({oracle['compared']} requests)"
    n = len(oracle["differing"])
    return f"greedy outputs identical across policies: NO ({n} of {oracle['compared']} differ)"


def write_json(
    path: str | Path,
    settings: dict[str, Any],
    rows: list[RowResult],
    summaries: list[dict[str, Any]],
    oracle: dict[str, Any],
) -> None:
    """Settings, summary rows, the oracle and every per-request record, as one JSON object."""
    obj = {
        "settings": settings,
        "summary": summaries,
        "outputs_identical": oracle,
        "rows": [asdict(r) for r in rows],
    }
    Path(path).write_text(json.dumps(obj, indent=1) + "\n")
