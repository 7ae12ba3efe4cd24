"""``vllm-hybrid bench replay``: replay a workload against each policy, print them side by side.

    vllm-hybrid bench replay --trace gen:chat --model DIR --policies stock,ours,off
    vllm-hybrid bench replay --trace PATH --url http://127.0.0.1:8000 --label flop
    vllm-hybrid bench replay --trace gen:chat --model DIR --replicas 2 --router state,round-robin

Offline (default): one fresh in-process engine per policy, each in its own subprocess
(:mod:`.offline`), all with the same pool size. HTTP (``--url``): one row against a running
OpenAI-compatible server (:mod:`.http`). Cluster (``--replicas N``): one local Ray Serve
cluster of N replicas per router, against the cluster simulation (:mod:`.cluster`). The table
goes to stdout, the progress bar to stderr, ``--json`` gets every per-request record. Bad
input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm_hybrid.bench import BenchError
from vllm_hybrid.bench.cluster import (
    add_cluster_predictions,
    check_cluster_args,
    replicas_line,
    run_cluster_rows,
)
from vllm_hybrid.bench.offline import PROGRESS
from vllm_hybrid.bench.policies import engine_setup, known_policies, parse_policies
from vllm_hybrid.bench.report import (
    RowResult,
    evictions_line,
    format_table,
    host_line,
    oracle_line,
    outputs_identical,
    ratio_line,
    sim_line,
    summarize,
    write_json,
)
from vllm_hybrid.bench.workload import (
    TOKEN_HI,
    BenchRequest,
    build_workload,
    iter_source,
    time_scale_for_rate,
)


class RowFailed(RuntimeError):
    """A policy's engine process failed; the message carries the tail of its log."""


def add_replay_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "replay",
        help="replay a trace against a live engine, policies side by side",
        description="Replay a trace or a generated workload against a live engine, one "
        "fresh engine per policy (or a running server with --url), and print token hit rate, "
        "prefill tokens computed, TTFT p50/p95 and throughput side by side.",
    )
    p.add_argument(
        "--trace", required=True, help="Mooncake JSONL PATH or gen:chat|docqa|agent|prefix"
    )
    p.add_argument("--model", help="model directory (offline mode; required without --url)")
    p.add_argument(
        "--policies", default="stock,ours", help=f"comma-separated: {', '.join(known_policies())}"
    )
    p.add_argument("--url", help="replay over HTTP against a running server (one row)")
    p.add_argument(
        "--replicas",
        type=int,
        help="a live local Ray Serve cluster of N replicas per router (needs the cluster "
        "extra), against the cluster simulation; rows are routers, not policies",
    )
    p.add_argument(
        "--router",
        help="with --replicas: comma-separated routers (default state,text-prefix,round-robin)",
    )
    p.add_argument(
        "--router-tflops",
        type=float,
        default=0.05,
        help="with --replicas: the prefill TFLOP/s one replica sustains, the router's time "
        "unit (live and simulated)",
    )
    p.add_argument("--label", default="server", help="row label with --url")
    p.add_argument("--served-model", help="model name on the server (default: its first)")
    p.add_argument("--requests", type=int, default=100, help="replay the first N that fit")
    p.add_argument(
        "--skip",
        type=int,
        default=0,
        help="start at the trace's request K (0-based; a later window of a long trace)",
    )
    p.add_argument("--scale", type=float, default=0.25, help="token-length multiplier")
    p.add_argument("--max-len", type=int, default=4096, help="engine max_model_len")
    p.add_argument("--max-tokens", type=int, help="output tokens (default: trace's, scaled)")
    timing = p.add_mutually_exclusive_group()
    timing.add_argument("--time-scale", type=float, help="multiply arrival times (0: all at once)")
    timing.add_argument(
        "--rate", default="auto", help="arrivals/s (mean; see --load-window), or auto (see --load)"
    )
    p.add_argument("--load", type=float, default=0.8, help="--rate auto: fraction of the pace")
    p.add_argument(
        "--load-window",
        type=int,
        default=0,
        help="--rate/--load hold for the busiest K consecutive arrivals (0: the mean over all)",
    )
    p.add_argument("--blocks", type=int, help="KV pool blocks for every row (default: vLLM's)")
    p.add_argument(
        "--host-gb",
        type=float,
        default=0.0,
        help="host tier size in GB for the rows named POLICY+host (e.g. ours+host)",
    )
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--warmup", type=int, default=2, help="uncached warm-up requests per row")
    p.add_argument("--seed", type=int, default=0, help="seed for gen: workloads")
    p.add_argument("--json", dest="json_out", help="write settings, summary and records here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def check_model_dir(model: str | None) -> str:
    """The model directory, checked to exist and to cover the workload's token ids."""
    if not model:
        raise BenchError("--model DIR is required without --url")
    path = Path(model).expanduser()
    if not path.is_dir():
        raise BenchError(f"model directory not found: {model}")
    config = path / "config.json"
    vocab = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
    if isinstance(vocab, int) and vocab < TOKEN_HI:
        raise BenchError(f"model vocabulary ({vocab}) is smaller than the {TOKEN_HI} ids used")
    return str(path.resolve())


def fixed_time_scale(args: argparse.Namespace, requests: list[BenchRequest]) -> float | None:
    """The arrival time factor from --time-scale / --rate R, or None for --rate auto."""
    if args.time_scale is not None:
        if args.time_scale < 0:
            raise BenchError(f"--time-scale must be >= 0, got {args.time_scale}")
        return float(args.time_scale)
    if str(args.rate) == "auto":
        if args.load <= 0:
            raise BenchError(f"--load must be positive, got {args.load}")
        if args.load_window < 0:
            raise BenchError(f"--load-window must be >= 0, got {args.load_window}")
        return None
    try:
        rate = float(args.rate)
    except ValueError:
        raise BenchError(f"--rate must be a number or auto, got {args.rate!r}") from None
    return time_scale_for_rate(requests, rate, args.load_window)


def load_workload(args: argparse.Namespace) -> list[BenchRequest]:
    if args.skip < 0:
        raise BenchError(f"--skip must be >= 0, got {args.skip}")
    source = itertools.islice(iter_source(args.trace, args.seed), args.skip, None)
    return build_workload(source, args.requests, args.scale, args.max_len, args.max_tokens)


def _row_spec(
    args: argparse.Namespace, policy: str, reqs: list[BenchRequest], scale: float | None
) -> dict[str, Any]:
    return {
        "policy": policy,
        "model": args.model,
        "dtype": args.dtype,
        "max_len": args.max_len,
        "max_num_seqs": args.max_num_seqs,
        "blocks": args.blocks,
        "host_gb": args.host_gb,
        "warmup": args.warmup,
        "time_scale": scale,
        "load": args.load,
        "load_window": args.load_window,
        "requests": [[r.index, list(r.prompt_token_ids), r.max_tokens, r.arrival_s] for r in reqs],
    }


def progress_bar(total: int, label: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{label:<8}", unit="req", file=sys.stderr, disable=not enabled)


def run_offline_row(spec: dict[str, Any], workdir: Path, show_progress: bool) -> RowResult:
    """Run one row in a fresh process (its output goes to ``workdir/<policy>.log``)."""
    name = spec["policy"]
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "vllm_hybrid.bench.offline", str(spec_path), str(out_path)]
    bar = progress_bar(len(spec["requests"]), name, show_progress)
    with log_path.open("w") as log, bar:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PROGRESS):
                done = int(line[len(PROGRESS) :])
                if done == 0:  # the engine is ready: time the replay, not the start-up
                    bar.reset()
                bar.update(done - bar.n)
            else:
                log.write(line)
        code = proc.wait()
    if code or not out_path.is_file():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-25:])
        raise RowFailed(f"policy {name}: engine process exited with {code}; its log ends:\n{tail}")
    return RowResult.from_json(json.loads(out_path.read_text()))


