"""The pure half of ``bench_clients.py``: pool specs, the clients' result files read into one
row shape, /metrics deltas, the greedy-output comparison, the table and the plot.

Nothing here starts a process or opens a socket, so ``tests/bench/test_bench_clients.py`` runs
it on hand-written inputs.

A row is one client run against one server configuration at one pool::

    {"client": "vllm-prefix", "config": "ours", "pool": "96@0.5", "blocks": 96, "rate": 0.5,
     "requests": 128, "errors": 0, "duration_s": ..., "ttft_mean_s": ..., "ttft_p50_s": ...,
     "ttft_p99_s": ..., "out_tok_s": ..., "hit_server": 0.74 | None, "hit_client": ... | None,
     "server": {metric deltas}, "outputs": {key: text}}
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

CONFIGS = ("stock", "ours", "off")
CLIENTS = ("vllm-prefix", "vllm-random", "guidellm", "aiperf")
#: The issue's two operating points: the tight pool (96 blocks of 128 tokens, 0.5 req/s) and
#: the moderate one (300 blocks, 0.3 req/s).
POOL_ALIASES = {"tight": "96@0.5", "moderate": "300@0.3"}

#: Counters whose change over a client run goes into ``row["server"]`` (``_total`` dropped).
SERVER_COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm_hybrid:requests",
    "vllm_hybrid:prompt_tokens",
    "vllm_hybrid:hit_tokens",
    "vllm_hybrid:snapshot_hits",
    "vllm_hybrid:snapshot_misses",
    "vllm_hybrid:junction_tokens",
    "vllm_hybrid:kv_pages_evicted",
    "vllm_hybrid:snapshot_pages_evicted",
    "vllm_hybrid:policy_evicted_pages",
    "vllm_hybrid:lru_fallback_pages",
    "vllm_hybrid:output_states_kept",
    "vllm_hybrid:breakpoint_stops",
)


class UsageError(ValueError):
    """A bad command line; the message names the fix."""


# --- arguments ----------


def parse_pool(spec: str) -> tuple[str, int, float]:
    """``"tight"``, ``"moderate"`` or ``"BLOCKS@RATE"`` -> (canonical name, blocks, req/s)."""
    text = POOL_ALIASES.get(spec.strip(), spec.strip())
    match = re.fullmatch(r"(\d+)@(\d+(?:\.\d*)?|\.\d+)", text)
    if not match:
        raise UsageError(
            f"bad pool {spec!r}: expected BLOCKS@RATE (e.g. 96@0.5) or one of "
            f"{', '.join(POOL_ALIASES)}"
        )
    blocks, rate = int(match.group(1)), float(match.group(2))
    if blocks <= 0 or rate <= 0:
        raise UsageError(f"bad pool {spec!r}: blocks and rate must be positive")
    return f"{blocks}@{rate:g}", blocks, rate


def parse_choices(text: str, valid: Iterable[str], what: str) -> list[str]:
    """A comma-separated subset of ``valid`` (``all``: every one), order kept, no repeats."""
    valid = list(valid)
    items = [t.strip() for t in text.split(",") if t.strip()]
    if items == ["all"]:
        return valid
    if not items:
        raise UsageError(f"no {what} given; choose from {', '.join(valid)}")
    bad = [t for t in items if t not in valid]
    if bad:
        raise UsageError(f"unknown {what} {', '.join(bad)}; choose from {', '.join(valid)}")
    return list(dict.fromkeys(items))


# --- /metrics ----------

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, summed over label sets; ``_created`` twins skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match or match.group(1).endswith("_created"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        out[match.group(1)] = out.get(match.group(1), 0.0) + value
    return out


def metrics_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """The change of each of :data:`SERVER_COUNTERS` (absent on both sides: left out)."""
    delta = {}
    for name in SERVER_COUNTERS:
        key = f"{name}_total"
        if key in before or key in after:
            delta[name] = after.get(key, 0.0) - before.get(key, 0.0)
    return delta


def server_hit_rate(delta: Mapping[str, float]) -> float | None:
    """vLLM's own token hit rate over the run: prefix_cache_hits / prefix_cache_queries
    (None when nothing was queried, e.g. caching off)."""
    queries = delta.get("vllm:prefix_cache_queries", 0.0)
    return delta.get("vllm:prefix_cache_hits", 0.0) / queries if queries else None


# --- the clients' result files ----------


def _ms(value: Any) -> float | None:
    return None if value is None else float(value) / 1000.0


def read_vllm_bench(result: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm bench serve --save-result --save-detailed`` JSON -> row fields. Outputs are keyed
    by the request's index in the dataset (the same prompts for the same seed)."""
    for key in ("completed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "duration"):
        if key not in result:
            raise ValueError(f"not a vllm bench serve result: no {key!r}")
    texts = result.get("generated_texts") or []
    return {
        "requests": int(result["completed"]),
        "errors": int(result.get("failed", 0)),
        "duration_s": float(result["duration"]),
        "ttft_mean_s": _ms(result["mean_ttft_ms"]),
        "ttft_p50_s": _ms(result["median_ttft_ms"]),
        "ttft_p99_s": _ms(result["p99_ttft_ms"]),
        "out_tok_s": float(result.get("output_throughput", 0.0)),
        "prompt_tokens": int(result.get("total_input_tokens", 0)),
        "hit_client": None,
        "outputs": {str(i): t for i, t in enumerate(texts)},
    }


def _last_user_text(request_args: Any) -> str:
    """The last user message of a guidellm request (its turn's unique synthetic text)."""
    import json

    args = json.loads(request_args) if isinstance(request_args, str) else request_args
    messages = ((args or {}).get("body") or {}).get("messages") or []
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(c.get("text", "") for c in content if isinstance(c, dict))
            return str(content)
    return ""


def read_guidellm(report: Mapping[str, Any]) -> dict[str, Any]:
    """guidellm 0.8 ``--output kind=json`` report (one benchmark) -> row fields. Outputs are
    keyed by the turn's user text, which guidellm makes unique per turn."""
    benchmarks = report.get("benchmarks")
    if not benchmarks:
        raise ValueError("not a guidellm report: no benchmarks")
    bench = benchmarks[0]
    ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]
    done = bench["requests"]["successful"]
    prompt = sum(int(r.get("prompt_tokens") or 0) for r in done)
    cached = sum(int(r.get("cached_tokens") or 0) for r in done)
    output = sum(int(r.get("output_tokens") or 0) for r in done)
    duration = float(bench["duration"])
    return {
        "requests": len(done),
        "errors": len(bench["requests"].get("errored") or []),
        "duration_s": duration,
        "ttft_mean_s": _ms(ttft["mean"]),
        "ttft_p50_s": _ms(ttft["median"]),
        "ttft_p99_s": _ms(ttft["percentiles"]["p99"]),
        "out_tok_s": output / duration if duration > 0 else 0.0,
        "prompt_tokens": prompt,
        "hit_client": cached / prompt if prompt else None,
        "outputs": {_last_user_text(r.get("request_args")): r.get("output") or "" for r in done},
    }


