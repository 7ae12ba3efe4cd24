"""Differential fuzzing of prefix caching: random workloads, caching on vs caching off.

A *plan* is a seeded list of events on an engine's step clock: requests arrive (prompts built
from shared roots cut at and around block boundaries, branches of earlier prompts, near-empty
prompts, greedy decoding with ``n`` of 1 or 2, stop tokens) and some are aborted a few steps
later. ``run_plan`` drives ``LLMEngine`` step by step; ``compare`` checks every request that
finished in both runs token for token. The engine under test runs with a pool small enough to
force eviction and preemption.

Used by ``tests/engine/test_fuzz.py`` (a CI subset) and ``tools/fuzz_engine.py`` (long runs).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

BOUNDARIES = (128, 256, 384, 512)


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    max_tokens: int
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    breakpoints: tuple[int, ...] = ()  # cache_breakpoints (SamplingParams.extra_args)


@dataclass(frozen=True)
class Abort:
    step: int
    request_id: str


@dataclass
class Outcome:
    finished: dict[str, list[list[int]]] = field(default_factory=dict)
    sampled: set[str] = field(default_factory=set)  # n > 1: random, not compared token-wise
    cached_tokens: dict[str, int] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)


def _prompt(
    rng: random.Random, roots: list[list[int]], earlier: list[list[int]], vocab: int
) -> list[int]:
    draw = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    roll = rng.random()
    if roll < 0.05:
        return draw(rng.randint(1, 5))  # near-empty
    if roll < 0.3 and earlier:
        return rng.choice(earlier) + draw(rng.randint(1, 80))  # a branch of an earlier prompt
    root = rng.choice(roots)
    cut = rng.choice([len(root), *(b + d for b in BOUNDARIES for d in (-1, 0, 1) if b < len(root))])
    return root[:cut] + draw(rng.choice([0, 1, rng.randint(2, 120)]))


def make_plan(
    seed: int,
    n_requests: int,
    vocab: int = 1000,
    breakpoint_rate: float = 0.0,
    extension_first_rate: float = 0.0,
) -> list[Arrival | Abort]:
    """A seeded workload: arrivals and aborts sorted by step. With ``breakpoint_rate`` > 0 that
    share of the requests carries one or two ``cache_breakpoints`` (drawn from a second stream,
    so the plan is otherwise the one the same seed gives without them). With
    ``extension_first_rate`` > 0 that share of the requests is preceded, in the same step, by
    an extension of its own prompt (its next turn: ``x<i>``, from a third stream), so the
    extension is scheduled first and both may resume from one cached state in one step (the
    case behind ``kv_copy``'s in-order copies)."""
    marks = random.Random(seed + 7919)
    turns = random.Random(seed + 104729)
    rng = random.Random(seed)
    roots = [
        [rng.randrange(10, vocab) for _ in range(rng.choice((200, 257, 511, 700, 900)))]
        for _ in range(5)
    ]
    events: list[Arrival | Abort] = []
    earlier: list[list[int]] = []
    step = 0
    for i in range(n_requests):
        step += rng.choice((0, 0, 1, 2, 4))
        prompt = _prompt(rng, roots, earlier, vocab)
        earlier.append(prompt)
        # n > 1 needs random sampling, and per-request seeds are not supported by vLLM's CPU
        # sampler ("CPU Generator does not use offset"): such requests load the engine (forked
        # prefixes) but only their shape is checked, not their tokens.
        n = 2 if rng.random() < 0.25 else 1
        stop = tuple(rng.sample(range(10, vocab), 3)) if rng.random() < 0.2 else ()
        bps: tuple[int, ...] = ()
        if breakpoint_rate > 0 and marks.random() < breakpoint_rate and len(prompt) > 2:
            k = marks.choice((1, 1, 2))
            bps = tuple(sorted(marks.randint(1, len(prompt) - 1) for _ in range(k)))
        if extension_first_rate > 0 and turns.random() < extension_first_rate:
            tail = [turns.randrange(10, vocab) for _ in range(turns.randint(1, 150))]
            events.append(Arrival(step, f"x{i}", prompt + tail, turns.randint(1, 8)))
        events.append(Arrival(step, f"r{i}", prompt, rng.randint(1, 16), n, stop, bps))
        if rng.random() < 0.1:
            events.append(Abort(step + rng.randint(0, 6), f"r{i}"))
    return sorted(events, key=lambda e: e.step)


def _params(arrival: Arrival) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        output_kind=RequestOutputKind.FINAL_ONLY,  # one output with every sample at the end
        n=arrival.n,
        max_tokens=arrival.max_tokens,
        ignore_eos=True,
        temperature=0.0 if arrival.n == 1 else 0.8,
        stop_token_ids=list(arrival.stop_token_ids),
        extra_args=(
            {"cache_breakpoints": list(arrival.breakpoints)} if arrival.breakpoints else None
        ),
    )


def run_plan(llm: Any, plan: list[Arrival | Abort], max_steps: int = 100_000) -> Outcome:
    """Drive ``llm.llm_engine`` through the plan; returns what finished and what hit."""
    engine, pending, outcome = llm.llm_engine, deque(plan), Outcome()
    for step in range(max_steps):
        while pending and pending[0].step <= step:
            event = pending.popleft()
            if isinstance(event, Arrival):
                if event.n > 1:
                    outcome.sampled.add(event.request_id)
                engine.add_request(
                    event.request_id, {"prompt_token_ids": event.prompt}, _params(event)
                )
            else:
                engine.abort_request([event.request_id])
                outcome.aborted.add(event.request_id)
        for out in engine.step():
            if out.finished and all(c.finish_reason != "abort" for c in out.outputs):
                outcome.finished[out.request_id] = [list(c.token_ids) for c in out.outputs]
                outcome.cached_tokens[out.request_id] = out.num_cached_tokens or 0
        if not pending and not engine.has_unfinished_requests():
            return outcome
    raise RuntimeError(f"plan did not finish within {max_steps} engine steps")


def compare(reference: Outcome, tested: Outcome) -> tuple[int, list[str]]:
    """(requests compared, ids whose outputs differ) over requests finished in both runs."""
    both = sorted((set(reference.finished) & set(tested.finished)) - tested.sampled)
    bad = [r for r in both if reference.finished[r] != tested.finished[r]]
    for r in tested.sampled & set(tested.finished):  # random: check shape only
        if len(tested.finished[r]) != 2 or not all(tested.finished[r]):
            bad.append(r)
    return len(both), bad