def run_offline(args: argparse.Namespace, reqs: list[BenchRequest]) -> list[RowResult]:
    """One row per policy, in order; with --rate auto the first row sets the arrival scale."""
    policies = parse_policies(args.policies)
    for policy in policies:
        engine_setup(policy, args.host_gb)  # a +host row without --host-gb: refused up front
    args.model = check_model_dir(args.model)
    scale = fixed_time_scale(args, reqs)
    rows: list[RowResult] = []
    with tempfile.TemporaryDirectory(prefix="vllm-hybrid-bench-") as tmp:
        for policy in policies:
            spec = _row_spec(args, policy, reqs, scale)
            rows.append(run_offline_row(spec, Path(tmp), not args.no_progress))
            scale = rows[-1].time_scale
    return rows


def add_predictions(
    rows: list[RowResult], reqs: list[BenchRequest], max_num_seqs: int | None, warmup: int = 0
) -> None:
    """Each row's simulator prediction on the same requests, pool and costs (``predict.py``),
    with as many requests in flight as the row's engine had on average (offline rows: running
    when each request was first scheduled, ``predict.engine_running``; rows over HTTP: in the
    engine at each arrival by the records' times, at most ``max_num_seqs``, None: a server's,
    vLLM's CPU default; then at most what the pool leaves room for, ``sim_in_flight``: the
    count stored is the one the simulator ran with), and one at a time; ``off`` predicts 0.
    ``warmup``: the warm-up requests each row's engine served before its cache was reset
    (offline rows; a server is not reset after its warm-up, so over HTTP it is 0)."""
    from vllm_hybrid.bench.policies import OFF, OURS, OURS_DEFAULT, base_policy
    from vllm_hybrid.bench.predict import (
        SERVER_MAX_NUM_SEQS,
        PoolLayout,
        engine_in_flight,
        engine_running,
        engine_waiting,
        predict_hit_rate,
        sim_in_flight,
    )

    cap = SERVER_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs
    for row in rows:
        if row.policy == OFF:
            row.sim_hit_rate = 0.0
        elif row.layout is not None:
            base = base_policy(row.policy)  # the simulator's prediction has no host tier
            name = OURS_DEFAULT if base == OURS else base
            layout = PoolLayout.from_json(row.layout)
            recs = row.records
            n = engine_running([r.running_at_start for r in recs])
            if n is None:  # a row over HTTP: from its arrivals and latencies
                n = engine_in_flight([r.arrival_s for r in recs], [r.latency_s for r in recs], cap)
            n = sim_in_flight(layout, n)  # what the simulator runs with, as printed
            row.sim_in_flight = n
            waiting = engine_waiting([r.arrival_s for r in recs], [r.ttft_s for r in recs])
            row.sim_hit_rate = predict_hit_rate(
                reqs, layout, name, n, warmup, waiting, max_num_seqs=cap
            )
            row.sim_hit_rate_1 = predict_hit_rate(
                reqs, layout, name, warmup=warmup, waiting=waiting, max_num_seqs=cap
            )


