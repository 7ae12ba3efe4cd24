"""One policy row against an in-process vLLM engine, run as its own process.

``python -m vllm_hybrid.bench.offline SPEC.json OUT.json``: the parent (:mod:`.replay`) writes
the spec (policy, model, engine limits, the requests) and reads the result; progress goes to
stdout as ``@@progress DONE`` lines, everything vLLM prints goes along with it. One process per
row, so engines never share a process, threads or caches.

The replay drives ``LLMEngine`` directly: a request is added once its scaled arrival time has
passed, ``step()`` runs while anything is unfinished, and the wall time of the first output
token is recorded per request. TTFT therefore includes queueing behind the step in flight.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from vllm_hybrid.bench.policies import engine_setup
from vllm_hybrid.bench.report import RequestRecord, RowResult
from vllm_hybrid.bench.workload import BenchRequest, warmup_requests

PROGRESS = "@@progress "
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def start_engine(spec: dict[str, Any]) -> Any:
    """A fresh ``vllm.LLM`` for ``spec['policy']`` (imports vLLM; env must be set before)."""
    import vllm

    setup = engine_setup(spec["policy"], spec.get("host_gb", 0.0))
    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "dtype": spec.get("dtype", "float32"),
        "enforce_eager": True,
        "max_model_len": spec["max_len"],
        "max_num_seqs": spec["max_num_seqs"],
        "seed": 0,
        **setup.engine_kwargs,
    }
    if spec.get("blocks"):
        kwargs["num_gpu_blocks_override"] = spec["blocks"]
    return vllm.LLM(**kwargs)


def pool_blocks(llm: Any) -> int | None:
    """Blocks in the engine's KV pool (the memory budget every row shares)."""
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    return int(blocks) if blocks else None


def pool_layout(llm: Any) -> dict[str, Any] | None:
    """The engine's pool for the simulator (``predict.PoolLayout``; ``adapters/vllm/config.py::
    pool_layout``)."""
    from vllm_hybrid.adapters.vllm.config import pool_layout as engine_pool_layout

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return engine_pool_layout(scheduler, llm.llm_engine.vllm_config.model_config.hf_config)


def evictions(llm: Any) -> dict[str, int]:
    """HybridBlockPool's eviction counters (empty for vLLM's own pool)."""
    try:
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    except AttributeError:
        return {}
    state = getattr(pool, "hybrid", None)  # adapters/vllm/state.py::HybridState
    if state is None:
        return {}
    out = {"policy_pages": state.policy_pages, "fallback_pages": state.fallback_pages}
    host = state.host
    if host is not None:  # the host tier (core/host_ledger.py): the /metrics counters
        from vllm_hybrid.adapters.vllm.metrics import host_totals

        out.update({k: int(v) for k, v in host_totals(host).items()})
        out["host_slots"] = host.tier.num_slots
    return out


def _greedy(max_tokens: int) -> Any:
    import vllm

    return vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _submit(engine: Any, request_id: str, ids: list[int], max_tokens: int) -> str:
    """Add the request; returns the engine's own id for it (vLLM 0.32 suffixes ours)."""
    return str(engine.add_request(request_id, {"prompt_token_ids": ids}, _greedy(max_tokens)))


def _run_one(engine: Any, request_id: str, ids: list[int], max_tokens: int) -> None:
    _submit(engine, request_id, ids, max_tokens)
    while engine.has_unfinished_requests():
        engine.step()


def warm_up(llm: Any, spec: dict[str, Any]) -> float:
    """Run ``spec['warmup']`` uncached requests of the workload's median size one at a time,
    then clear the prefix cache (``workload.warmup_requests``: the simulator's prediction
    replays the same ones). Returns the seconds the last one took (a machine's pace)."""
    reqs = [BenchRequest(r[0], r[3], tuple(r[1]), r[2]) for r in spec["requests"]]
    seconds = 0.0
    for warm in warmup_requests(reqs, spec["warmup"]):
        start = time.perf_counter()
        _run_one(
            llm.llm_engine, f"warmup-{warm.index}", list(warm.prompt_token_ids), warm.max_tokens
        )
        seconds = time.perf_counter() - start
    llm.llm_engine.reset_prefix_cache()
    return seconds


