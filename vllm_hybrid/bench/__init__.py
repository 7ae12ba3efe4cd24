"""``vllm-hybrid bench``: measure prefix-cache policies on a live vLLM engine.

``bench replay`` replays a trace (Mooncake JSONL) or a generated workload (``gen:chat``,
``gen:docqa``, ``gen:agent``) against one fresh engine per policy (offline, in a subprocess each)
or against a running server over HTTP, and prints token hit rate, prefill tokens computed, TTFT
p50/p95 and throughput side by side. See ``docs/bench_replay.md``.

Layering: only the functions that start an engine import vLLM, lazily; everything else here is
standard library (plus ``tqdm`` / ``openai`` where a progress bar / HTTP client is needed).
"""

from __future__ import annotations


class BenchError(ValueError):
    """Bad user input (flags, trace, model directory); the CLI prints it as one line, exit 2."""
