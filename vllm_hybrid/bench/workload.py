"""Turn a trace or a generated workload into concrete token-id requests with arrival times.

A :class:`~vllm_hybrid.sim.trace.SimRequest` describes its prompt as segments
``(content_id, n_tokens)``. :func:`materialize` gives each segment token ids drawn from a
generator seeded by its ``content_id``, so token ``k`` of a segment is the same wherever the
segment appears: requests that share segments share token prefixes, and the engine's prefix cache
sees exactly the sharing the trace describes. Everything here is deterministic for a given
(source, seed, scale) and imports no engine.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_hybrid.bench import BenchError
from vllm_hybrid.sim.generators import GENERATORS
from vllm_hybrid.sim.trace import SimRequest, TraceError, iter_mooncake

#: Token ids are drawn from ``[TOKEN_LO, TOKEN_HI)``: clear of special tokens at the low end, and
#: inside the vocabulary of any real model (and of the tiny test models, 2,048 ids).
TOKEN_LO, TOKEN_HI = 10, 1000


@dataclass(frozen=True)
class BenchRequest:
    """One request to replay: when it arrives (seconds from the start, trace time before
    scaling), its prompt token ids and how many tokens to generate (with ``ignore_eos``)."""

    index: int
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def iter_source(spec: str, seed: int = 0) -> Iterator[SimRequest]:
    """Requests of ``spec``: a Mooncake JSONL path or ``gen:NAME``; BenchError on bad input."""
    if spec.startswith("gen:"):
        name = spec[4:]
        if name not in GENERATORS:
            raise BenchError(f"unknown generator {name!r}; known: {', '.join(GENERATORS)}")
        yield from GENERATORS[name](seed=seed)
        return
    if not Path(spec).is_file():
        raise BenchError(f"trace file not found: {spec}")
    try:
        yield from iter_mooncake(spec)
    except TraceError as exc:
        raise BenchError(f"malformed trace: {exc}") from None


def materialize(req: SimRequest, scale: float) -> list[int]:
    """The prompt's token ids: each segment ``round(n * scale)`` tokens (at least 1) seeded by its
    content id, cut at ``round(prompt_tokens * scale)`` tokens."""
    budget = max(1, round(req.prompt_tokens * scale))
    out: list[int] = []
    for content_id, n_tokens in req.segments:
        rng = random.Random(content_id)
        out += [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(max(1, round(n_tokens * scale)))]
        if len(out) >= budget:
            break
    return out[:budget]


def output_tokens(req: SimRequest, scale: float, max_tokens: int | None) -> int:
    """Tokens to generate: ``max_tokens`` if given, else the trace's output length scaled."""
    if max_tokens is not None:
        return max_tokens
    return max(1, round(req.output_tokens * scale))


def build_workload(
    source: Iterable[SimRequest],
    n_requests: int,
    scale: float,
    max_len: int,
    max_tokens: int | None = None,
) -> list[BenchRequest]:
    """The first ``n_requests`` requests whose prompt fits ``max_len`` (longer ones are skipped;
    outputs are cut so prompt + output <= max_len), arrival times relative to the first one."""
    if scale <= 0 or n_requests <= 0 or max_len <= 1:
        raise BenchError("--scale, --requests and --max-len must be positive (max-len > 1)")
    out: list[BenchRequest] = []
    start_ms: float | None = None
    for req in source:
        ids = materialize(req, scale)
        if len(ids) >= max_len:
            continue
        start_ms = req.arrival_ms if start_ms is None else start_ms
        n_out = min(output_tokens(req, scale, max_tokens), max_len - len(ids))
        arrival_s = (req.arrival_ms - start_ms) / 1000.0
        out.append(BenchRequest(len(out), arrival_s, tuple(ids), n_out))
        if len(out) == n_requests:
            break
    if not out:
        raise BenchError(f"no request fits --max-len {max_len} at --scale {scale}")
    return out


#: Seed of the offline rows' warm-up prompts (``warmup_requests``).
WARMUP_SEED = 0xBE7C4


def warmup_requests(reqs: Sequence[BenchRequest], n: int) -> list[BenchRequest]:
    """The ``n`` (at least 1) uncached requests an offline row runs before the replay to time
    the machine: the workload's median prompt and output lengths, random token ids (seeded,
    so the simulator's prediction can replay them too: they teach a learning policy as the
    engine's run did)."""
    prompt_len = sorted(len(r.prompt_token_ids) for r in reqs)[len(reqs) // 2]
    out_len = sorted(r.max_tokens for r in reqs)[len(reqs) // 2]
    rng = random.Random(WARMUP_SEED)
    return [
        BenchRequest(
            i, 0.0, tuple(rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(prompt_len)), out_len
        )
        for i in range(max(1, n))
    ]


def time_scale_for_rate(requests: list[BenchRequest], rate_per_s: float, window: int = 0) -> float:
    """The factor on trace arrival times that makes the arrival rate ``rate_per_s``: the mean
    rate over the whole workload, or with ``window`` = K >= 1 the rate of its busiest K
    consecutive arrivals (the shortest span of K inter-arrival gaps)."""
    if rate_per_s <= 0:
        raise BenchError(f"--rate must be positive, got {rate_per_s}")
    if window < 0:
        raise BenchError(f"--load-window must be >= 0, got {window}")
    times = [r.arrival_s for r in requests]
    gaps = len(times) - 1 if not window else min(window, len(times) - 1)
    if gaps < 1:
        return 0.0
    span_s = min(times[i + gaps] - times[i] for i in range(len(times) - gaps))
    if span_s <= 0:
        if gaps < len(times) - 1:
            raise BenchError(
                f"the busiest {gaps} arrivals come at one instant: no time scale makes their "
                f"rate {rate_per_s:g}/s; pass a larger --load-window"
            )
        return 0.0  # every request at once
    return gaps / rate_per_s / span_s


def scaled_arrivals(requests: list[BenchRequest], time_scale: float) -> list[float]:
    """Arrival time of each request in seconds after the replay starts."""
    if time_scale < 0:
        raise BenchError(f"--time-scale must be >= 0, got {time_scale}")
    return [r.arrival_s * time_scale for r in requests]
