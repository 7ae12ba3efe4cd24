"""Drive vLLM 0.32.0's schedulers the way ``EngineCore`` does, with a fake model and no GPU.

vLLM's CPU backend forces ``async_scheduling=False`` (``vllm/platforms/cpu.py``), so an engine on
this machine never runs ``AsyncScheduler`` (or our ``HybridAsyncScheduler``). This harness runs
the scheduler alone, as ``EngineCore`` would on a GPU:

* :class:`EngineLoop` mirrors ``vllm/v1/engine/core.py``: ``EngineCore.step_with_batch_queue``
  with ``batch_queue_size = VllmConfig.max_concurrent_batches`` (2 under async scheduling, V1
  runner, no PP), so ``schedule()`` of step n+1 runs before ``update_from_output()`` of step n;
  aborts arrive between steps (``EngineCore.abort_requests`` from the input queue) or just before
  ``update_from_output`` (``EngineCore._process_aborts_queue``).
* :class:`FakeWorker` mirrors the parts of ``vllm/v1/worker/gpu_model_runner.py``
  (``GPUModelRunner._update_states``) that decide which tokens and blocks a step uses: finished
  requests dropped, ``new_block_ids_to_zero`` zeroed, ``kv_cache_block_copies`` applied
  (``vllm/v1/worker/utils.py::copy_kv_cache_blocks_inplace``), new requests from their prompt,
  cached ones extended (or, resumed, given new block tables), and a request that was not in the
  previous step's batch recovering its output tokens from ``CachedRequestData.all_token_ids``
  (the async-scheduling branch). Steps execute in scheduling order, as on a GPU stream.
* The fake model really reads and writes the blocks it is given: attention blocks hold, per
  slot, a digest of the sequence up to that token; each Mamba group's state (align mode, as in
  ``vllm/v1/worker/mamba_utils.py``: read from block column ``ceil(computed/B) - 1``, written to
  column ``ceil((computed + scheduled)/B) - 1``) holds a digest of the sequence up to where it
  was computed. A sampled token is a function of what it read, so a block handed out with the
  wrong content (a wrong prefix hit, a block reused while still held) changes the output, and
  :func:`expected_output` gives the right output from the token ids alone.

Oracles checked as it runs (``AssertionError``): the worker never touches a block the pool
holds as free (``ref_cnt == 0``) nor one another request of the same step writes; no
``ref_cnt`` is negative; every prefix-cache hit's blocks hold the request's block hashes
(``KVCacheManager.get_computed_blocks`` wrapped); with ``check`` the hybrid pool's integrity
after every ``schedule`` and ``update_from_output``.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MOD = (1 << 61) - 1
VOCAB = 1000
GARBAGE = -7  # what a block read gives when it does not hold what the model expects there


def roll(h: int, token: int) -> int:
    """The digest of a sequence one token longer (the 'state' after ``token``)."""
    return (h * 1_000_003 + token + 1) % MOD


def mix(h: int, v: int) -> int:
    return (h * 998_244_353 + v + 12345) % MOD


def sample(mamba_states: list[int], attention: list[int]) -> int:
    """The fake model's token from what it read: each Mamba group's new state and, per
    attention block, the value at its last position read."""
    x = 17
    for v in mamba_states:
        x = mix(x, v)
    for v in attention:
        x = mix(x, v)
    return 10 + x % VOCAB


def prefix_digests(tokens: list[int]) -> list[int]:
    """``d[p]`` = digest of ``tokens[:p]``."""
    d = [0]
    for t in tokens:
        d.append(roll(d[-1], t))
    return d


def token_at(digests: list[int], end: int, block: int, n_mamba: int) -> int:
    """The token sampled after ``end`` tokens when every block read holds what it should."""
    attention = [digests[min(end, (k + 1) * block)] for k in range((end + block - 1) // block)]
    return sample([digests[end]] * n_mamba, attention)


def expected_output(prompt: list[int], max_tokens: int, block: int, n_mamba: int) -> list[int]:
    """The output of a request, independently of scheduling and caching."""
    tokens = list(prompt)
    digests = prefix_digests(tokens)
    out: list[int] = []
    while len(out) < max_tokens:
        t = token_at(digests, len(tokens), block, n_mamba)
        out.append(t)
        tokens.append(t)
        digests.append(roll(digests[-1], t))
    return out


# ------------------------------------------------------------------------------------ config
def build_vllm_config(
    model_dir: str | Path,
    *,
    prefix_caching: bool,
    block_tokens: int,
    num_blocks: int,
    max_num_seqs: int,
    max_batched_tokens: int,
    async_scheduling: bool = True,
    hybrid: dict[str, Any] | None = None,
    max_model_len: int = 4096,
    **cache_args: Any,
) -> Any:
    """A real ``VllmConfig`` from the tiny model dir (also ``benchmarks/bench_scheduler.py``'s)
    with ``num_blocks`` blocks in align mode; ``async_scheduling`` set afterwards, as a GPU
    platform would leave it (the CPU platform's ``check_and_update_config`` turns it off).
    ``cache_args``: more ``EngineArgs`` (e.g. ``prefix_match_unit``,
    ``prefix_caching_hash_algo``)."""
    from vllm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs(
        model=str(model_dir),
        enable_prefix_caching=prefix_caching,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched_tokens,
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_model_len,
        block_size=block_tokens,
        async_scheduling=async_scheduling,
        additional_config={"vllm_hybrid": hybrid} if hybrid else {},
        **cache_args,
    )
    config = engine_args.create_engine_config()
    config.scheduler_config.async_scheduling = async_scheduling
    config.cache_config.mamba_cache_mode = "align"
    config.cache_config.mamba_block_size = block_tokens
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def build_kv_cache_config(
    block_tokens: int,
    num_blocks: int,
    mamba_groups: int,
    state_shapes: tuple[tuple[int, ...], ...] = ((3, 64), (4, 16, 32)),
    checkpoint_blocks: int = 0,
) -> Any:
    """One ``FullAttentionSpec`` group and ``mamba_groups`` ``MambaSpec`` groups (align mode,
    states of ``state_shapes``), one page size (also ``benchmarks/bench_scheduler.py``'s).
    ``checkpoint_blocks``: ``MambaSpec.num_prefill_checkpoint_blocks`` (1 on vLLM's CPU engine
    with the plugin's checkpoint store, alignment 1: a prefill keeps the state of its last
    block boundary in the step that computes past it, instead of ending a chunk there)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    b = block_tokens
    attn = FullAttentionSpec(block_size=b, num_kv_heads=4, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.1.attn", "model.layers.4.attn"], attn)]
    for g in range(mamba_groups):
        mamba = MambaSpec(
            block_size=b,
            shapes=state_shapes,
            dtypes=(torch.float32,) * len(state_shapes),
            page_size_padded=attn.page_size_bytes,
            mamba_cache_mode="align",
            num_prefill_checkpoint_blocks=checkpoint_blocks,
            prefill_checkpoint_alignment=1 if checkpoint_blocks else None,
        )
        groups.append(KVCacheGroupSpec([f"model.layers.{g}.mamba"], mamba))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def build_scheduler(
    kind: str,
    model_dir: str | Path,
    *,
    prefix_caching: bool = True,
    block_tokens: int = 16,
    num_blocks: int = 64,
    mamba_groups: int = 2,
    max_num_seqs: int = 8,
    max_batched_tokens: int = 48,
    policy: str = "flop",
    debug: bool = True,
    prefix_match_unit: int | None = None,
    exact_prompt_end: bool = True,
) -> tuple[Any, Callable[[Any], Any]]:
    """(scheduler, block hasher). ``kind``: ``stock`` (vLLM's ``AsyncScheduler``) or
    ``hybrid`` (``HybridAsyncScheduler`` with ``policy``, debug checks on).
    ``exact_prompt_end`` is on here (the engine's default is off): the fake worker has no
    kernels, so the prompt-end states at ``P - 1`` and their sub-block hits are exercised."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vllm_hybrid.adapters.vllm.scheduler import HybridAsyncScheduler

    hybrid: dict[str, Any] = {"policy": "stock"}
    if kind == "hybrid":
        hybrid = {"policy": policy, "debug": debug, "exact_prompt_end": exact_prompt_end}
    config = build_vllm_config(
        model_dir,
        prefix_caching=prefix_caching,
        block_tokens=block_tokens,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        hybrid=hybrid,
    )
    if prefix_match_unit is not None:  # sub-block hits (hash blocks below the block)
        config.cache_config.prefix_match_unit = prefix_match_unit
    kv_config = build_kv_cache_config(block_tokens, num_blocks, mamba_groups)
    cls = HybridAsyncScheduler if kind == "hybrid" else AsyncScheduler
    sched, hash_block_size = construct_scheduler(cls, config, kv_config)
    if kind == "hybrid" and prefix_caching and getattr(sched, "hybrid_pool", None) is None:
        raise RuntimeError("HybridAsyncScheduler did not activate on this KV cache config")
    hash_fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return sched, get_request_block_hasher(hash_block_size, hash_fn)


def construct_scheduler(cls: type, config: Any, kv_config: Any) -> tuple[Any, int]:
    """``cls(...)`` (vLLM's ``Scheduler``/``AsyncScheduler`` or ours) as ``EngineCore`` builds
    it (``vllm/v1/engine/core.py``): block sizes resolved from the KV cache config; returns
    (scheduler, hash block size)."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.structured_output import StructuredOutputManager

    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, config)
    kv_config.hash_block_size = hash_block_size
    sched = cls(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )
    return sched, hash_block_size


# ------------------------------------------------------------------------------------ worker
@dataclass
class _WorkerRequest:
    tokens: list[int]
    num_prompt: int
    block_ids: list[list[int]]
    digests: list[int] = field(default_factory=list)

    def digest(self, p: int) -> int:
        while len(self.digests) <= p:
            i = len(self.digests) - 1
            self.digests.append(roll(self.digests[-1], self.tokens[i]))
        return self.digests[p]

    def set_outputs(self, outputs: list[int]) -> None:
        del self.tokens[self.num_prompt :]
        self.tokens.extend(outputs)
        del self.digests[self.num_prompt + 1 :]


class FakeWorker:
    """The model runner's request states (``GPUModelRunner._update_states``) and a fake model
    that reads and writes the KV cache blocks by id (``mem``: one content per block id, as the
    groups' tensors share block ids)."""

    def __init__(self, sched: Any) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec

        self.sched = sched
        groups = sched.kv_cache_config.kv_cache_groups
        self.mamba = [isinstance(g.kv_cache_spec, MambaSpec) for g in groups]
        self.block = groups[0].kv_cache_spec.block_size
        self.pool = sched.kv_cache_manager.block_pool
        self.requests: dict[str, _WorkerRequest] = {}
        self.batch: set[str] = set()  # the persistent batch: last step's requests
        #: ``InputBatch.prev_sampled_token_ids``: last step's sampled tokens, which only the
        #: device holds under async scheduling (the CPU state gets -1)
        self.prev_sampled: dict[str, int] = {}
        self.mem: dict[int, tuple[str, Any]] = {}
        self.steps = 0
        self.copies = 0  # kv_cache_block_copies applied

    # what the model reads / writes
    def _read_attention(self, block_id: int, slot: int, group: int) -> int:
        content = self.mem.get(block_id)
        if content is None or content[0] != f"a{group}":
            return GARBAGE
        value: int = content[1][slot]
        return value

    def _write_attention(self, block_id: int, slot: int, group: int, value: int) -> None:
        if block_id == 0:
            raise AssertionError("attention write to the null block")
        content = self.mem.get(block_id)
        if content is None or content[0] != f"a{group}":
            content = (f"a{group}", [GARBAGE] * self.block)
            self.mem[block_id] = content
        content[1][slot] = value

    def _read_state(self, block_id: int, group: int) -> int:
        content = self.mem.get(block_id)
        if block_id == 0 or content is None or content[0] != f"m{group}":
            return GARBAGE
        value: int = content[1]
        return value

    def execute(self, out: Any) -> Any:
        """One step: ``_update_states`` then the fake forward; returns the
        ``ModelRunnerOutput`` (sampled tokens for requests whose computed tokens reach their
        known tokens, none for partial prefills)."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        self.steps += 1
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            self.batch.discard(req_id)
        for block_id in out.new_block_ids_to_zero or ():
            self.mem.pop(block_id, None)
        for src, dst in out.kv_cache_block_copies or ():
            self.copies += 1
            content = self.mem.get(src)
            if content is None:
                self.mem.pop(dst, None)
            else:
                self.mem[dst] = (
                    content[0],
                    list(content[1]) if content[0][0] == "a" else content[1],
                )
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids)
            self.requests[new.req_id] = _WorkerRequest(
                prompt, len(prompt), [list(ids) for ids in new.block_ids], [0]
            )
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            computed[req_id] = cached.num_computed_tokens[i]
            num_output = cached.num_output_tokens[i]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # _update_states: resumed requests leave the persistent batch (a same-step
                # resume after reset_prefix_cache(reset_running_requests=True) was in it)
                self.batch.discard(req_id)
                assert new_ids is not None
                state.block_ids = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for ids, more in zip(state.block_ids, new_ids, strict=True):
                    ids.extend(more)
            if num_output < len(state.tokens) - state.num_prompt:
                # outputs the scheduler dropped (e.g. a reset's stale output): cut the state
                state.set_outputs(state.tokens[state.num_prompt : state.num_prompt + num_output])
            if req_id not in self.batch and num_output > 0:
                # the async-scheduling recovery: the CPU state holds -1 for sampled tokens
                state.set_outputs(cached.all_token_ids[req_id][-num_output:])
        # _prepare_input_ids: a request of the last step takes its sampled token from the
        # device; one that left the batch has only the -1 (until all_token_ids recovers it)
        for req_id in out.num_scheduled_tokens:
            token = self.prev_sampled.get(req_id)
            if token is not None and req_id in self.batch:
                state = self.requests[req_id]
                assert state.tokens[-1] == -1, f"{req_id}: no placeholder for the sampled token"
                state.tokens[-1] = token
        self.prev_sampled = {}
        self.batch = set(out.num_scheduled_tokens)
        if not out.num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self._check_blocks(out, computed)
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            sampled.append(
                self._forward(req_id, computed[req_id], out.num_scheduled_tokens[req_id])
            )
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    def _forward(self, req_id: str, start: int, n: int) -> list[int]:
        state = self.requests[req_id]
        end = start + n
        assert end <= len(state.tokens), (
            f"{req_id}: scheduled up to {end} tokens, the worker knows {len(state.tokens)}"
        )
        b = self.block
        attention: list[int] = []
        states: list[int] = []
        for g, table in enumerate(state.block_ids):
            if self.mamba[g]:
                h = 0 if start == 0 else self._read_state(table[(start + b - 1) // b - 1], g)
                for t in state.tokens[start:end]:
                    h = roll(h, t)
                dst = table[(end + b - 1) // b - 1]
                if dst != 0:
                    self.mem[dst] = (f"m{g}", h)
                states.append(h)
            else:
                for p in range(start, end):
                    self._write_attention(table[p // b], p % b, g, state.digest(p + 1))
                for k in range((end + b - 1) // b):
                    last = min(end, (k + 1) * b) - 1
                    attention.append(self._read_attention(table[k], last % b, g))
        if end < len(state.tokens):
            return []  # a partial prefill: nothing sampled
        token = sample(states, attention)
        state.tokens.append(-1)  # async: the CPU state holds a placeholder
        self.prev_sampled[req_id] = token
        return [token]

    def _check_blocks(self, out: Any, computed: dict[str, int]) -> None:
        """No block this step reads or writes is free in the pool, and no block is written by
        two requests, nor written by one and read by another, in one step."""
        b = self.block
        blocks = self.pool.blocks
        writers: dict[int, str] = {}
        readers: dict[int, set[str]] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start, end = computed[req_id], computed[req_id] + n
            for g, table in enumerate(state.block_ids):
                if self.mamba[g]:
                    used = {table[(end + b - 1) // b - 1]}
                    if start:
                        readers.setdefault(table[(start + b - 1) // b - 1], set()).add(req_id)
                    written = used
                else:
                    used = set(table[: (end + b - 1) // b])
                    written = {table[p // b] for p in range(start, end)}
                    for block_id in used - written:
                        readers.setdefault(block_id, set()).add(req_id)
                for block_id in used | written:
                    if block_id == 0:
                        continue
                    assert blocks[block_id].ref_cnt > 0, (
                        f"step {self.steps}: {req_id} uses block {block_id} (group {g}), "
                        f"free in the pool (ref_cnt {blocks[block_id].ref_cnt})"
                    )
                for block_id in written - {0}:
                    other = writers.setdefault(block_id, req_id)
                    assert other == req_id, (
                        f"step {self.steps}: block {block_id} written by {other} and {req_id}"
                    )
        for block_id, who in readers.items():
            writer = writers.get(block_id)
            assert writer is None or who <= {writer}, (
                f"step {self.steps}: block {block_id} written by {writer}, read by {who}"
            )


# ------------------------------------------------------------------------------------ workload
@dataclass
class Spec:
    """One request of a workload."""

    req_id: str
    prompt: list[int]
    max_tokens: int
    arrival_step: int
    cache_salt: str | None = None
    abort_after: int | None = None  # abort once the client has this many output tokens
    #: ``SamplingParams.extra_args`` (cache breakpoints, pins, reports: ``cache_control.py``)
    extra_args: dict[str, Any] | None = None


def make_workload(
    seed: int,
    n: int,
    *,
    block_tokens: int = 16,
    prefixes: int = 3,
    mamba_groups: int = 2,
    salts: tuple[str, ...] = ("salt-a", "salt-b"),
    cache_options: bool = False,
) -> list[Spec]:
    """``n`` requests, 0-2 arriving per step: shared prefixes of 2-3 blocks with unique tails
    (prefix hits), some repeated prompts (whole-prompt hits), some next turns of earlier
    requests (their prompt + expected answer + more: hits on end-of-output states), a quarter
    salted, a sixth aborted after 0-3 output tokens; with ``cache_options``, 40% ask for a
    cache report, most of those with breakpoints, some with a pin (``cache_control.py``)."""
    rng = random.Random(seed)
    options = random.Random(seed + 1_000_003)  # its own stream: the rest stays as without
    bases = [
        [rng.randrange(10, 30000) for _ in range(rng.randint(2, 3) * block_tokens)]
        for _ in range(prefixes)
    ]
    specs: list[Spec] = []
    step = 0
    for i in range(n):
        roll_ = rng.random()
        if specs and roll_ < 0.15:
            prompt = list(rng.choice(specs).prompt)  # the same prompt again
        elif specs and roll_ < 0.35:  # a next turn: an earlier prompt + its answer + more
            prev = rng.choice(specs)
            answer = expected_output(prev.prompt, prev.max_tokens, block_tokens, mamba_groups)
            tail = [rng.randrange(10, 30000) for _ in range(rng.randint(1, 20))]
            prompt = prev.prompt + answer + tail
        else:
            tail = [rng.randrange(10, 30000) for _ in range(rng.randint(1, 40))]
            prompt = rng.choice(bases) + tail
        salt = rng.choice(salts) if salts and rng.random() < 0.25 else None
        abort = rng.randint(0, 3) if rng.random() < 0.17 else None
        extra: dict[str, Any] | None = None
        if cache_options and options.random() < 0.4:
            extra = {"cache_report": True}
            if options.random() < 0.7:  # breakpoints inside the prompt (also past its end)
                extra["cache_breakpoints"] = sorted(
                    {options.randint(1, len(prompt) + 8) for _ in range(options.randint(1, 3))}
                )
            if options.random() < 0.4:
                extra["cache_pin_ttl_s"] = options.choice((0.0, 60.0))
        specs.append(Spec(f"r{i}", prompt, rng.randint(2, 24), step, salt, abort, extra))
        step += rng.choice((0, 1, 1, 2))
    return specs


# ------------------------------------------------------------------------------------ engine
@dataclass
class Hit:
    req_id: str
    tokens: int


class EngineLoop:
    """``EngineCore`` with a batch queue (``step_with_batch_queue``) around ``sched`` and a
    :class:`FakeWorker`; records what the client would receive."""

    def __init__(self, sched: Any, hasher: Callable[[Any], Any], *, check: bool = True) -> None:
        self.sched = sched
        self.hasher = hasher
        self.worker = FakeWorker(sched)
        self.queue_size = sched.vllm_config.max_concurrent_batches
        self.queue: deque[tuple[Any, Any]] = deque()
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, Any] = {}
        self.aborted: set[str] = set()
        self.hits: list[Hit] = []
        #: ``EngineCoreOutput.prefill_stats.num_cached_tokens`` (first output of a request)
        self.cached_tokens: dict[str, int] = {}
        self.hybrid_checks = 0
        self.preemptions = 0
        self.resets = 0
        self.steps = 0
        self.check = check
        self._wrap_lookup()

    def _wrap_lookup(self) -> None:
        """Every prefix-cache hit's blocks must hold the request's block hashes right then
        (``compat.observe_prefix_lookups``)."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        from vllm_hybrid.adapters.vllm.compat.scheduler import observe_prefix_lookups

        manager = self.sched.kv_cache_manager
        pool = manager.block_pool
        b = self.worker.block
        step = b // pool.hash_block_size

        def checked(request: Any, blocks: Any, hit: int) -> None:
            if hit <= 0:
                return
            self.hits.append(Hit(request.request_id, hit))
            for g, group_blocks in enumerate(blocks.blocks):
                for i, block in enumerate(group_blocks[: hit // b]):
                    if block.is_null:
                        assert self.worker.mamba[g], f"null attention block in a hit at {i}"
                        continue
                    key = make_block_hash_with_group_id(request.block_hashes[(i + 1) * step - 1], g)
                    held = {
                        block.block_hash,
                        *pool.cached_block_hashes_by_block.get(block.block_id, ()),
                    }
                    assert key in held, (
                        f"{request.request_id}: hit block {block.block_id} (group {g}, "
                        f"index {i}) does not hold the request's block hash"
                    )
                    assert pool.cached_block_hash_to_block.contain(key, block.block_id)

        if not observe_prefix_lookups(manager, checked):
            raise RuntimeError("the scheduler harness needs vLLM 0.32.0")

    def add(self, spec: Spec) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(
            max_tokens=spec.max_tokens,
            ignore_eos=True,
            temperature=0.0,
            extra_args=dict(spec.extra_args) if spec.extra_args else None,
        )
        self.outputs[spec.req_id] = []
        self.sched.add_request(
            Request(
                request_id=spec.req_id,
                prompt_token_ids=list(spec.prompt),
                sampling_params=params,
                pooling_params=None,
                arrival_time=float(spec.arrival_step),
                cache_salt=spec.cache_salt,
                block_hasher=self.hasher,
            )
        )

    def abort(self, req_ids: list[str]) -> None:
        from vllm.v1.request import RequestStatus

        live = [r for r in req_ids if r not in self.finish and r not in self.aborted]
        if live:
            self.aborted.update(live)
            self.sched.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            self._after("finish_requests")

    def _after(self, what: str) -> None:
        pool = self.sched.kv_cache_manager.block_pool
        negative = [b.block_id for b in pool.blocks if b.ref_cnt < 0 and not b.is_null]
        assert not negative, f"after {what}: negative ref_cnt on blocks {negative}"
        hybrid = getattr(self.sched, "hybrid_pool", None)
        if self.check and hybrid is not None:
            hybrid.hy_check_integrity()
            self.hybrid_checks += 1

    def _collect(self, engine_outputs: dict[int, Any]) -> None:
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.prefill_stats is not None:
                    self.cached_tokens[o.request_id] = o.prefill_stats.num_cached_tokens
                if o.finish_reason is not None:
                    self.finish[o.request_id] = o.finish_reason

    def step(self, late_aborts: Callable[[], list[str]] = list) -> bool:
        """``EngineCore.step_with_batch_queue``; ``late_aborts`` are processed where
        ``_process_aborts_queue`` runs (after the model, before ``update_from_output``).
        Returns whether a model step was scheduled."""
        sched, queue = self.sched, self.queue
        assert len(queue) < self.queue_size
        model_executed = False
        self.steps += 1
        if sched.has_requests():
            out = sched.schedule()
            self.preemptions += len(out.preempted_req_ids or ())
            self._after("schedule")
            result = self.worker.execute(out)
            model_executed = bool(out.total_num_scheduled_tokens > 0)
            queue.appendleft((result, out))
            if len(queue) < self.queue_size and (model_executed or sched.has_requests()):
                return model_executed
        elif not queue:
            return False
        result, out = queue.pop()
        self.abort(late_aborts())
        self._collect(sched.update_from_output(out, result))
        self._after("update_from_output")
        return model_executed


def run_workload(
    loop: EngineLoop,
    specs: list[Spec],
    max_steps: int = 5000,
    resets: frozenset[int] = frozenset(),
) -> EngineLoop:
    """Feed ``specs`` at their arrival steps, abort those with ``abort_after`` once the client
    has that many tokens (even ids between steps, odd ids at ``_process_aborts_queue``), reset
    the prefix cache with running requests preempted at the ``resets`` ticks, step until every
    request is finished or aborted."""
    pending = deque(sorted(specs, key=lambda s: s.arrival_step))
    by_id = {s.req_id: s for s in specs}
    tick = 0

    def due(parity: int) -> list[str]:
        ids = []
        for r, got in loop.outputs.items():
            after = by_id[r].abort_after
            if after is None or int(r[1:]) % 2 != parity or len(got) < after:
                continue
            if r not in loop.finish and r not in loop.aborted:
                ids.append(r)
        return ids

    while pending or loop.sched.has_requests() or loop.queue:
        assert tick < max_steps, "the engine did not drain"
        while pending and pending[0].arrival_step <= tick:
            loop.add(pending.popleft())
        loop.abort(due(0))  # EngineCore._process_input_queue: ABORT requests
        if tick in resets:  # EngineCore.reset_prefix_cache, a utility call between steps
            assert loop.sched.reset_prefix_cache(reset_running_requests=True)
            loop.resets += 1
            loop._after("reset_prefix_cache")
        if loop.sched.has_requests() or loop.queue:
            loop.step(lambda: due(1))
        tick += 1
    return loop


def make_conversations(
    seed: int,
    conversations: int,
    turns: int,
    *,
    block_tokens: int = 16,
    mamba_groups: int = 2,
    gap: int = 40,
) -> list[Spec]:
    """Multi-turn chats: turn t+1's prompt is turn t's prompt + its expected answer (20-40
    tokens, past block boundaries) + a new message; turns arrive ``gap`` steps apart, so the
    previous turn has usually finished and its end-of-output state may be hit."""
    rng = random.Random(seed)
    specs: list[Spec] = []
    for t in range(turns):
        for c in range(conversations):
            i = len(specs)
            message = [rng.randrange(10, 30000) for _ in range(rng.randint(5, 30))]
            if t == 0:
                prompt = message
            else:
                prev = specs[i - conversations]
                answer = expected_output(prev.prompt, prev.max_tokens, block_tokens, mamba_groups)
                prompt = prev.prompt + answer + message
            specs.append(Spec(f"r{i}", prompt, rng.randint(20, 40), t * gap + c))
    return specs
