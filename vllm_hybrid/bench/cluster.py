"""``vllm-hybrid bench replay --replicas N --router R,...``: a live cluster against the cluster
simulation, one row per router.

For each router: a local Ray cluster runs the Serve app (``cluster/app.py``) with N replicas of
the model (our plugin, its default policy, the row's pool size), the workload is replayed over
HTTP against its ingress exactly as ``--url`` replays against one server (:mod:`.http`), then
the cluster is shut down. The ``sim hit`` column is the cluster simulation
(``sim/cluster.py::run_cluster``) of the same requests, N replicas, the same router, each
replica's pool and costs as its digest reports them (``adapters/vllm/config.py::pool_layout``)
and snapshots where the engine takes them (``core.EngineAdmission``). The router's time unit is
``--router-tflops`` in both. Requests per replica, live and simulated, are printed under the
table; the live count is the router's own record of the replay's requests (its decisions after
the warm-up ones).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vllm_hybrid.bench import BenchError
from vllm_hybrid.bench.report import RowResult
from vllm_hybrid.bench.workload import BenchRequest

#: The routers a live cluster row runs when ``--router`` is not given.
DEFAULT_ROUTERS = "state,text-prefix,round-robin"


def parse_routers(text: str) -> list[str]:
    """The ``--router`` list, checked (unknown names: BenchError naming the known ones)."""
    from vllm_hybrid.sim.routers import check_routers

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BenchError("--router needs at least one router name")
    try:
        check_routers(names)
    except ValueError as error:
        raise BenchError(f"--router: {error}") from None
    return names


def check_cluster_args(args: argparse.Namespace) -> list[str]:
    """The routers, after the flags that do not go with ``--replicas`` were refused."""
    from vllm_hybrid.cluster import ray_api

    if args.replicas < 1:
        raise BenchError(f"--replicas must be >= 1, got {args.replicas}")
    if args.url:
        raise BenchError("--replicas starts its own cluster; it does not go with --url")
    if args.host_gb:
        raise BenchError("--host-gb is not available with --replicas (no host tier per replica)")
    if not args.router_tflops > 0:
        raise BenchError(f"--router-tflops must be > 0, got {args.router_tflops}")
    try:
        ray_api.require_ray()
    except ray_api.RayMissing as error:
        raise BenchError(str(error)) from None
    return parse_routers(args.router or DEFAULT_ROUTERS)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """vLLM flags of every replica (after ``cluster/live.py``'s ``TINY_FLAGS``)."""
    flags = ["--dtype", args.dtype, "--max-model-len", str(args.max_len)]
    flags += ["--max-num-seqs", str(args.max_num_seqs), "--seed", "0"]
    if args.blocks:
        flags += ["--num-gpu-blocks-override", str(args.blocks)]
    return flags


def _counts(records: list[dict[str, Any]], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r[key]] = out.get(r[key], 0) + 1
    return out


#: ``(total, label, enabled) -> tqdm bar`` (``replay.progress_bar``).
ProgressBar = Callable[[int, str, bool], Any]


def run_router_row(
    args: argparse.Namespace,
    reqs: list[BenchRequest],
    router: str,
    time_scale: float | None,
    progress_bar: ProgressBar,
) -> RowResult:
    """One router's live row: start the cluster, replay over HTTP, read the router's record."""
    from vllm_hybrid.bench.http import replay_http
    from vllm_hybrid.cluster.live import get_json, local_cluster, wait_digests

    with local_cluster(
        args.model,
        args.replicas,
        router,
        engine_flags(args),
        log_to_driver=False,  # the table goes to stdout; Ray's logs stay in its session dir
        throughput_tflops=args.router_tflops,
    ) as base:
        state = wait_digests(base, args.replicas)
        if len(state.get("digests", {})) < args.replicas:
            raise BenchError(f"router {router}: not every replica reported a digest in 60 s")
        row_args = argparse.Namespace(**{**vars(args), "url": base, "label": router})
        bar = progress_bar(len(reqs), router, not args.no_progress)
        with bar:
            row = replay_http(row_args, reqs, time_scale, bar)
        state = get_json(f"{base}/v1/hybrid/cluster")
    records = state.get("records", [])[-len(reqs) :]  # the replay's, after any warm-up
    layouts = [d.get("layout") for d in state.get("digests", {}).values()]
    row.layout = next((x for x in layouts if x), None)
    row.blocks = None if row.layout is None else row.layout["blocks"]
    row.cluster = {
        "router": router,
        "replicas": args.replicas,
        "per_replica": sorted(_counts(records, "replica").values(), reverse=True),
        "decisions": _counts(records, "reason"),
        "overloads": len(state.get("overloads", [])),
        "digest_age_s": state.get("digest_age_s"),
    }
    return row


def run_cluster_rows(
    args: argparse.Namespace,
    reqs: list[BenchRequest],
    routers: list[str],
    time_scale: float | None,
    progress_bar: ProgressBar,
) -> list[RowResult]:
    """One live row per router (``check_cluster_args``'s list), in order; ``time_scale`` None
    (--rate auto): the first row sets the pace and the others reuse it."""
    rows = []
    for router in routers:
        rows.append(run_router_row(args, reqs, router, time_scale, progress_bar))
        time_scale = rows[-1].time_scale
    return rows


def add_cluster_predictions(
    rows: list[RowResult], reqs: list[BenchRequest], replicas: int, router_tflops: float
) -> None:
    """Each row's cluster simulation (module docstring): ``sim_hit_rate`` and, in
    ``row.cluster``, the simulated requests per replica and decisions."""
    from vllm_hybrid.bench.policies import OURS_DEFAULT
    from vllm_hybrid.bench.predict import PoolLayout, sim_requests
    from vllm_hybrid.sim.cluster import ClusterConfig, run_cluster
    from vllm_hybrid.sim.trace import KeyedRequest

    for row in rows:
        if row.layout is None or row.cluster is None:
            continue
        layout = PoolLayout.from_json(row.layout)
        cost = layout.cost_model()
        scaled = [replace(r, arrival_s=r.arrival_s * row.time_scale) for r in reqs]
        keyed = [
            KeyedRequest(r, layout.block_tokens) for r in sim_requests(scaled, layout.block_tokens)
        ]
        cfg = ClusterConfig(
            replicas,
            layout.cache_bytes(),
            OURS_DEFAULT,
            throughput_flops=router_tflops * 1e12,
            engine_admission=True,
        )
        stats, _, _ = run_cluster(keyed, cost, cfg, row.cluster["router"])
        row.sim_hit_rate = stats.token_hit_rate
        row.cluster["sim_per_replica"] = sorted(stats.requests_per_replica, reverse=True)
        row.cluster["sim_decisions"] = stats.decisions


def replicas_line(rows: list[RowResult]) -> str:
    """Requests per replica, live / simulated, per router row; empty without cluster rows."""
    parts = [
        f"{r.policy} {r.cluster['per_replica']} / {r.cluster.get('sim_per_replica', '-')}"
        for r in rows
        if r.cluster is not None
    ]
    return "requests per replica, live / sim: " + ", ".join(parts) if parts else ""
