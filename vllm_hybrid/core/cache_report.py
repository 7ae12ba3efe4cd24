"""Per-request cache reports: how much of a prompt was served from cache, and why not more.

Engine-agnostic (stdlib only). The engine tells :class:`ReuseHistory` every prompt it starts
(token ids and ``cache_salt``); for a request that asked for a report it first calls
:meth:`ReuseHistory.explain` with what the cache gave it (the hit, and how far the cached KV
reached), which compares the prompt with the prompts seen before and names the reason:

=============================  ===============================================================
reason                         meaning
=============================  ===============================================================
``full_hit``                   the hit reaches the last block boundary before the prompt's last
                               token, or past it (a sub-block hit, prefix match unit below the
                               block): nothing more was cacheable at block granularity
``no_snapshot``                cached KV reaches further than the hit, but no state snapshot
                               was kept at the divergence point (mark a breakpoint there)
``evicted``                    an earlier prompt (same salt) shared more, but those pages are
                               gone from the cache now
``different_cache_salt``       an earlier prompt shared more tokens under another cache_salt
``prompt_differs``             the best earlier prompt differs from this one at token
                               ``diverges_at_token``; hits land on block boundaries, so the hit
                               stops at the last boundary before it
``new_prefix``                 no earlier prompt shares even one block
=============================  ===============================================================

History is bounded: the chained block keys of the most recent prompts (``max_blocks``) and the
token ids of the last ``max_prompts`` prompts (for the exact divergence token). Older history is
forgotten, so a reason can read ``new_prefix`` for a prefix seen long ago.

Recording is lazy, because it runs in the scheduler's step for every started request while
reports are rare (opt-in per request): :meth:`ReuseHistory.record` only queues the prompt (the
caller's list, not copied: prompts are immutable), and the block keys are computed when the next
report is explained. At most ``max_pending`` prompts wait; older ones are forgotten as above.
Measured in ``benchmarks/bench_scheduler.py`` (256 running, ~6 prompts started per step):
hashing every prompt at once cost ~70 us per prompt, most of the cache control's step time.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_hybrid.core.breakpoints import common_prefix_tokens

REASONS = (
    "full_hit",
    "no_snapshot",
    "evicted",
    "different_cache_salt",
    "prompt_differs",
    "new_prefix",
)


@dataclass
class _Seen:
    salts: set[str | None]
    last_prompt: int  # id of the last prompt that passed through this block


class ReuseHistory:
    """Chained keys of every seen prompt block (per ``block_tokens`` tokens), salt-blind."""

    def __init__(
        self,
        block_tokens: int,
        max_blocks: int = 100_000,
        max_prompts: int = 64,
        max_pending: int = 4096,
    ):
        if block_tokens <= 0:
            raise ValueError(f"block_tokens {block_tokens} must be positive")
        if max_pending <= 0:
            raise ValueError(f"max_pending {max_pending} must be positive")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self.max_prompts = max_prompts
        self._blocks: OrderedDict[int, _Seen] = OrderedDict()
        self._prompts: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._pending: deque[tuple[Sequence[int], str | None]] = deque(maxlen=max_pending)
        self._next_id = 0

    def _keys(self, tokens: Sequence[int]) -> list[int]:
        keys, parent, b = [], 0, self.block_tokens
        for start in range(0, len(tokens) - b + 1, b):
            parent = hash((parent, tuple(tokens[start : start + b])))
            keys.append(parent)
        return keys

    def record(self, tokens: Sequence[int], salt: str | None) -> None:
        """A prompt the engine started (after :meth:`explain` for the same request); queued,
        O(1). ``tokens`` must not change afterwards."""
        self._pending.append((tokens, salt))

    def _catch_up(self) -> None:
        while self._pending:
            self._record_now(*self._pending.popleft())

    def _record_now(self, tokens: Sequence[int], salt: str | None) -> None:
        pid = self._next_id
        self._next_id += 1
        self._prompts[pid] = tuple(tokens)
        while len(self._prompts) > self.max_prompts:
            self._prompts.popitem(last=False)
        for key in self._keys(tokens):
            seen = self._blocks.get(key)
            if seen is None:
                self._blocks[key] = _Seen({salt}, pid)
            else:
                seen.salts.add(salt)
                seen.last_prompt = pid
                self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def _match(self, keys: list[int], salt: str | None) -> tuple[int, int, int | None]:
        """(blocks seen under any salt, blocks seen under ``salt``, deepest seen prompt id)."""
        any_salt = same_salt = 0
        last: int | None = None
        for key in keys:
            seen = self._blocks.get(key)
            if seen is None:
                break
            any_salt += 1
            last = seen.last_prompt
            if same_salt == any_salt - 1 and salt in seen.salts:
                same_salt += 1
        return any_salt, same_salt, last

    def explain(
        self,
        tokens: Sequence[int],
        salt: str | None,
        hit_tokens: int,
        kv_tokens: int,
    ) -> dict[str, object]:
        """The report of a request that starts with ``hit_tokens`` (resumed from a state) and
        cached KV up to ``kv_tokens``, against the prompts recorded so far."""
        self._catch_up()
        b = self.block_tokens
        prompt_tokens = len(tokens)
        best = (prompt_tokens - 1) // b * b  # no hit reaches the last prompt token
        any_blocks, same_blocks, last = self._match(self._keys(tokens), salt)
        seen_any, seen_same = any_blocks * b, same_blocks * b
        diverges = seen_any
        earlier = self._prompts.get(last) if last is not None else None
        if earlier is not None:
            diverges = common_prefix_tokens(tokens, earlier)
        report: dict[str, object] = {
            "prompt_tokens": prompt_tokens,
            "hit_tokens": hit_tokens,
            "ended_on_snapshot": hit_tokens > 0,
            "cached_kv_tokens": max(kv_tokens, hit_tokens),
            "block_tokens": b,
        }
        if hit_tokens >= best and hit_tokens > 0:
            reason = "full_hit"
            detail = "the hit reaches the last block boundary of the prompt, or past it"
        elif kv_tokens > hit_tokens:
            reason = "no_snapshot"
            detail = (
                f"cached KV reaches token {kv_tokens} but the last state snapshot at or below "
                f"it is at token {hit_tokens}; no snapshot was kept at the divergence point "
                f"(a breakpoint there keeps one)"
            )
        elif seen_same > hit_tokens:
            reason = "evicted"
            detail = (
                f"an earlier prompt shared {seen_same} tokens in whole blocks; the cache "
                f"holds only {hit_tokens} of them now (evicted)"
            )
        elif seen_any > hit_tokens and seen_same <= hit_tokens:
            reason = "different_cache_salt"
            detail = (
                f"an earlier prompt shared {seen_any} tokens in whole blocks under a different "
                f"cache_salt; caches of different salts are never shared"
            )
        elif diverges > 0:
            reason = "prompt_differs"
            detail = (
                f"the prompt differs from the cached one at token {diverges}; hits land on "
                f"{b}-token boundaries, so the hit stops at {diverges // b * b}"
            )
        else:
            reason, detail = "new_prefix", "no earlier prompt shares a prefix with this one"
        report["reason"] = reason
        report["detail"] = detail
        if diverges > 0:
            report["diverges_at_token"] = diverges
        return report
