"""Soak run: sustained concurrent multi-turn chat against ``vllm-hybrid serve`` on loopback, with
a KV pool small enough that eviction never stops, then every answer checked against caching off.

    .venv/bin/python tools/soak.py --minutes 10 --json out/soak.json

1. Starts ``vllm-hybrid serve`` on the tiny Zamba2 (built under ``--models``) with
   ``--num-gpu-blocks-override`` small, ``--max-num-seqs`` 8, chunked prefill, the hybrid cache
   (and by default its integrity checks after every scheduler step: a violation kills the
   server, which shows as errors).
2. ``--clients`` threads hold conversations until ``--minutes`` or ``--max-requests``: each picks
   one of a few shared system prompts and a tenant (no ``cache_salt``, or one of ``--tenants``
   salts), then asks 2-7 turns, the history growing with every answer; greedy, 4-24 tokens.
   Every request's messages, salt, ``max_tokens``, answer token ids and cached tokens are kept.
3. Samples the resident memory of the server and its engine-core child (``/proc``) and scrapes
   ``/metrics`` (prefix cache hits and queries, preemptions, ``vllm_hybrid:*`` counters).
4. Stops the server and starts a reference server with ``--no-enable-prefix-caching`` (same
   flags otherwise), replays every recorded request (same messages, so the same prompt tokens)
   and compares the answer token for token. A greedy answer computed without any cache is the
   oracle: every mismatch is a cache bug. (Batching differs between the runs; the fuzzer and
   the server tests rely on the same batch invariance of greedy outputs on these fp32 models.)

Prints a table and writes JSON. Exit status 1 if any request errored, mismatched, or the server
died. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_hybrid.demo import (  # noqa: E402
    QUESTIONS,
    SYSTEM_PROMPT,
    free_port,
    start_server,
    stop_server,
    wait_ready,
)
from vllm_hybrid.testing.server import greedy, process_rss, scrape  # noqa: E402

SYSTEMS = [
    SYSTEM_PROMPT,
    "You are the help desk of a bicycle shop. " + SYSTEM_PROMPT[: len(SYSTEM_PROMPT) // 2],
    "You answer questions about train timetables, platforms and tickets in one sentence. " * 6,
]
WORDS = (
    "drill saw paint hose valve pipe seed soil brush roller tape screw bolt anchor nail "
    "ticket platform wheel chain brake tyre lamp bell saddle pump timetable delay"
).split()
COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm_hybrid:requests_total",
    "vllm_hybrid:hit_tokens_total",
    "vllm_hybrid:snapshot_hits_total",
    "vllm_hybrid:snapshot_misses_total",
    "vllm_hybrid:policy_evicted_pages_total",
    "vllm_hybrid:lru_fallback_pages_total",
    "vllm_hybrid:eviction_batches_total",
    "vllm_hybrid:kv_pages_cached_total",
    "vllm_hybrid:kv_pages_evicted_total",
    "vllm_hybrid:snapshot_pages_cached_total",
    "vllm_hybrid:snapshot_pages_evicted_total",
    "vllm_hybrid:prefill_flops_total",
    "vllm_hybrid:prefill_flops_saved_total",
)


@dataclass
class Record:
    client: int
    conversation: int
    turn: int
    salt: str | None
    messages: list[dict[str, str]]
    max_tokens: int
    status: int = 0
    token_ids: tuple[int, ...] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    error: str = ""
    reference: tuple[int, ...] | None = None


@dataclass
class Soak:
    base: str
    deadline: float
    max_requests: int
    tenants: int
    seed: int
    records: list[Record] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def take(self) -> bool:
        with self.lock:
            if self.stop.is_set() or time.monotonic() >= self.deadline:
                return False
            return len(self.records) < self.max_requests

    def client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        for conversation in range(10**9):
            system = rng.choice(SYSTEMS)
            tenant = rng.randrange(self.tenants + 1)
            salt = None if tenant == 0 else f"tenant-{tenant}"
            messages = [{"role": "system", "content": system}]
            for turn in range(rng.randint(2, 7)):
                if not self.take():
                    return
                question = rng.choice(QUESTIONS) + " " + " ".join(rng.sample(WORDS, 3))
                messages.append({"role": "user", "content": question})
                record = Record(index, conversation, turn, salt, list(messages), rng.randint(4, 24))
                with self.lock:
                    self.records.append(record)
                answer = ask(self.base, record)
                if record.status != 200:
                    break  # a failed turn ends the conversation
                messages.append({"role": "assistant", "content": answer})


def ask(base: str, record: Record, salt: bool = True) -> str:
    began = time.monotonic()
    try:
        reply = greedy(
            base,
            messages=record.messages,
            max_tokens=record.max_tokens,
            salt=record.salt if salt else None,
            timeout=600,
            ignore_eos=True,
        )
    except Exception as error:  # noqa: BLE001  (a dead server, a timeout: counted as errors)
        record.status, record.error = -1, repr(error)[:300]
        return ""
    record.seconds = time.monotonic() - began
    record.status = reply.status
    if reply.status != 200:
        record.error = reply.body[:300]
        return ""
    record.token_ids = reply.token_ids
    record.prompt_tokens, record.cached_tokens = reply.prompt_tokens, reply.cached_tokens
    return reply.text


class MemorySampler(threading.Thread):
    """RSS (KiB) of the server process tree every ``period`` seconds."""

    def __init__(self, pid: int, period: float, started: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.period, self.started = pid, period, started
        self.samples: list[dict[str, Any]] = []
        self.done = threading.Event()

    def sample(self) -> dict[str, Any]:
        rss = process_rss(self.pid)
        row = {"t": round(time.monotonic() - self.started, 1), "total_kib": sum(rss.values())}
        row["processes"] = rss
        self.samples.append(row)
        return row

    def run(self) -> None:
        while not self.done.wait(self.period):
            self.sample()


def counters(base: str) -> dict[str, float]:
    got = scrape(base)
    return {name: got.get(name, 0.0) for name in COUNTERS}


def serve(args: argparse.Namespace, model_dir: Path, log: Path, *extra: str) -> Any:
    port = args.port or free_port()
    flags = [
        "--max-model-len",
        str(args.max_model_len),
        "--num-gpu-blocks-override",
        str(args.blocks),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        *extra,
    ]
    proc = start_server(model_dir, port, log, *flags)
    try:
        wait_ready(proc, port, log)
    except Exception:
        stop_server(proc)
        raise
    return proc, f"http://127.0.0.1:{port}"


def replay(base: str, records: list[Record], workers: int) -> float:
    """Every answered request once more on the reference server; fills ``record.reference``."""
    todo = [r for r in records if r.status == 200]
    began = time.monotonic()

    def one(record: Record) -> None:
        copy = Record(**{**asdict(record), "messages": record.messages})
        ask(base, copy, salt=False)
        record.reference = copy.token_ids if copy.status == 200 else None
        if copy.status != 200:
            record.error = f"reference failed: {copy.status} {copy.error}"

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, todo))
    return time.monotonic() - began


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="traffic duration (default 10)")
    p.add_argument("--max-requests", type=int, default=20000, help="stop after this many")
    p.add_argument("--clients", type=int, default=6, help="concurrent client threads")
    p.add_argument("--tenants", type=int, default=2, help="cache_salt tenants besides no salt")
    p.add_argument("--blocks", type=int, default=40, help="--num-gpu-blocks-override")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--no-debug", action="store_true", help="no integrity checks every step")
    p.add_argument("--no-reference", action="store_true", help="skip the caching-off replay")
    p.add_argument("--sample-every", type=float, default=15.0, help="RSS sampling period (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", default="zamba2")
    p.add_argument("--models", default=str(ROOT / "out" / "models"), help="tiny model root")
    p.add_argument("--logs", default=str(ROOT / "out" / "soak"), help="server logs go here")
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra flag for the soak server (repeat; e.g. --server-arg=--no-enable-prefix-caching "
        "for a memory baseline)",
    )
    p.add_argument("--json", help="write the report here")
    return p


def mib(kib: float) -> str:
    return f"{kib / 1024:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm_hybrid.testing.fixtures import tiny_model_dir

    model_dir = tiny_model_dir(args.arch, args.models)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    settings = {"vllm_hybrid": {"debug": not args.no_debug}}
    print(f"[soak] starting the server ({model_dir.name}, {args.blocks} blocks)", flush=True)
    began = time.monotonic()
    proc, base = serve(
        args,
        model_dir,
        logs / "server.log",
        "--additional-config",
        json.dumps(settings),
        *args.server_arg,
    )
    start_s = time.monotonic() - began
    memory = MemorySampler(proc.pid, args.sample_every, time.monotonic())
    idle = memory.sample()
    metrics_before = counters(base)

    soak = Soak(
        base, time.monotonic() + args.minutes * 60, args.max_requests, args.tenants, args.seed
    )
    memory.start()
    traffic_began = time.monotonic()
    threads = [threading.Thread(target=soak.client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    last = 0.0
    while any(t.is_alive() for t in threads):
        time.sleep(1)
        if time.monotonic() - last >= 30:
            last = time.monotonic()
            ok = sum(r.status == 200 for r in soak.records)
            bad = sum(r.status not in (0, 200) for r in soak.records)
            total = memory.samples[-1]["total_kib"] if memory.samples else 0
            print(
                f"[soak] {last - traffic_began:6.0f}s  requests {len(soak.records)} ok {ok} "
                f"errors {bad}  server RSS {mib(total)}",
                flush=True,
            )
            if proc.poll() is not None:
                soak.stop.set()
    traffic_s = time.monotonic() - traffic_began
    memory.done.set()
    memory.join()
    end = memory.sample()
    alive = proc.poll() is None
    metrics_after = counters(base) if alive else {}
    stop_server(proc)

    records = soak.records
    ref_s, reference_samples = 0.0, []
    if not args.no_reference and records:
        print(f"[soak] reference: replaying {len(records)} requests with caching off", flush=True)
        ref_proc, ref_base = serve(
            args, model_dir, logs / "reference.log", "--no-enable-prefix-caching"
        )
        ref_memory = MemorySampler(ref_proc.pid, args.sample_every, time.monotonic())
        ref_memory.sample()
        ref_memory.start()
        try:
            ref_s = replay(ref_base, records, args.clients)
        finally:
            ref_memory.done.set()
            ref_memory.join()
            ref_memory.sample()
            stop_server(ref_proc)
        reference_samples = ref_memory.samples

    report = summarize(args, records, memory.samples, idle, end, metrics_before, metrics_after)
    report.update(
        server_start_s=round(start_s, 1),
        traffic_s=round(traffic_s, 1),
        reference_s=round(ref_s, 1),
        server_alive_at_end=alive,
    )
    if reference_samples:  # the same server with caching off, under the replay: a baseline
        totals = [s["total_kib"] for s in reference_samples]
        report["reference_rss_kib"] = {"idle": totals[0], "end": totals[-1], "max": max(totals)}
    print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {**report, "memory_samples": memory.samples}
        payload["reference_memory_samples"] = reference_samples
        payload["failures"] = [
            asdict(r)
            for r in records
            if r.status != 200 or (r.reference not in (None, r.token_ids))
        ][:50]
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"[soak] wrote {args.json}")
    failed = report["errors"] or report["mismatches"] or not alive
    if not args.no_reference:
        failed = failed or report["compared"] != report["ok"]
    return 1 if failed else 0


def summarize(args, records, samples, idle, end, before, after) -> dict[str, Any]:
    ok = [r for r in records if r.status == 200]
    compared = [r for r in ok if r.reference is not None]
    mismatches = [r for r in compared if r.reference != r.token_ids]
    warm = [s for s in samples if s["t"] > 0]
    middle = warm[len(warm) // 2] if warm else end
    first = warm[0] if warm else end
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS} if after else {}
    queries = delta.get("vllm:prefix_cache_queries_total", 0.0)
    hits = delta.get("vllm:prefix_cache_hits_total", 0.0)
    return {
        "settings": {
            k: getattr(args, k)
            for k in (
                "minutes",
                "max_requests",
                "clients",
                "tenants",
                "blocks",
                "max_num_seqs",
                "max_num_batched_tokens",
                "max_model_len",
                "seed",
            )
        }
        | {"debug": not args.no_debug},
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "compared": len(compared),
        "mismatches": len(mismatches),
        "conversations": len({(r.client, r.conversation) for r in records}),
        "salted_requests": sum(r.salt is not None for r in records),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "mean_latency_s": round(sum(r.seconds for r in ok) / len(ok), 3) if ok else 0.0,
        "rss_kib": {
            "idle": idle["total_kib"],
            "first": first["total_kib"],
            "middle": middle["total_kib"],
            "end": end["total_kib"],
            "max": max([s["total_kib"] for s in samples] or [0]),
        },
        "rss_end_by_process": end["processes"],
        "counters": delta,
    }


def print_table(r: dict[str, Any]) -> None:
    rss = r["rss_kib"]
    rows = [
        ("requests", r["requests"]),
        ("ok / errors", f"{r['ok']} / {r['errors']}"),
        ("compared with caching off", r["compared"]),
        ("mismatches", r["mismatches"]),
        ("conversations (salted requests)", f"{r['conversations']} ({r['salted_requests']})"),
        ("traffic seconds", r["traffic_s"]),
        ("mean latency s", r["mean_latency_s"]),
        ("prompt tokens / cached", f"{r['prompt_tokens']} / {r['cached_tokens']}"),
        ("prefix cache hit rate", r["hit_rate"]),
        (
            "server RSS idle/first/middle/end/max",
            " / ".join(mib(rss[k]) for k in ("idle", "first", "middle", "end", "max")),
        ),
        ("server alive at end", r["server_alive_at_end"]),
    ]
    if "reference_rss_kib" in r:
        ref = r["reference_rss_kib"]
        rows.append(
            (
                "caching-off server RSS idle/end/max",
                " / ".join(mib(ref[k]) for k in ("idle", "end", "max")),
            )
        )
    rows += [(name, f"{value:.6g}") for name, value in r["counters"].items()]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
