"""Seeded synthetic workloads: ``chat``, ``docqa``, ``agent`` and ``prefix``.

Each generator returns requests sorted by arrival, deterministic for a given seed. Content is
described by segments (see :mod:`vllm_hybrid.sim.trace`); a later turn of a session repeats the
earlier turn's prompt *and output* segments, so its content is known (``exact_end=True``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from vllm_hybrid.sim.trace import SimRequest


@dataclass
class _Ids:
    next_id: int = 1 << 40  # far from Mooncake ids

    def new(self) -> int:
        self.next_id += 1
        return self.next_id


def _zipf_pick(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


def _session(
    rng: random.Random,
    ids: _Ids,
    start_ms: float,
    prefix: list[tuple[int, int]],
    turns: list[tuple[int, int]],
    think_ms: float,
) -> list[SimRequest]:
    """A multi-turn session: each turn's prompt = everything so far + a new message."""
    out, content, t = [], list(prefix), start_ms
    for user_tokens, output_tokens in turns:
        content.append((ids.new(), user_tokens))
        prompt = sum(n for _, n in content)
        content.append((ids.new(), output_tokens))
        out.append(SimRequest(t, tuple(content), prompt, output_tokens, exact_end=True))
        t += rng.expovariate(1.0 / think_ms)
    return out


def gen_chat(n_sessions: int = 400, seed: int = 0) -> list[SimRequest]:
    """Chat: 8 shared system prompts (Zipf popularity), 1-10 turns per session."""
    rng, ids = random.Random(seed), _Ids()
    systems = [[(ids.new(), rng.randint(500, 3000))] for _ in range(8)]
    reqs: list[SimRequest] = []
    t = 0.0
    for _ in range(n_sessions):
        t += rng.expovariate(1.0 / 2000.0)
        turns = [(rng.randint(30, 400), rng.randint(50, 600)) for _ in range(rng.randint(1, 10))]
        reqs += _session(rng, ids, t, systems[_zipf_pick(rng, 8)], turns, 30_000.0)
    return sorted(reqs, key=lambda r: r.arrival_ms)


def gen_docqa(n_requests: int = 1500, seed: int = 0) -> list[SimRequest]:
    """Document QA: 60 long documents (2k-16k tokens, Zipf), a question each, some follow-ups."""
    rng, ids = random.Random(seed), _Ids()
    system = [(ids.new(), 300)]
    docs = [(ids.new(), rng.randint(2000, 16000)) for _ in range(60)]
    reqs: list[SimRequest] = []
    t = 0.0
    while len(reqs) < n_requests:
        t += rng.expovariate(1.0 / 1000.0)
        doc = docs[_zipf_pick(rng, len(docs), 0.9)]
        turns = [
            (rng.randint(20, 200), rng.randint(50, 300)) for _ in range(rng.choice([1, 1, 2, 3]))
        ]
        reqs += _session(rng, ids, t, [*system, doc], turns, 20_000.0)
    return sorted(reqs, key=lambda r: r.arrival_ms)[:n_requests]


def gen_agent(n_sessions: int = 150, seed: int = 0) -> list[SimRequest]:
    """Agent loops: 3 shared system prompts + a task; each step appends a tool call (output)
    and a tool result that grows with the step (200 tokens up to ~4k)."""
    rng, ids = random.Random(seed), _Ids()
    systems = [[(ids.new(), rng.randint(1500, 4000))] for _ in range(3)]
    reqs: list[SimRequest] = []
    t = 0.0
    for _ in range(n_sessions):
        t += rng.expovariate(1.0 / 4000.0)
        steps = rng.randint(4, 16)
        turns = [
            (min(4000, 200 + rng.randint(0, 300) * k), rng.randint(40, 200)) for k in range(steps)
        ]
        task = [*systems[_zipf_pick(rng, 3)], (ids.new(), rng.randint(100, 600))]
        reqs += _session(rng, ids, t, task, turns, 3_000.0)
    return sorted(reqs, key=lambda r: r.arrival_ms)


def gen_prefix(
    n_requests: int = 128,
    seed: int = 0,
    prefixes: int = 16,
    prefix_tokens: int = 1024,
    suffix_tokens: int = 128,
    output_tokens: int = 16,
    mean_gap_ms: float = 3333.0,
) -> list[SimRequest]:
    """vLLM's ``bench serve --dataset-name prefix_repetition`` (``PrefixRepetitionRandomDataset``
    in ``vllm/benchmarks/datasets/datasets.py``): ``n_requests // prefixes`` prompts per prefix,
    each the prefix plus its own suffix, shuffled; Poisson arrivals (0.3 req/s by default, as in
    issue 24's runs). Outputs are never part of a later prompt."""
    rng, ids = random.Random(seed), _Ids()
    reqs = []
    for _ in range(prefixes):
        prefix = (ids.new(), prefix_tokens)
        for _ in range(n_requests // prefixes):
            content = (prefix, (ids.new(), suffix_tokens), (ids.new(), output_tokens))
            reqs.append((content, prefix_tokens + suffix_tokens))
    rng.shuffle(reqs)
    out, t = [], 0.0
    for content, prompt in reqs:
        out.append(SimRequest(t, content, prompt, output_tokens, exact_end=False))
        t += rng.expovariate(1.0 / mean_gap_ms)
    return out


GENERATORS: dict[str, Callable[..., list[SimRequest]]] = {
    "chat": gen_chat,
    "docqa": gen_docqa,
    "agent": gen_agent,
    "prefix": gen_prefix,
}
