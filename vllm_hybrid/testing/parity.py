"""vLLM's real scheduler with no model, for comparing the simulator with the engine per request.

:class:`ParityHarness` runs vLLM 0.32.0's synchronous ``Scheduler`` (as our ``HybridScheduler``,
the class a hybrid engine with prefix caching runs; ``policy: stock`` leaves the cache to vLLM)
over a KV cache config of the engine's shape, one request at a time as ``bench replay
--max-num-seqs 1 --time-scale 0`` serves them: the warm-up requests first, then a prefix-cache
reset, then every request waiting from the start. No model runs: a scheduled request whose
computed tokens reach its known tokens samples the next token of the output it is given (a
``bench replay --json`` record's ``output_token_ids``, so the answer blocks hash as the
engine's did), or a made-up one. The scheduler, the KV cache manager and the block pool are
vLLM's, so the hits are the engine's: on gen:agent (80 requests, 64 blocks, the small Zamba2's
layout) every request's ``num_cached_tokens`` equals the engine row's
(docs/results/2026-12-07-parity.md). ``tools/parity_diff.py`` prints the two side by side with
the eviction logs; ``tests/bench/test_parity.py`` holds the simulator to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hybrid.bench.workload import BenchRequest, warmup_requests


@dataclass(frozen=True)
class EngineShape:
    """The engine's pool as the scheduler sees it (the small Zamba2 on CPU by default: 128-token
    blocks, one attention group, six Mamba groups, a prefill checkpoint block, sparse state
    retention; 4,096 tokens a step, vLLM's CPU default). Page sizes do not matter to the
    scheduler; these fields are what differed from the engine's ``KVCacheConfig`` and changed
    hits."""

    blocks: int
    block_tokens: int = 128
    mamba_groups: int = 6
    checkpoint_blocks: int = 1
    #: ``KVCacheConfig.prefix_cache_retention_interval``: 0 in the engine (align mode keeps
    #: only the states at reachable boundaries; None would keep every block's)
    retention_interval: int | None = 0
    batched_tokens: int = 4096
    max_len: int = 4096


class ParityHarness:
    """vLLM's scheduler and a fake model; :attr:`hits` per request id, :attr:`log` of every
    block hash vLLM's pool dropped (request being scheduled, hash)."""

    def __init__(
        self,
        model_dir: str | Path,
        shape: EngineShape,
        policy: str = "stock",
        kv_config: Any = None,
    ) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        from vllm_hybrid.adapters.vllm.scheduler import HybridScheduler
        from vllm_hybrid.testing.sched_harness import (
            build_kv_cache_config,
            build_vllm_config,
            construct_scheduler,
        )

        config = build_vllm_config(
            model_dir,
            prefix_caching=True,
            block_tokens=shape.block_tokens,
            num_blocks=shape.blocks,
            max_num_seqs=1,
            max_batched_tokens=shape.batched_tokens,
            async_scheduling=False,
            # the engine's defaults: with one running slot sibling_wait takes no stops (no
            # waiting request can start beside the running one, core.sibling_stops)
            hybrid={"policy": policy},
            max_model_len=shape.max_len,
        )
        if kv_config is None:
            kv_config = build_kv_cache_config(
                shape.block_tokens,
                shape.blocks,
                shape.mamba_groups,
                checkpoint_blocks=shape.checkpoint_blocks,
            )
            kv_config.prefix_cache_retention_interval = shape.retention_interval
        self.sched, self.hash_block_size = construct_scheduler(HybridScheduler, config, kv_config)
        hash_fn = get_hash_fn_by_name(self.sched.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(self.hash_block_size, hash_fn)
        self.pool = self.sched.kv_cache_manager.block_pool
        self.outputs: dict[str, list[int]] = {}
        self.requests: dict[str, Any] = {}
        self.hits: dict[str, int] = {}
        self.current: str | None = None
        self.log: list[tuple[str | None, Any]] = []
        self._wrap_pool()

    def _wrap_pool(self) -> None:
        from vllm_hybrid.adapters.vllm.compat import observe_hash_removals

        log = self.log

        def removed(block: Any, keys: list[Any]) -> None:
            log.extend((self.current, h) for h in keys)

        observe_hash_removals(self.pool, removed)

    def add(self, rid: str, prompt: Sequence[int], max_tokens: int, outputs: Sequence[int]) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.outputs[rid] = list(outputs)
        self.requests[rid] = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=self.hasher,
        )
        self.sched.add_request(self.requests[rid])

    def step(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        sched = self.sched
        if sched.running:
            self.current = sched.running[0].request_id
        out = sched.schedule()
        for new in out.scheduled_new_reqs:
            self.current = new.req_id
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = sched.requests[rid]
            want, n = self.outputs[rid], req.num_output_tokens
            token = want[n] if n < len(want) else 10 + (7 * n + len(rid)) % 900
            sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
        result = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        for outputs in sched.update_from_output(out, result).values():
            for o in outputs.outputs:
                if o.prefill_stats is not None:
                    self.hits[o.request_id] = int(o.prefill_stats.num_cached_tokens)

    def drain(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_requests():
                return
            self.step()
        raise AssertionError("the scheduler did not drain")


def run_replay(
    model_dir: str | Path,
    reqs: Sequence[BenchRequest],
    shape: EngineShape,
    *,
    policy: str = "stock",
    warmup: int = 2,
    outputs: dict[int, Sequence[int]] | None = None,
    kv_config: Any = None,
) -> ParityHarness:
    """``bench replay``'s offline row, one request at a time (module docstring); the harness
    after it (``hits`` by request index as a string, ``log`` from the replay's start)."""
    h = ParityHarness(model_dir, shape, policy, kv_config)
    for w in warmup_requests(reqs, warmup) if warmup else []:
        h.add(f"warmup-{w.index}", w.prompt_token_ids, w.max_tokens, [])
        h.drain()
    assert h.sched.reset_prefix_cache()
    h.log.clear()
    outputs = outputs or {}
    for r in reqs:
        h.add(str(r.index), r.prompt_token_ids, r.max_tokens, outputs.get(r.index, ()))
    h.drain()
    return h


def engine_hits(h: ParityHarness, reqs: Sequence[BenchRequest]) -> list[int]:
    """Each request's hit tokens (``num_cached_tokens``), in order."""
    return [h.hits.get(str(r.index), 0) for r in reqs]
