"""What the simulator predicts for a replayed row: same requests, budget, block size and costs.

The engine row reports its pool layout (:class:`PoolLayout`); the simulator (``sim/replay.py``)
then replays the very token ids the engine saw, in arrival order, one request at a time, with
the same policy object the engine's scheduler ran (``stock`` is modelled by the ``vllm`` policy,
vLLM's align mode, with evictions from vLLM's own free queue: ``SimPool(vllm_queue=N)``) over
the same index code (``core/index/``), snapshots where the engine takes
them (``core/policies.py::EngineAdmission``: vLLM's align mode and the answer ends the policy
keeps; a ``flop`` of its own would also take periodic checkpoints and exact ends the engine does
not), bytes counted in the engine's pages and a budget of the
engine's whole pool.

With ``in_flight=None`` that is the one-request-at-a-time replay with the whole pool, which
ignores what the requests in flight take: their pages, and their blocks computed in the same
step. With ``in_flight=N`` (``bench replay`` passes the engine's mean running count,
:func:`engine_running`, or over HTTP :func:`engine_in_flight`) the simulator keeps N requests
in flight (``sim/replay.py``): each holds its path and blocks until N more have been
admitted (not its snapshots: vLLM's align mode frees a running request's state blocks once it
has computed past them, ``MambaManager.remove_skipped_blocks``, so ``hold_snapshots=False``),
plus its running state and last partial block outside the cache (``running_bytes``: one page
per group, vLLM's align mode), and what it inserted is visible from the next request on. The
waiting requests' paths go to the index's lookahead, as the engine's scheduler passes its
waiting queue's (:func:`engine_waiting`). Measured against the engine in
docs/bench_replay.md. A prompt's state is kept at its last full ``hash_tokens`` boundary below
the prompt end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vllm_hybrid.bench.workload import BenchRequest, warmup_requests
from vllm_hybrid.core import (
    POLICIES,
    STOCK,
    CostModel,
    EngineAdmission,
    load_shape,
    optional_snapshots_fit,
    shape_name_for_model_type,
)
from vllm_hybrid.sim.replay import replay
from vllm_hybrid.sim.trace import KeyedRequest, SimRequest

#: The simulator's model of each bench row that is not a core policy name.
SIM_POLICY = {STOCK: "vllm"}


@dataclass(frozen=True)
class PoolLayout:
    """An engine's KV pool as the cost model sees it: one page per group per block."""

    blocks: int
    block_tokens: int
    page_bytes: int
    kv_groups: int
    state_groups: int
    model_type: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> PoolLayout:
        return cls(**obj)

    def cache_bytes(self) -> int:
        """The bytes the engine's cache can use: every block but vLLM's null block
        (``BlockPool.__init__`` takes block 0 off the free queue as ``null_block``, the
        placeholder of skipped and not-yet-computed blocks)."""
        return max(self.blocks - 1, 0) * self.page_bytes

    def cost_model(self) -> CostModel:
        shape = load_shape(shape_name_for_model_type(self.model_type))
        kv, state = self.kv_groups * self.page_bytes, self.state_groups * self.page_bytes
        return CostModel.from_pages(shape, self.block_tokens, kv, state)


def sim_requests_exact(reqs: Sequence[BenchRequest]) -> list[SimRequest]:
    """The requests with one segment per token (a prompt token's content id is its token id,
    an answer token's unique to its prompt and place): every prefix, inside a block too, has
    the key of its tokens, so exact-position states (an engine with a match unit below the
    block) are matched where the engine's token hashes would match. ``exact_end``: the answer's
    end can be matched (by the next turn that extends it; none in a replay's workloads)."""
    out: list[SimRequest] = []
    for r in reqs:
        ids = r.prompt_token_ids
        segments = tuple((tok, 1) for tok in ids)
        if r.max_tokens > 1:
            segments += tuple((hash(("answer", ids, j)), 1) for j in range(r.max_tokens - 1))
        out.append(SimRequest(r.arrival_s * 1000.0, segments, len(ids), r.max_tokens, True))
    return out


