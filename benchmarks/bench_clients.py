"""Real clients as the judge (issue 24, item 3): vLLM's ``bench serve``, guidellm and aiperf
against ``vllm-hybrid serve``, one server per configuration and pool.

Configurations (``--configs``):

- ``stock``: ``--additional-config '{"vllm_hybrid": {"policy": "stock"}}'``, vLLM's own prefix
  cache untouched;
- ``ours``: no vllm_hybrid flag at all (the defaults: ``flop`` policy, prefix match unit 1
  for hybrids, the system-prompt breakpoint on chat requests);
- ``off``: ``--no-enable-prefix-caching`` (the reference for outputs and uncached TTFT; vLLM
  0.32 enables prefix caching by default for Mamba hybrids, so leaving the flag out is not off).

Every server: ``python -m vllm_hybrid.cli serve MODEL`` in fp32, ``--enforce-eager``,
``--enable-prompt-tokens-details``, ``--num-gpu-blocks-override BLOCKS``, ``VLLM_CPU_KVCACHE_SPACE``
and ``VLLM_SERVER_DEV_MODE=1`` (for ``POST /reset_prefix_cache`` between clients). Pools
(``--pools``): ``BLOCKS@RATE`` (requests/s), ``tight`` = 96@0.5, ``moderate`` = 300@0.3.

Clients (``--clients``), run one after another on each server, the prefix cache reset and
/metrics scraped before and after each:

- ``vllm-prefix``: ``vllm bench serve --dataset-name prefix_repetition`` (16 prefixes x 1,024
  tokens + 128-token suffixes, 16 output tokens, ``--num-prompts``, Poisson, ``--seed``,
  ``--temperature 0``, ``--ignore-eos``), run from .venv through ``vllm_bench_serve.py``;
- ``vllm-random``: ``vllm bench serve --dataset-name random --random-prefix-len 1024``
  (128-token random inputs after one shared 1,024-token prefix, 16 output tokens);
- ``guidellm``: guidellm 0.8.1, ``synthetic_text`` multi-turn over ``/v1/chat/completions``
  (system prefixes of 1,024 tokens, 128-token user turns, 16 output tokens), Poisson;
- ``aiperf``: aiperf 0.13.0 multi-turn chat (a 1,024-token system prompt shared by all
  conversations, 128-token turns, 16 output tokens), Poisson.

guidellm and aiperf come from ``scripts/install_clients.sh`` (``.venv-clients/``).

Results merge into ``--json`` (a re-run of a cell replaces it), the table is printed and a PNG
written; ``--report-only`` re-prints both from the JSON. Run it under ``nice -n 5`` on a
shared machine; it never runs two servers or two clients at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from clients_report import (  # noqa: E402
    CLIENTS,
    CONFIGS,
    UsageError,
    format_table,
    merge_rows,
    metrics_delta,
    parse_choices,
    parse_metrics,
    parse_pool,
    plot,
    read_aiperf,
    read_guidellm,
    read_vllm_bench,
    server_hit_rate,
)

ROOT = Path(__file__).resolve().parents[1]
SERVED_NAME = "bench"
STOCK_CONFIG = json.dumps({"vllm_hybrid": {"policy": "stock"}})


# --- command lines (pure) ----------


def server_command(
    python: str, model: str, port: int, config: str, blocks: int, max_len: int
) -> list[str]:
    """``vllm-hybrid serve`` for one configuration (see the module docstring)."""
    if config not in CONFIGS:
        raise UsageError(f"unknown configuration {config!r}; choose from {', '.join(CONFIGS)}")
    command = [
        python, "-m", "vllm_hybrid.cli", "serve", model,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_len),
        "--enable-prompt-tokens-details", "--num-gpu-blocks-override", str(blocks),
    ]  # fmt: skip
    # vLLM 0.32 turns prefix caching on by default for these models: omitting
    # --enable-prefix-caching is not "off", the flag's negation is.
    command.append("--no-enable-prefix-caching" if config == "off" else "--enable-prefix-caching")
    if config == "stock":
        command += ["--additional-config", STOCK_CONFIG]
    return command


def client_command(
    client: str, args: argparse.Namespace, url: str, rate: float, out_dir: Path
) -> list[str]:
    """The command line of one client run writing its results under ``out_dir``."""
    common_vllm = [
        args.python, str(ROOT / "benchmarks" / "vllm_bench_serve.py"),
        "--base-url", url, "--model", SERVED_NAME, "--tokenizer", args.model,
        "--request-rate", f"{rate:g}", "--seed", str(args.seed), "--temperature", "0",
        "--ignore-eos", "--metric-percentiles", "50,99", "--ready-check-timeout-sec", "0",
        "--save-result", "--save-detailed", "--result-dir", str(out_dir),
        "--result-filename", "result.json", "--disable-tqdm",
    ]  # fmt: skip
    if client == "vllm-prefix":
        return common_vllm + [
            "--dataset-name", "prefix_repetition", "--num-prompts", str(args.num_prompts),
            "--prefix-repetition-prefix-len", "1024", "--prefix-repetition-suffix-len", "128",
            "--prefix-repetition-num-prefixes", "16", "--prefix-repetition-output-len", "16",
        ]  # fmt: skip
    if client == "vllm-random":
        return common_vllm + [
            "--dataset-name", "random", "--num-prompts", str(args.random_prompts),
            "--random-input-len", "128", "--random-output-len", "16",
            "--random-prefix-len", "1024", "--random-range-ratio", "0",
        ]  # fmt: skip
    if client == "guidellm":
        return [
            str(Path(args.clients_venv) / "guidellm" / "bin" / "guidellm"), "run",
            "-c", str(out_dir / "scenario.json"), "--disable-progress",
        ]  # fmt: skip
    if client == "aiperf":
        turns = args.turns
        return [
            str(Path(args.clients_venv) / "aiperf" / "bin" / "aiperf"), "profile",
            "--model", SERVED_NAME, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", args.model, "--shared-system-prompt-length", "1024",
            "--isl", "128", "--osl", "16",
            "--conversation-num", str(max(1, args.conv_requests // turns)),
            "--conversation-turn-mean", str(turns), "--request-count", str(args.conv_requests),
            "--request-rate", f"{rate:g}", "--arrival-pattern", "poisson",
            "--random-seed", str(args.seed),
            "--extra-inputs", json.dumps({"temperature": 0, "ignore_eos": True}),
            "--use-server-token-count", "--export-outputs-json",
            "--artifact-dir", str(out_dir), "--ui", "none",
        ]  # fmt: skip
    raise UsageError(f"unknown client {client!r}; choose from {', '.join(CLIENTS)}")


def guidellm_scenario(args: argparse.Namespace, url: str, rate: float, out_dir: Path) -> dict:
    """guidellm's scenario file: multi-turn synthetic chat with shared system prefixes."""
    return {
        "spec": {
            "backend": {
                "kind": "openai_http", "target": url, "model": SERVED_NAME,
                "request_format": "/v1/chat/completions",
                "extras": {"body": {"temperature": 0}},
            },
            "tokenizer": {"kind": "huggingface_auto", "model": args.model},
            "profile": {"kind": "poisson", "rate": [rate]},
            "data": [{
                "kind": "synthetic_text", "prompt_tokens": 128, "output_tokens": 16,
                "turns": args.turns, "prefix_tokens": 1024, "prefix_count": args.prefixes,
            }],
            "seed": {"kind": "static", "value": args.seed},
            "constraints": [{"kind": "max_requests", "count": args.conv_requests}],
            "outputs": [{"kind": "json", "path": str(out_dir / "guidellm.json")}],
        }
    }  # fmt: skip


