"""Waiting for a sibling: a request whose prompt shares a prefix with one still computing it.

An attention-only model shares a prefix between two requests of the same step: vLLM caches a
request's blocks when it schedules them, and each layer writes the step's KV before any token
of the step reads it, so the second request's lookup finds the first one's blocks. A hybrid
cannot: the second request needs the recurrent state at the end of the shared prefix, which
exists only after the first request's chunk ending there has run. So two requests that arrive
together with the same system prompt, document or few-shot prefix (a burst, ``n`` prompts of
one batch, conversations started at once) both compute it, and the second one's lookup finds
its KV without a state. SGLang's scheduler meets the same problem for attention models in its
waiting queue ("in-batch prefix caching", ``schedule_policy.py``: of several waiting requests
that share a prefix only one is admitted, the others wait a step); here the prefix is still
being computed by a running request.

The rule (:class:`SiblingWaits`): a waiting request (the consumer) that shares at least a
block more of its prompt with a request still computing its prompt (the producer)
than the producer has computed waits, a step at a time, while the producer ends a chunk at
the point where the two prompts diverge (:func:`sibling_stop`) and keeps its state there; the
consumer then resumes from that state. Nothing is computed twice and nothing is lost: the
consumer's wait is the producer's prefill of the shared part, which it would otherwise have
computed itself beside it, sharing the same step budget. A consumer waits at most
:data:`MAX_SIBLING_WAITS` steps. To stop the producer at the junction in the very step it is
scheduled (the case of requests that arrive together), the producer looks at the first
waiting requests when it is scheduled, as many as can start beside it (the running slots
left, at most :data:`SIBLING_LOOKAHEAD`; :meth:`SiblingWaits.stops`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The most scheduler steps a waiting request waits for siblings (a bound, not a tuning knob:
#: a producer reaches its stop within a few steps unless it is preempted).
MAX_SIBLING_WAITS = 32
#: Waiting requests a request looks at when it is scheduled, for siblings to stop for.
SIBLING_LOOKAHEAD = 16
#: Distinct sibling stops one request takes at its lookup (each ends one prefill chunk).
MAX_SIBLING_STOPS = 2


def shared_hash_units(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading entries two requests' chained block hashes share (binary search).

    A chained hash covers every token before it, so the lists agree on a prefix and differ
    after it; the answer times the hash unit is the two prompts' common prefix in tokens,
    floored to the unit (``cache_salt`` and LoRA are in the chain, so different tenants share
    nothing)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def sibling_stop(
    shared_tokens: int,
    producer_done: int,
    producer_prompt: int,
    consumer_prompt: int,
    unit_tokens: int,
    block_tokens: int,
) -> int:
    """Where a producer (``producer_done`` of its ``producer_prompt`` tokens computed) ends a
    chunk and keeps a state for a consumer sharing its first ``shared_tokens`` tokens, or 0
    when that saves the consumer less than a block (the engine computes and keeps states by
    blocks: a smaller gain is not worth a chunk).

    The stop is floored to ``unit_tokens`` (where states can be kept) and lies at least two
    tokens before either prompt's end, so neither request is left a one-token prefill chunk (a
    one-token step runs through the engine's decode kernels; docs/reliability.md). Inside the
    block that holds the producer's last prompt token it is floored to the block: vLLM keeps
    one state page per block, and the producer's prompt-end state, which its decode then
    advances, takes that block's page (measured: a 640-token producer's state at 600 was gone
    when its sibling looked; ``vllm/v1/core/sched/scheduler.py::_mamba_block_aligned_split``,
    "slot p holds the state after exactly (p + 1) * block_size tokens").

    0 for a consumer that extends the producer's whole prompt (``shared_tokens >=
    producer_prompt - 1``: a next turn, an exact repeat, a sibling of ``n`` samples): the
    producer's prompt-end state (at ``P`` for a consumer that extends the prompt,
    ``policy.prompt_end_stop``, where the pool fits it; vLLM's checkpoint at ``P - 1`` where the
    last chunk exports it) serves it further, and a stop
    in the producer's last block would cost that checkpoint (the prompt's last chunk exports
    it only when it starts before the block before the last; measured: 768 instead of 829 on
    gen:chat's r7, docs/results/2026-12-07-siblings-clients.md, and ``[0, 640, 640]`` instead
    of ``[0, 699, 699]`` in ``tests/engine/test_siblings.py``). :meth:`SiblingWaits.wait_for`
    has such a consumer wait for the producer's prompt end instead."""
    if unit_tokens <= 0 or block_tokens <= 0 or block_tokens % unit_tokens:
        raise ValueError(
            f"unit_tokens ({unit_tokens}) must be a positive divisor of block_tokens "
            f"({block_tokens})"
        )
    if extends_prompt(shared_tokens, producer_prompt):
        return 0
    stop = min(shared_tokens, producer_prompt - 2, consumer_prompt - 2)
    stop = max(stop, 0) // unit_tokens * unit_tokens
    if stop >= (producer_prompt - 1) // block_tokens * block_tokens:
        stop = stop // block_tokens * block_tokens
    return stop if stop - producer_done >= block_tokens else 0


def extends_prompt(shared_tokens: int, producer_prompt: int) -> bool:
    """Whether a consumer sharing ``shared_tokens`` extends all of a producer's prompt but its
    last token (a next turn, a repeat): the producer's prompt-end state serves it."""
    return shared_tokens >= producer_prompt - 1