def sim_requests(reqs: Sequence[BenchRequest], block_tokens: int) -> list[SimRequest]:
    """The requests as the engine caches them: one segment per block of prompt token ids (its
    content id is the hash of those ids), so two prompts share block keys exactly when they
    share the block's token prefix, as in the engine; then what the engine computed of the
    answer (``max_tokens - 1`` tokens: the last sampled one is never computed), whose full
    blocks vLLM caches too. The answer's content id is the prompt's (greedy decoding of one
    prompt gives one answer), so it never matches another prompt: the engine's answers do not
    reappear in later prompts of a replay. The last partial block is not matchable (a state is
    kept only at a block boundary)."""
    out: list[SimRequest] = []
    for r in reqs:
        ids = r.prompt_token_ids
        blocks = [ids[i : i + block_tokens] for i in range(0, len(ids), block_tokens)]
        segments = tuple((hash(block), len(block)) for block in blocks)
        if r.max_tokens > 1:
            segments += ((hash(("answer", ids)), r.max_tokens - 1),)
        out.append(
            SimRequest(r.arrival_s * 1000.0, segments, len(ids), r.max_tokens, exact_end=False)
        )
    return out


#: vLLM 0.32's ``max_num_seqs`` for a CPU ``vllm serve`` when none is given
#: (``EngineArgs.get_batch_defaults``: 128 for the API server, 256 for the ``LLM`` class; the
#: offline replay always passes ``--max-num-seqs``, default 16).
SERVER_MAX_NUM_SEQS = 128


def engine_in_flight(arrivals_s: Sequence[float], latencies_s: Sequence[float], cap: int) -> int:
    """The engine's concurrency for the simulator: the mean over requests of how many were in
    the engine when it arrived (itself included, finished ones not), each count capped at
    ``cap`` (``max_num_seqs``: the rest wait in the queue and hold no pages), rounded; >= 1."""
    if not arrivals_s:
        return 1
    ends = [a + lat for a, lat in zip(arrivals_s, latencies_s, strict=True)]
    counts = [
        min(cap, sum(1 for a2, e2 in zip(arrivals_s, ends, strict=True) if a2 <= a < e2))
        for a in arrivals_s
    ]
    return _rounded_mean(counts)


def engine_running(running_at_start: Sequence[int | None]) -> int | None:
    """The engine's concurrency as its scheduler saw it: the mean over requests of how many
    were running just after the step that first scheduled each (``RequestRecord.
    running_at_start``, offline rows), rounded, >= 1; None where no request has the count
    (rows replayed over HTTP). Unlike :func:`engine_in_flight` it does not count requests
    that wait for pages the pool cannot give them."""
    counts = [n for n in running_at_start if n is not None]
    return _rounded_mean(counts) if counts else None


def engine_waiting(arrivals_s: Sequence[float], ttfts_s: Sequence[float]) -> list[int]:
    """Per request, how many later requests were waiting when the engine served it: those that
    had arrived by its first token (its blocks were allocated, and pages evicted for them,
    before it). With every request arriving at once (``--time-scale 0``), all later ones. The
    simulator passes their paths to the index's lookahead, as the engine's scheduler passes
    its waiting queue's (``sim/replay.py``): the run of later requests, in order, up to the
    first that had not arrived yet (the simulator takes the next ``n`` of them)."""
    if len(arrivals_s) != len(ttfts_s):
        raise ValueError(f"{len(arrivals_s)} arrivals for {len(ttfts_s)} first-token times")
    out = []
    for i, (a, ttft) in enumerate(zip(arrivals_s, ttfts_s, strict=True)):
        until, j = a + ttft, i + 1
        while j < len(arrivals_s) and arrivals_s[j] <= until:
            j += 1
        out.append(j - i - 1)
    return out


def _rounded_mean(counts: Sequence[int]) -> int:
    """The mean of ``counts`` (not empty), rounded half up, at least 1."""
    return max(1, math.floor(sum(counts) / len(counts) + 0.5))


def running_bytes(layout: PoolLayout) -> int:
    """What a running request holds outside the cache in vLLM's align mode: its running state
    (one page per Mamba group) and its last, partial KV block (one page per attention group)."""
    return (layout.state_groups + layout.kv_groups) * layout.page_bytes