def read_client(client: str, out_dir: Path) -> dict[str, Any]:
    """The row fields from a finished client's files in ``out_dir``."""
    if client in ("vllm-prefix", "vllm-random"):
        return read_vllm_bench(json.loads((out_dir / "result.json").read_text()))
    if client == "guidellm":
        return read_guidellm(json.loads((out_dir / "guidellm.json").read_text()))
    summary = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    outputs_path = out_dir / "outputs.json"
    outputs = json.loads(outputs_path.read_text()) if outputs_path.exists() else None
    return read_aiperf(summary, outputs)


# --- arguments ----------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_clients.py",
        description="vLLM bench serve, guidellm and aiperf against vllm-hybrid serve.",
    )
    p.add_argument("--model", default="models/small-zamba2", help="model directory")
    p.add_argument(
        "--size", default="small", choices=("tiny", "small"),
        help="random-weight Zamba2 size built into --model when it is missing",
    )  # fmt: skip
    p.add_argument("--configs", default="all", help="stock,ours,off (default all)")
    p.add_argument("--pools", default="tight,moderate", help="BLOCKS@RATE list or tight,moderate")
    p.add_argument("--clients", default="all", help=",".join(CLIENTS) + " (default all)")
    p.add_argument("--num-prompts", type=int, default=128, help="prefix_repetition prompts")
    p.add_argument("--random-prompts", type=int, default=64, help="random dataset prompts")
    p.add_argument("--conv-requests", type=int, default=64, help="guidellm/aiperf requests")
    p.add_argument("--turns", type=int, default=4, help="turns per guidellm/aiperf conversation")
    p.add_argument("--prefixes", type=int, default=4, help="guidellm's distinct system prefixes")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-len", type=int, default=4096, help="server --max-model-len")
    p.add_argument("--kv-space", default="4", help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--out", default="out/clients", help="directory for logs and client files")
    p.add_argument("--json", help="results JSON, merged across runs (default OUT/results.json)")
    p.add_argument("--png", help="plot path (default OUT/results.png)")
    p.add_argument("--python", default=sys.executable, help="python of the vLLM venv")
    p.add_argument(
        "--code", default=str(ROOT),
        help="directory whose vllm_hybrid/ the server runs (its cwd and PYTHONPATH), e.g. a "
        "`git archive` of a commit, so files being edited in this checkout are not measured; "
        "a COMMIT file there is recorded in each row",
    )  # fmt: skip
    p.add_argument("--clients-venv", default=str(ROOT / ".venv-clients"))
    p.add_argument("--client-timeout", type=float, default=1800.0, help="seconds per client")
    p.add_argument("--report-only", action="store_true", help="print the table from --json")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check everything before any server starts; a bad value is a UsageError."""
    args = build_parser().parse_args(argv)
    args.config_list = parse_choices(args.configs, CONFIGS, "configuration")
    args.client_list = parse_choices(args.clients, CLIENTS, "client")
    pools = [s for s in args.pools.split(",") if s.strip()]
    if not pools:
        raise UsageError("no pool given; use BLOCKS@RATE or tight,moderate")
    args.pool_list = [parse_pool(s) for s in pools]
    for name in ("num_prompts", "random_prompts", "conv_requests", "turns", "prefixes"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.num_prompts < 16:
        raise UsageError("--num-prompts must be at least 16 (the 16 prefixes)")
    out = Path(args.out).resolve()
    args.out = str(out)
    # absolute, built or not: the server runs in --code's directory, where a relative path
    # would not exist and transformers would look it up on the Hub
    args.model = str(Path(args.model).resolve())
    args.json = args.json or str(out / "results.json")
    args.png = args.png or str(out / "results.png")
    args.code = str(Path(args.code).resolve())
    if not args.report_only and not (Path(args.code) / "vllm_hybrid").is_dir():
        raise UsageError(f"--code {args.code}: no vllm_hybrid/ there")
    if args.report_only and not Path(args.json).exists():
        raise UsageError(f"--report-only: {args.json} does not exist")
    if not args.report_only:
        for client in ("guidellm", "aiperf"):
            tool = Path(args.clients_venv) / client / "bin" / client
            if client in args.client_list and not tool.exists():
                raise UsageError(f"{tool} not found; run scripts/install_clients.sh")
    return args


# --- the server ----------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http(url: str, data: bytes | None = None, timeout: float = 30) -> str:
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


class Server:
    """One ``vllm-hybrid serve`` process; its output goes to ``log``."""

    def __init__(
        self, command: list[str], env: dict[str, str], log: Path, port: int, cwd: Path = ROOT
    ) -> None:
        self.command, self.env, self.log, self.port, self.cwd = command, env, log, port, cwd
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 900) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.log, "w")  # noqa: SIM115  (closed with the process)
        handle.write(f"# cwd={self.cwd} PYTHONPATH={self.env.get('PYTHONPATH', '')}\n")
        handle.write("$ " + shlex.join(self.command) + "\n")
        handle.flush()
        self.proc = subprocess.Popen(
            self.command, stdout=handle, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.log}")
            try:
                http(f"{self.url}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout_s:.0f}s; see {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(http(f"{self.url}/metrics"))

    def reset_cache(self) -> bool:
        """POST /reset_prefix_cache (dev mode), retried while requests still hold blocks."""
        for _ in range(30):
            try:
                answer = json.loads(http(f"{self.url}/reset_prefix_cache", data=b""))
            except (OSError, ValueError):
                answer = {}
            if answer.get("success", True):
                return True
            time.sleep(1)
        return False

    def warm_up(self) -> None:
        """One short uncached request, so no row pays the engine's first-step costs."""
        body = {"model": SERVED_NAME, "prompt": [10 + i for i in range(64)], "max_tokens": 2}
        http(f"{self.url}/v1/completions", data=json.dumps(body).encode(), timeout=300)


def block_line(log: Path) -> str:
    """The server log's line that names the pool it runs on (ours prints one)."""
    for line in log.read_text(errors="replace").splitlines():
        if "vllm-hybrid:" in line and " blocks of " in line:
            return line.split("vllm-hybrid:", 1)[1].strip()
    return ""


# --- one server, its clients ----------


def run_server(args: argparse.Namespace, config: str, pool: tuple[str, int, float]) -> list[dict]:
    name, blocks, rate = pool
    port = free_port()
    tag = f"{name.replace('@', '_at_')}-{config}"
    out = Path(args.out)
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(args.kv_space), "VLLM_SERVER_DEV_MODE": "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.code, env.get("PYTHONPATH")]))
    command = server_command(args.python, args.model, port, config, blocks, args.max_len)
    # one log per server start: a later run of the same pool and configuration (other
    # clients) must not overwrite it
    log = out / f"server-{tag}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    server = Server(command, env, log, port, cwd=Path(args.code))
    commit_file = Path(args.code) / "COMMIT"
    code = commit_file.read_text().strip() if commit_file.exists() else args.code
    rows = []
    t0 = time.monotonic()
    print(f"[clients] {tag}: starting server on port {port}", file=sys.stderr, flush=True)
    try:
        server.start()
        server.warm_up()
        print(
            f"[clients] {tag}: ready in {time.monotonic() - t0:.0f}s "
            f"({block_line(server.log) or 'no vllm-hybrid pool line'})",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        for client in args.client_list:
            cdir = out / tag / client
            cdir.mkdir(parents=True, exist_ok=True)
            if client == "guidellm":
                scenario = guidellm_scenario(args, server.url, rate, cdir)
                (cdir / "scenario.json").write_text(json.dumps(scenario, indent=1))
            cmd = client_command(client, args, server.url, rate, cdir)
            reset = server.reset_cache()
            time.sleep(2)
            before = server.metrics()
            start = time.monotonic()
            with open(cdir / "client.log", "w") as log:
                log.write("$ " + shlex.join(cmd) + "\n")
                log.flush()
                proc = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                    timeout=args.client_timeout, check=False,
                )  # fmt: skip
            wall = time.monotonic() - start
            after = server.metrics()
            if proc.returncode != 0:
                print(
                    f"[clients] {tag} {client}: exit {proc.returncode}, see {cdir}/client.log",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
                continue
            row = read_client(client, cdir)
            delta = metrics_delta(before, after)
            row.update({
                "client": client, "config": config, "pool": name, "blocks": blocks,
                "rate": rate, "server": delta, "hit_server": server_hit_rate(delta),
                "wall_s": wall, "cache_reset": reset, "command": shlex.join(cmd),
                "server_command": shlex.join(command), "pool_line": block_line(server.log),
                "code": code,
                "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": os.getloadavg()[0],
            })  # fmt: skip
            rows.append(row)
            print(
                f"[clients] {tag} {client}: {row['requests']} requests in {wall:.0f}s, "
                f"TTFT mean {row['ttft_mean_s']:.2f}s",
                file=sys.stderr, flush=True,
            )  # fmt: skip
    finally:
        server.stop()
    return rows


def save(args: argparse.Namespace, rows: list[dict]) -> list[dict]:
    path = Path(args.json)
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    merged = merge_rows(old, rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": merged}, indent=1))
    return merged


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as err:
        print(f"bench_clients.py: error: {err}", file=sys.stderr)
        return 2
    if not args.report_only:
        if not Path(args.model).is_dir():
            from vllm_hybrid.testing.make_model import build_model

            build_model("zamba2", args.model, size=args.size)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        for pool in args.pool_list:
            for config in args.config_list:
                save(args, run_server(args, config, pool))
    rows = json.loads(Path(args.json).read_text())["rows"]
    print(format_table(rows))
    if rows:
        plot(rows, args.png)
        print(f"\nJSON: {args.json}\nPNG: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