def run_http(args: argparse.Namespace, reqs: list[BenchRequest]) -> list[RowResult]:
    from vllm_hybrid.bench.http import replay_http

    bar = progress_bar(len(reqs), args.label, not args.no_progress)
    with bar:
        row = replay_http(args, reqs, fixed_time_scale(args, reqs), bar)
    return [row]


def _settings(args: argparse.Namespace, reqs: list[BenchRequest]) -> dict[str, Any]:
    keys: tuple[str, ...] = ("trace", "model", "url", "label", "policies", "requests", "skip")
    keys += ("scale", "max_len")
    keys += ("max_tokens", "time_scale", "rate", "load", "blocks", "max_num_seqs", "seed")
    keys += ("load_window",)
    keys += ("host_gb", "replicas", "router", "router_tflops")
    out = {k: getattr(args, k) for k in keys}
    out["workload_requests"] = len(reqs)
    out["workload_prompt_tokens"] = sum(r.prompt_tokens for r in reqs)
    return out


def print_report(args: argparse.Namespace, reqs: list[BenchRequest], rows: list[RowResult]) -> None:
    summaries = [summarize(r) for r in rows]
    oracle = outputs_identical(rows)
    mode = "auto" if args.time_scale is None and str(args.rate) == "auto" else "fixed"
    scale = rows[0].time_scale
    print(
        f"{args.trace}: {len(reqs)} requests, {sum(r.prompt_tokens for r in reqs)} prompt tokens "
        f"(scale {args.scale}), arrivals x{scale:.3g} ({mode}), "
        f"{'url ' + args.url if args.url else 'model ' + str(args.model)}"
        + (f", {args.replicas} replicas per router" if args.replicas else "")
    )
    print(format_table(summaries))
    lines = [ratio_line(summaries), evictions_line(summaries), host_line(summaries)]
    lines += [sim_line(summaries), replicas_line(rows), oracle_line(oracle)]
    for line in lines:
        if line:
            print(line)
    if args.json_out:
        write_json(args.json_out, _settings(args, reqs), rows, summaries, oracle)


def run_replay(args: argparse.Namespace) -> int:
    """The command: 0 on success, 2 on bad input, 1 if an engine failed."""
    try:
        if args.router and args.replicas is None:
            raise BenchError("--router needs --replicas N")
        reqs = load_workload(args)
        if args.replicas is not None:
            routers = check_cluster_args(args)
            args.model = check_model_dir(args.model)
            scale = fixed_time_scale(args, reqs)
            rows = run_cluster_rows(args, reqs, routers, scale, progress_bar)
            add_cluster_predictions(rows, reqs, args.replicas, args.router_tflops)
        elif args.url:
            rows = run_http(args, reqs)
            add_predictions(rows, reqs, None)
        else:
            rows = run_offline(args, reqs)
            add_predictions(rows, reqs, args.max_num_seqs, args.warmup)
    except BenchError as exc:
        print(f"vllm-hybrid bench replay: {exc}", file=sys.stderr)
        return 2
    except RowFailed as exc:
        print(f"vllm-hybrid bench replay: {exc}", file=sys.stderr)
        return 1
    print_report(args, reqs, rows)
    return 0


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``bench`` with its ``replay`` subcommand (for ``vllm_hybrid/cli.py``)."""
    bench: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="measure cache policies on a live engine"
    )
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH_COMMAND")
    add_replay_parser(sub)
    return bench


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "replay":
        return run_replay(args)
    raise BenchError(f"unknown bench command {args.bench_command!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-hybrid")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