def read_aiperf(summary: Mapping[str, Any], outputs: Mapping[str, Any] | None) -> dict[str, Any]:
    """aiperf 0.13 ``profile_export_aiperf.json`` (+ ``outputs.json``) -> row fields. Outputs
    are keyed ``conversation_id/turn_index``."""

    def avg(key: str) -> float | None:
        item = summary.get(key)
        return None if not isinstance(item, Mapping) else item.get("avg")

    ttft = summary.get("time_to_first_token")
    if not isinstance(ttft, Mapping):
        raise ValueError("not an aiperf summary: no time_to_first_token")
    prompt = avg("total_usage_prompt_tokens") or avg("total_isl") or 0
    cached = avg("total_usage_prompt_cache_read_tokens")
    texts = {}
    for record in (outputs or {}).get("data", []):
        key = f"{record.get('conversation_id')}/{record.get('turn_index')}"
        texts[key] = record.get("response_text") or ""
    return {
        "requests": int(avg("request_count") or 0),
        "errors": len(summary.get("error_summary") or []),
        "duration_s": float(avg("benchmark_duration") or 0.0),
        "ttft_mean_s": _ms(ttft.get("avg")),
        "ttft_p50_s": _ms(ttft.get("p50")),
        "ttft_p99_s": _ms(ttft.get("p99")),
        "out_tok_s": float(avg("output_token_throughput") or 0.0),
        "prompt_tokens": int(prompt),
        "hit_client": (cached / prompt) if (cached is not None and prompt) else None,
        "outputs": texts,
    }