def sim_in_flight(layout: PoolLayout, in_flight: int) -> int:
    """The requests in flight the simulator runs with when asked for ``in_flight``: at most as
    many as leave half the pool to the cache after their running pages (at least 1)."""
    budget = layout.cache_bytes()
    return max(1, min(in_flight, budget // (2 * running_bytes(layout))))


def predict_hit_rate(
    reqs: Sequence[BenchRequest],
    layout: PoolLayout,
    policy: str,
    in_flight: int | None = None,
    warmup: int = 0,
    waiting: Sequence[int] | None = None,
    hits_out: list[int] | None = None,
    match_unit: int | None = None,
    max_num_seqs: int | None = None,
) -> float | None:
    """The simulator's token hit rate for row ``policy`` (None for rows it cannot model).
    ``in_flight=None``: one request at a time with the whole pool (the original prediction);
    N: N requests in flight (module docstring), at most as many as leave half the pool to the
    cache after their running pages (:func:`sim_in_flight`). ``warmup``: the row's engine
    first served that many warm-up requests (``workload.warmup_requests``) and then reset its
    cache; the simulator does the same with the same policy object (a learning policy keeps
    what they taught it, as the engine's does). ``waiting``: per request, how many later ones
    were waiting when the engine served it (:func:`engine_waiting`), for the lookahead of rows
    whose engine runs the index (every row but ``stock``, whose cache is vLLM's).
    ``hits_out``: each request's predicted hit tokens are appended to it (not the warm-up's).
    ``stock`` is replayed with vLLM's own free queue (``sim/pool.py``, ``vllm_queue``): pages
    evicted one at a time in the order vLLM frees them, recomputed blocks' old pages kept.
    ``match_unit`` (opt-in, not yet the default: docs/results/2026-12-07-parity.md): the
    engine's prefix match unit for rows other than ``stock`` (ours: 1); below the block the
    requests are keyed per token (:func:`sim_requests_exact`) and the engine's sub-block states
    are taken (``EngineAdmission`` at that unit: vLLM's prompt checkpoint at ``P - 1`` where it
    is exported, the block boundary after a sub-block hit, the prompt-floor stop where the
    pool fits optional stops, the answer's exact end). Not modelled yet: exact-junction stops,
    vLLM's KV-only prompt-tail entries, a partial block's KV as one page shared by its keys.
    ``max_num_seqs``: the engine's; its running slots left beyond the ``in_flight`` ones are
    the waiting requests a request of a row other than ``stock`` ends chunks for where they
    diverge (``sibling_wait``, the engine's default; ``sim/replay.py``; with ``waiting``
    only; None: none left)."""
    name = SIM_POLICY.get(policy, policy)
    if name not in POLICIES:
        return None
    cost = layout.cost_model()
    ranker = POLICIES[name](cost)
    unit = layout.block_tokens if policy == STOCK else (match_unit or layout.block_tokens)

    def optional_fit(prompt: int) -> bool:
        return optional_snapshots_fit(
            prompt, layout.block_tokens, layout.kv_groups, layout.state_groups, layout.blocks
        )

    admission = EngineAdmission(ranker, unit, optional_fit if unit < layout.block_tokens else None)
    budget = layout.cache_bytes()
    n = 1 if in_flight is None else sim_in_flight(layout, in_flight)
    run = 0 if in_flight is None else running_bytes(layout)
    slots = 0 if max_num_seqs is None or policy == STOCK else max(max_num_seqs - n, 0)

    lookahead = None if policy == STOCK else waiting

    def serve(
        batch: Sequence[BenchRequest],
        first: int,
        ahead: Sequence[int] | None,
        out: list[int] | None = None,
    ) -> float:
        sims = (
            sim_requests_exact(batch)
            if unit < layout.block_tokens
            else sim_requests(batch, layout.block_tokens)
        )
        keyed = [KeyedRequest(r, layout.block_tokens) for r in sims]
        stats = replay(
            keyed,
            cost,
            ranker,
            budget,
            in_flight=n,
            running_bytes=run,
            hold_snapshots=False,  # vLLM frees a running request's passed states
            admission=admission,
            first_index=first,
            waiting=ahead,
            # stock: vLLM's pool evicts, page by page from its free queue (sim/pool.py)
            vllm_queue=layout.state_groups if policy == STOCK else 0,
            hits_out=out,
            sibling_slots=slots if ahead is not None else 0,
        )
        return stats.token_hit_rate

    warm = warmup_requests(reqs, warmup) if warmup else []
    if warm:
        serve(warm, 0, None)  # then a fresh pool: the engine resets its prefix cache
    return serve(reqs, len(warm), lookahead, hits_out)