def sibling_stops(
    producer_done: int,
    producer_prompt: int,
    consumers: Iterable[tuple[int, int]],
    unit_tokens: int,
    block_tokens: int,
    slots: int = SIBLING_LOOKAHEAD,
) -> list[int]:
    """The stops a producer about to be scheduled (``producer_done``: its hit) takes for the
    requests waiting behind it, each given as (tokens it shares with the producer, its prompt
    tokens), in queue order, the producer itself left out: the :data:`MAX_SIBLING_STOPS`
    deepest distinct :func:`sibling_stop` among the first ``slots`` (the running slots left
    after the producer's: a request behind those waits for a slot anyway, and finds the
    producer done, its states in the cache or evicted, as any later request does), at most
    :data:`SIBLING_LOOKAHEAD`, ascending. Measured with one slot (vLLM's scheduler with no
    model, one request at a time, every later one waiting): stops for the next 15 cost
    gen:agent's engine 0.434 -> 0.406 hit rate and gen:chat's 0.575 -> 0.569, their states
    evicted before use and evicting others. The engine (:meth:`SiblingWaits.stops`) and the
    simulator (``sim/replay.py``) both call it."""
    found: set[int] = set()
    for i, (shared, prompt) in enumerate(consumers):
        if i >= min(slots, SIBLING_LOOKAHEAD):
            break
        stop = sibling_stop(
            shared, producer_done, producer_prompt, prompt, unit_tokens, block_tokens
        )
        if stop:
            found.add(stop)
    return sorted(found)[-MAX_SIBLING_STOPS:]


@dataclass(frozen=True)
class Sibling:
    """A request as the rule sees it: its chained block hashes (one per ``hash_tokens``
    tokens of its prompt and beyond), prompt length, tokens computed, and its next pending
    stop (the engine's ``shared_prefix_boundary``; at or below ``done``: none)."""

    key: Hashable
    hashes: Sequence[object]
    prompt: int
    done: int = 0
    pending: int = 0


@dataclass
class SiblingWaits:
    """The producers (requests still computing their prompts) and the consumers' waits.

    ``hash_tokens``: tokens per block hash; ``stop_tokens``: where states can be kept (the
    engine's stop unit, a multiple of ``hash_tokens`` dividing ``block_tokens``, the engine's
    block); a wait must save at least a block (the engine computes and keeps states by
    blocks)."""

    hash_tokens: int
    stop_tokens: int
    block_tokens: int
    producers: dict[Hashable, Any] = field(default_factory=dict)
    waits: dict[Hashable, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (
            self.hash_tokens <= 0
            or self.stop_tokens <= 0
            or self.stop_tokens % self.hash_tokens
            or self.block_tokens % self.stop_tokens
        ):
            raise ValueError(
                f"stop_tokens ({self.stop_tokens}) must be a positive multiple of hash_tokens "
                f"({self.hash_tokens}) dividing block_tokens ({self.block_tokens})"
            )

    def _shared(self, producer: Sibling, consumer: Sibling) -> int:
        return shared_hash_units(producer.hashes, consumer.hashes) * self.hash_tokens

    def stops(
        self, producer: Sibling, waiting: Iterable[Sibling], slots: int = SIBLING_LOOKAHEAD
    ) -> list[int]:
        """The stops a request being scheduled (``done`` = its hit) takes for the waiting
        requests behind it (:func:`sibling_stops`, ``slots`` the running slots left after
        it; ``waiting`` may hold the producer itself, at the head of vLLM's queue while it is
        looked up: it is left out, not counted)."""
        consumers = (
            (self._shared(producer, c), c.prompt) for c in waiting if c.key != producer.key
        )
        return sibling_stops(
            producer.done, producer.prompt, consumers, self.stop_tokens, self.block_tokens, slots
        )

    def wait_for(
        self, consumer: Sibling, producers: Iterable[tuple[Any, Sibling]]
    ) -> tuple[Any, int] | None:
        """The producer a waiting ``consumer`` waits for this step and the stop the caller
        must add to it (0: none to add, because one at or below the junction is pending
        already, ``done < pending <= stop``, or because the consumer extends the producer's
        whole prompt and waits for its prompt end, still a block or more away), or None: the
        consumer runs now (no producer shares enough, or it waited its
        :data:`MAX_SIBLING_WAITS` steps)."""
        waited = self.waits.get(consumer.key, 0)
        if waited >= MAX_SIBLING_WAITS:
            return None
        for handle, producer in producers:
            if producer.key == consumer.key:
                continue
            shared = self._shared(producer, consumer)
            if extends_prompt(shared, producer.prompt):  # its prompt-end state serves it
                if producer.prompt - 1 - producer.done >= self.block_tokens:
                    self.waits[consumer.key] = waited + 1
                    return handle, 0
                continue
            stop = sibling_stop(
                shared,
                producer.done,
                producer.prompt,
                consumer.prompt,
                self.stop_tokens,
                self.block_tokens,
            )
            if stop:
                self.waits[consumer.key] = waited + 1
                pending = producer.done < producer.pending <= stop
                return handle, 0 if pending else stop
        return None

    def forget(self, key: Hashable) -> None:
        """A request finished or left: neither a producer nor a consumer any more."""
        self.producers.pop(key, None)
        self.waits.pop(key, None)
