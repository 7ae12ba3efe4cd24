"""The policy contract: pure functions of a node (and the time) that the index ranks by.

A policy never touches the index or a pool. It answers three questions:

* :meth:`EvictionPolicy.kv_priority`: may this node's KV (with its subtree) be evicted, and how
  soon? Lower is evicted first; ``None`` means "not a candidate now" (e.g. interior nodes for
  leaf-only policies). The index re-asks whenever the node changes.
* :meth:`EvictionPolicy.snapshot_priority`: the same for the snapshot alone (the KV stays).
* :meth:`AdmissionPolicy.snapshot_positions`: where a request should leave state snapshots.

Optional admission hook: ``kv_end_tokens(ctx, positions)``, how much of the request's cacheable
content keeps its KV in the cache (the simulator keeps the full blocks within it); without it,
all of it (``sglang`` keeps the KV up to its last state only, as SGLang's tree does).

Optional hook: a policy with ``on_evicted(node, snapshot_only, entries_held)`` is told of each
victim just before it goes (``snapshot_only``: only its state goes, the KV stays), e.g. to keep
ghosts of evicted keys. It must not touch the index; policies without it are unaffected.

A priority computed at one time must stay comparable with priorities computed later for other
nodes, because the index keeps them in one heap (GreedyDual-style clocks do this by design).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from vllm_hybrid.core.node import Node


class EvictionPolicy(Protocol):
    def kv_priority(self, node: Node, now: int) -> float | None: ...

    def snapshot_priority(self, node: Node, now: int) -> float | None: ...

    def on_evict(self, priority: float) -> None: ...


@dataclass(frozen=True)
class AdmitContext:
    """What a request's admission decision may look at (all positions in tokens).

    ``cacheable_tokens`` is how much of the request's sequence leaves KV behind (the prompt, plus
    the output where a later turn is known to extend it); ``exact_end`` says whether a partial
    last block can be matched later (its content is known). ``kv_tokens`` is the longest cached
    KV prefix before this request (block aligned), ``hit_tokens`` the snapshot it resumed from,
    ``kv_tip_branches`` whether cached paths continue past ``kv_tokens`` (a branch point).
    ``key_at(p)`` is the key of the request's node ending at ``p``; ``probe(block_index,
    n_tokens)``, where given, the key of a partial block (to check exact ends). ``stops``: chunk
    ends the engine's scheduler adds past the hit, each keeping a state (where a waiting
    sibling diverges, ``core/siblings.py``).
    """

    request_index: int
    prompt_tokens: int
    cacheable_tokens: int
    hit_tokens: int
    kv_tokens: int
    kv_tip_branches: bool
    block_tokens: int
    exact_end: bool
    key_at: Callable[[int], Hashable]
    probe: Callable[[int, int], Hashable] | None = None
    stops: tuple[int, ...] = ()

    @property
    def last_boundary_tokens(self) -> int:
        """Last block boundary inside the cacheable content."""
        return self.cacheable_tokens // self.block_tokens * self.block_tokens

    def end_positions(self) -> list[int]:
        """The exact end when it can be matched later, else its block-floored boundary."""
        end = self.cacheable_tokens
        if self.exact_end or end % self.block_tokens == 0:
            return [end]
        return [self.last_boundary_tokens] if self.last_boundary_tokens else []


class AdmissionPolicy(Protocol):
    def snapshot_positions(self, ctx: AdmitContext) -> list[int]: ...


def output_state_position(
    policy: object,
    prompt_tokens: int,
    state_tokens: int,
    block_tokens: int,
    unit_tokens: int,
    *,
    request_index: int = 0,
    hit_tokens: int = 0,
    key_at: Callable[[int], Hashable] | None = None,
) -> int:
    """Where an engine keeps the recurrent state at the end of a request's output, or 0.

    A request that generated past its prompt holds its running state at ``state_tokens`` (the
    last computed position: prompt plus output, less the last sampled token). The next turn of
    a conversation (previous prompt + answer + new message) can resume from it, at the engine's
    match granularity ``unit_tokens`` (U, dividing ``block_tokens``): the candidate is
    ``c = floor(state_tokens / U) * U``, and only past the prompt (``c >= prompt_tokens``; the
    prompt's own end is kept by the engine's prompt path).

    The policy decides, with the context the simulator builds for a turn that a later one
    extends: the content up to ``c`` is cacheable and matchable exactly (``exact_end``). A
    policy with ``output_state_positions(ctx)`` answers that; any other answers through its
    admission method ``snapshot_positions(ctx)``. ``c`` is kept when it is among the answer
    (``flop``, ``sglang``, ``marconi``: yes, the end of the cacheable content; ``vllm``,
    ``lru-dense``: no, they model vLLM, which keeps none there)."""
    if unit_tokens <= 0 or block_tokens % unit_tokens:
        raise ValueError(f"unit {unit_tokens} must divide the block {block_tokens}")
    end = state_tokens // unit_tokens * unit_tokens
    if end < max(prompt_tokens, 1):
        return 0
    ctx = AdmitContext(
        request_index=request_index,
        prompt_tokens=prompt_tokens,
        cacheable_tokens=end,
        hit_tokens=hit_tokens,
        kv_tokens=hit_tokens,
        kv_tip_branches=False,
        block_tokens=block_tokens,
        exact_end=True,
        key_at=key_at if key_at is not None else (lambda p: None),
    )
    ask = getattr(policy, "output_state_positions", None)
    if ask is None:
        ask = policy.snapshot_positions  # type: ignore[attr-defined]
    return end if end in ask(ctx) else 0


def prompt_floor_stop(
    prompt_tokens: int, hit_tokens: int, block_tokens: int, unit_tokens: int
) -> int:
    """The block boundary below a prompt's end, where an engine with a match unit ``U`` below
    the block also keeps a state, or 0.

    At ``U`` = the block an engine keeps a prompt's state at ``floor((P - 1) / B) * B`` (vLLM's
    prompt checkpoint): a later prompt that shares this one up to somewhere inside its last
    block (another question over the same document, another conversation with the same
    system prompt) resumes there. At ``U`` below the block the prompt's state moves to its
    exact end ``floor((P - 1) / U) * U``, which such a sibling cannot use, so the boundary is
    kept as well, at the cost of one more prefill chunk ending there. 0 where ``U`` is the
    block, where the exact end is the boundary itself, and where the request computes less than
    a block before the boundary (a next turn resuming just below it: the state would save a
    sibling less than a block, not worth a chunk)."""
    if unit_tokens >= block_tokens or prompt_tokens <= 1:
        return 0
    floor = (prompt_tokens - 1) // block_tokens * block_tokens
    exact = (prompt_tokens - 1) // unit_tokens * unit_tokens
    return floor if floor - hit_tokens >= block_tokens and floor < exact else 0


def prompt_end_stop(
    prompt_tokens: int, hit_tokens: int, block_tokens: int, unit_tokens: int
) -> int:
    """The prompt's own end ``P``, where an engine with a one-token match unit keeps a state
    (one chunk ending there, as every prompt's last chunk does), or 0.

    A next turn of a conversation resumes from the end of the answer when its prompt repeats
    the generated tokens; where it does not (the chat template re-renders the answer
    differently, drops a reasoning block from history, or the client edits the message), it
    shares the previous prompt up to ``P`` and no further. Without a state at ``P`` it falls
    back to the block boundary below (``prompt_floor_stop``): up to a block less. An exact
    repeat of the prompt cannot use it (a hit leaves the last token to compute: ``P - 1``).
    0 where the unit is above one token (the engine then ends the last chunk at ``P - 1``
    itself, vLLM's prompt checkpoint, which serves a next turn as well), where ``P`` is a
    block boundary (kept as one) or one past it (the boundary's state, one token short, is
    vLLM's prompt checkpoint there: its chunk exports it, and the engine keys nothing else in
    that chunk), and where the hit reaches ``P``."""
    if unit_tokens != 1 or unit_tokens >= block_tokens or prompt_tokens % block_tokens < 2:
        return 0
    return prompt_tokens if prompt_tokens > hit_tokens else 0


#: The fewest tokens an exact (sub-block) junction must lie past a request's hit to be worth a
#: chunk ending there (``exact_junction_stop``): a next turn whose answer re-renders a few
#: tokens alike would otherwise pay a step for a state no sibling needs.
MIN_JUNCTION_GAIN_TOKENS = 64


def exact_junction_stop(hit_tokens: int, junction_tokens: int, vllm_junction: int) -> int:
    """The exact junction to end a chunk at (and keep a state), or 0: where the request
    diverges from a cached prompt inside a block (an engine's index finds it, vLLM's lookup
    floors it to the block or to a registered prompt tail), when it lies past vLLM's own
    junction and at least :data:`MIN_JUNCTION_GAIN_TOKENS` past the hit."""
    if junction_tokens <= vllm_junction or junction_tokens - hit_tokens < MIN_JUNCTION_GAIN_TOKENS:
        return 0
    return junction_tokens


#: Optional snapshots (``prompt_floor_stop``, ``exact_junction_stop``) are taken only where the
#: pool holds at least this many requests of the same size with their states: on a pool
#: barely larger than what is running, one more snapshot per request evicts what the next
#: waiting request was about to hit (measured: an 18-page pool, two prompts of 300-340 tokens
#: run twice, hits 256, 256 at the block unit and 0, 0 with the optional stops).
OPTIONAL_SNAPSHOT_POOL_REQUESTS = 4


def optional_snapshots_fit(
    prompt_tokens: int, block_tokens: int, kv_groups: int, state_groups: int, pool_pages: int
) -> bool:
    """Whether the pool is roomy enough for a request's optional snapshots: its KV pages and
    three states (the running one, the prompt's own, one optional), times
    :data:`OPTIONAL_SNAPSHOT_POOL_REQUESTS`, fit in ``pool_pages``."""
    blocks = -(-prompt_tokens // block_tokens)
    pages = blocks * kv_groups + 3 * state_groups
    return OPTIONAL_SNAPSHOT_POOL_REQUESTS * pages <= pool_pages
