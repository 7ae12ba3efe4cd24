"""``vllm-hybrid serve MODEL --replicas N``: start (or join) Ray, run the app, block."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from vllm_hybrid.cluster import ray_api
from vllm_hybrid.cluster.app import ClusterUsageError, check_cluster_options, split_ingress_flags


def cluster_usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the cluster flags (before any model or Ray is touched), or None."""
    try:
        check_cluster_options(args.replicas, args.router or "state")
        ray_api.require_ray()
    except (ClusterUsageError, ray_api.RayMissing) as error:
        return str(error)
    if args.replica_gpus < 0:
        return f"--replica-gpus must be >= 0, got {args.replica_gpus}"
    if not args.router_tflops > 0:
        return f"--router-tflops must be > 0, got {args.router_tflops}"
    return None


def serve_cluster(args: argparse.Namespace, vllm_args: Sequence[str]) -> int:
    problem = cluster_usage_error(args)
    if problem:
        print(f"vllm-hybrid serve: {problem}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from vllm_hybrid.cluster.app import build_app

    flags, _ = split_ingress_flags(vllm_args)
    host, port = flags.get("--host", "0.0.0.0"), int(flags.get("--port", "8000"))
    ray.init(address=args.ray_address, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    app = build_app(
        args.model,
        vllm_args,
        replicas=args.replicas,
        router=args.router or "state",
        throughput_tflops=args.router_tflops,
        overload_wait_s=args.overload_wait_s,
        replica_gpus=args.replica_gpus,
    )
    serve.run(app, name="vllm-hybrid", route_prefix="/")
    print(
        f"vllm-hybrid: {args.replicas} replicas of {args.model} on Ray Serve, router "
        f"{args.router or 'state'}, http://{host}:{port}/v1",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0