# --- comparing rows ----------


def row_key(row: Mapping[str, Any]) -> tuple[str, str, str]:
    return (str(row["pool"]), str(row["client"]), str(row["config"]))


def merge_rows(old: Iterable[Mapping[str, Any]], new: Iterable[Mapping[str, Any]]) -> list[dict]:
    """``old`` with every row of ``new`` added, a re-run (same pool, client, config) replacing
    the earlier one; sorted by pool, client and configuration order."""
    merged = {row_key(r): dict(r) for r in old}
    merged.update({row_key(r): dict(r) for r in new})
    order = {c: i for i, c in enumerate(CONFIGS)}
    corder = {c: i for i, c in enumerate(CLIENTS)}
    return sorted(
        merged.values(),
        key=lambda r: (
            -int(r.get("blocks", 0)),
            corder.get(r["client"], 99),
            order.get(r["config"], 99),
        ),
    )


def compare_outputs(a: Mapping[str, str], b: Mapping[str, str]) -> dict[str, Any]:
    """Greedy outputs of two rows over the requests both finished: how many, how many differ,
    and the first few differing keys."""
    common = sorted(set(a) & set(b))
    differ = [k for k in common if a[k] != b[k]]
    return {"compared": len(common), "differ": len(differ), "examples": differ[:5]}


def _find(rows: Iterable[Mapping[str, Any]], pool: str, client: str, config: str):
    for row in rows:
        if row_key(row) == (pool, client, config):
            return row
    return None


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0 or math.isnan(num) or math.isnan(den):
        return None
    return num / den