def replay(engine: Any, requests: list[list[Any]], arrivals: list[float]) -> RowResult:
    """Submit each request at its arrival time, step the engine, measure every request."""
    order = deque(sorted(range(len(requests)), key=lambda i: arrivals[i]))
    first: dict[str, float] = {}
    records: list[RequestRecord] = []
    running_at_start: dict[str, int] = {}  # by the engine's request id
    engine_id: dict[str, str] = {}  # our request id -> the engine's
    scheduler = engine.engine_core.engine_core.scheduler  # in-process (ENGINE_ENV)
    t0 = time.perf_counter()
    while order or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while order and arrivals[order[0]] <= now:
            i = order.popleft()
            engine_id[str(i)] = _submit(engine, str(i), requests[i][1], requests[i][2])
        if not engine.has_unfinished_requests():
            time.sleep(min(0.5, max(0.0, arrivals[order[0]] - now)))
            continue
        outputs = engine.step()
        running = [r.request_id for r in scheduler.running]
        for request_id in running:
            running_at_start.setdefault(request_id, len(running))
        for out in outputs:
            now = time.perf_counter() - t0
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                record = _record(out, arrivals, requests, first, now)
                record.running_at_start = running_at_start.get(engine_id[out.request_id])
                records.append(record)
                print(f"{PROGRESS}{len(records)}", flush=True)
    wall = time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return RowResult("", None, wall, 0.0, records)


def _record(
    out: Any, arrivals: list[float], requests: list[list[Any]], first: dict[str, float], now: float
) -> RequestRecord:
    i = int(out.request_id)
    arrival = arrivals[i]
    return RequestRecord(
        index=requests[i][0],
        arrival_s=arrival,
        prompt_tokens=len(requests[i][1]),
        cached_tokens=int(out.num_cached_tokens or 0),
        output_tokens=len(out.outputs[0].token_ids),
        ttft_s=first.get(out.request_id, now) - arrival,
        latency_s=now - arrival,
        output_token_ids=list(out.outputs[0].token_ids),
    )


def choose_time_scale(spec: dict[str, Any], seconds_per_request: float) -> float:
    """``spec['time_scale']`` if fixed, else the scale at which requests arrive at ``load``
    times the pace of one uncached request at a time (``--rate auto``; over the busiest
    ``load_window`` arrivals if set)."""
    from vllm_hybrid.bench.workload import BenchRequest, time_scale_for_rate

    if spec.get("time_scale") is not None:
        return float(spec["time_scale"])
    reqs = [BenchRequest(r[0], r[3], (), r[2]) for r in spec["requests"]]
    rate = spec["load"] / max(seconds_per_request, 1e-6)
    return time_scale_for_rate(reqs, rate, spec.get("load_window", 0))


def run_row(spec: dict[str, Any]) -> RowResult:
    """Start the engine, warm it up, replay, shut it down; the row's result."""
    llm = start_engine(spec)
    try:
        pace_s = warm_up(llm, spec)
        time_scale = choose_time_scale(spec, pace_s)
        arrivals = [r[3] * time_scale for r in spec["requests"]]
        print(f"{PROGRESS}0", flush=True)  # engine ready: the replay starts now
        row = replay(llm.llm_engine, spec["requests"], arrivals)
        row.policy, row.blocks, row.time_scale = spec["policy"], pool_blocks(llm), time_scale
        row.evictions = evictions(llm)
        row.layout = pool_layout(llm) if spec["policy"] != "off" else None
        return row
    finally:
        llm.llm_engine.engine_core.shutdown()


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    for key, value in ENGINE_ENV.items():
        if key == "VLLM_CPU_KVCACHE_SPACE":
            os.environ.setdefault(key, value)
        else:
            os.environ[key] = value
    row = run_row(spec)
    out_path.write_text(json.dumps(row.__dict__, default=lambda o: o.__dict__))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