def summarize(rows: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (pool, client): ours/stock TTFT mean ratio and tok/s ratio, and whether greedy
    outputs of ours and of stock equal caching off's."""
    out = []
    seen = []
    for row in rows:
        pc = (row["pool"], row["client"])
        if pc in seen:
            continue
        seen.append(pc)
        ours, stock, off = (_find(rows, pc[0], pc[1], c) for c in ("ours", "stock", "off"))
        item: dict[str, Any] = {"pool": pc[0], "client": pc[1]}
        if ours and stock:
            item["ttft_mean_ratio"] = ratio(ours.get("ttft_mean_s"), stock.get("ttft_mean_s"))
            item["ttft_p50_ratio"] = ratio(ours.get("ttft_p50_s"), stock.get("ttft_p50_s"))
            item["out_tok_s_ratio"] = ratio(ours.get("out_tok_s"), stock.get("out_tok_s"))
        for name, row_ in (("ours", ours), ("stock", stock)):
            if row_ and off and row_.get("outputs") and off.get("outputs"):
                item[f"{name}_vs_off"] = compare_outputs(row_["outputs"], off["outputs"])
        out.append(item)
    return out


# --- printing ----------


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


HEADER = (
    f"{'pool':>8} {'client':<12} {'config':<6} {'reqs':>5} {'TTFT mean':>10} {'p50':>7} "
    f"{'p99':>7} {'hit srv':>8} {'hit cli':>8} {'out tok/s':>9} {'preempt':>7} {'evicted':>7}"
)


def format_row(row: Mapping[str, Any]) -> str:
    server = row.get("server") or {}
    evicted = server.get("vllm_hybrid:kv_pages_evicted", 0) + server.get(
        "vllm_hybrid:snapshot_pages_evicted", 0
    )
    has_hybrid = "vllm_hybrid:kv_pages_evicted" in server and row.get("config") == "ours"
    reqs = f"{row.get('requests', 0)}" + (f"!{row['errors']}" if row.get("errors") else "")
    return (
        f"{row['pool']:>8} {row['client']:<12} {row['config']:<6} {reqs:>5} "
        f"{_f(row.get('ttft_mean_s'), '.2f'):>10} {_f(row.get('ttft_p50_s'), '.2f'):>7} "
        f"{_f(row.get('ttft_p99_s'), '.2f'):>7} {_pct(row.get('hit_server')):>8} "
        f"{_pct(row.get('hit_client')):>8} {_f(row.get('out_tok_s'), '.2f'):>9} "
        f"{int(server.get('vllm:num_preemptions', 0)):>7} "
        f"{(str(int(evicted)) if has_hybrid else '-'):>7}"
    )


def format_summary(item: Mapping[str, Any]) -> str:
    parts = [f"{item['pool']:>8} {item['client']:<12}"]
    if "ttft_mean_ratio" in item:
        parts.append(
            f"ours/stock TTFT mean {_f(item['ttft_mean_ratio'], '.2f')}x, "
            f"p50 {_f(item.get('ttft_p50_ratio'), '.2f')}x, "
            f"out tok/s {_f(item.get('out_tok_s_ratio'), '.2f')}x"
        )
    for name in ("ours", "stock"):
        cmp_ = item.get(f"{name}_vs_off")
        if cmp_:
            same = "yes" if not cmp_["differ"] else f"NO ({cmp_['differ']} differ)"
            parts.append(f"{name} == off: {same} ({cmp_['compared']} requests)")
    return "; ".join(parts)


def format_table(rows: list[Mapping[str, Any]]) -> str:
    """The rows (seconds; hit rates as %), then one summary line per (pool, client)."""
    lines = [HEADER, "-" * len(HEADER)]
    lines += [format_row(r) for r in rows]
    summary = summarize(rows)
    if summary:
        lines.append("")
        lines += [format_summary(s) for s in summary]
    lines.append("")
    lines.append(
        "TTFT in s (client's own numbers); hit srv: vllm:prefix_cache_hits / queries over the "
        "run; hit cli: cached / prompt tokens the client read from usage; preempt: "
        "vllm:num_preemptions; evicted: pages our cache evicted (ours only); reqs N!E: E failed"
    )
    return "\n".join(lines)


def plot(rows: list[Mapping[str, Any]], path: str) -> None:
    """One panel per pool: TTFT mean per client, a bar per configuration (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = list(dict.fromkeys(r["pool"] for r in rows))
    fig, axes = plt.subplots(1, len(pools), figsize=(6 * len(pools), 4), squeeze=False)
    colors = {"stock": "#888888", "ours": "#1f77b4", "off": "#d62728"}
    for ax, pool in zip(axes[0], pools, strict=True):
        prow = [r for r in rows if r["pool"] == pool]
        clients = list(dict.fromkeys(r["client"] for r in prow))
        width = 0.8 / len(CONFIGS)
        for j, config in enumerate(CONFIGS):
            xs, ys = [], []
            for i, client in enumerate(clients):
                row = _find(prow, pool, client, config)
                if row and row.get("ttft_mean_s"):
                    xs.append(i + (j - 1) * width)
                    ys.append(row["ttft_mean_s"])
            ax.bar(xs, ys, width, label=config, color=colors.get(config))
        ax.set_xticks(range(len(clients)))
        ax.set_xticklabels(clients)
        ax.set_yscale("log")
        blocks, rate = pool.split("@")
        ax.set_title(f"{blocks} blocks, {rate} req/s")
        ax.set_ylabel("TTFT mean (s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
