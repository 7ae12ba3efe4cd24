"""Where SGLang's hybrid radix cache keeps Mamba states, and how it splits its memory.

Read from SGLang 0.5.23 (the PyPI wheel; ``UnifiedRadixCache`` with its ``MambaComponent``) and
checked against 0.5.9 (``MambaRadixCache``); file:line citations are in docs/policies.md
(``sglang``). This module holds the arithmetic only; :class:`~vllm_hybrid.core.policies.
SglangPolicy` asks it.

The ``extra_buffer`` strategy (what ``--mamba-radix-cache-strategy auto`` resolves to for the
hybrid architectures that support it, overlap scheduling being on by default) keeps **one**
state per prefill forward and one per finished request, each on a grid:

* ``checkpoint`` grid ``G = lcm(max(model chunk, page), page)`` (``mamba_checkpoint_grid``; the
  model chunk is its ``mamba_chunk_size``, else FLA's 64);
* a prefill runs in chunks of ``chunked_prefill_size`` from the request's state hit ``H``; a chunk
  ``[s, e)`` of at least ``G`` tokens tracks the state at ``s + floor((e - s) / G) * G``, or at the
  *branching point* ``floor(K / G) * G`` (``K``: the KV match, when it ends past ``H``) if that
  falls strictly inside the chunk (``ScheduleBatch`` track entry); after the chunk the tree keeps
  that state and the KV up to it (``checkpoint_into_tree``: the insert is cut at the state);
* decoding tracks the state at every multiple of the track grid ``lcm(G, mamba_track_interval)``;
  when the request finishes, the tree keeps the last one and the KV up to it
  (``prepare_for_caching_req``, ``is_finished``), or nothing if none was crossed since the
  prefill. The KV past the last kept state is freed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: FLA's chunk (``chunk_delta_h.CHUNK_SIZE``): the model chunk when its config names none
FLA_CHUNK_TOKENS = 64
#: ``--mamba-track-interval`` default
TRACK_INTERVAL_TOKENS = 256
#: ``--chunked-prefill-size`` default on a 60-160 GB GPU (H100, H200)
CHUNKED_PREFILL_TOKENS = 8192
#: ``--mamba-full-memory-ratio`` default: Mamba pool bytes / full-attention KV pool bytes
MAMBA_FULL_MEMORY_RATIO = 0.9


@dataclass(frozen=True)
class SglangGrid:
    """SGLang's state positions for one page (block) size, in tokens."""

    checkpoint_tokens: int
    track_tokens: int
    chunk_tokens: int

    @classmethod
    def of(
        cls,
        page_tokens: int,
        model_chunk_tokens: int = FLA_CHUNK_TOKENS,
        track_interval_tokens: int = TRACK_INTERVAL_TOKENS,
        chunk_tokens: int = CHUNKED_PREFILL_TOKENS,
    ) -> SglangGrid:
        """The grids SGLang derives from a page size (``mamba_checkpoint_grid``,
        ``mamba_track_grid``): ``lcm(max(model chunk, page), page)`` and its lcm with the track
        interval. Where SGLang refuses to start (a page and a model chunk neither of which
        divides the other, a track interval off the page) the lcm is the nearest grid it could
        run; a chunk is cut to the checkpoint grid (at least one), as the scheduler cuts it to
        the page, so every position is on the grid."""
        if min(page_tokens, model_chunk_tokens, track_interval_tokens, chunk_tokens) <= 0:
            raise ValueError("SGLang's page, model chunk, track interval and chunk must be > 0")
        checkpoint = math.lcm(page_tokens, model_chunk_tokens)
        chunk = max(checkpoint, chunk_tokens // checkpoint * checkpoint)
        return cls(checkpoint, math.lcm(checkpoint, track_interval_tokens), chunk)

    def prefill_positions(self, prompt_tokens: int, hit_tokens: int, kv_tokens: int) -> list[int]:
        """The state each prefill chunk leaves in the tree, chunks from ``hit_tokens`` to
        ``prompt_tokens``; ``kv_tokens``: the KV match (its grid floor is the branching point
        when it ends past the hit)."""
        g = self.checkpoint_tokens
        branch = kv_tokens // g * g
        out = []
        start = hit_tokens
        while start < prompt_tokens:
            end = min(start + self.chunk_tokens, prompt_tokens)
            if end - start >= g:
                tracked = start + (end - start) // g * g
                if branch > hit_tokens and start < branch < end and (branch - start) % g == 0:
                    tracked = branch
                out.append(tracked)
            start = end
        return out

    def finish_position(self, prompt_tokens: int, computed_tokens: int) -> int:
        """The state a finished request leaves: the last track boundary its decode crossed
        (past the prompt, within the ``computed_tokens`` whose KV it wrote), or 0."""
        last = computed_tokens // self.track_tokens * self.track_tokens
        return last if last > prompt_tokens else 0


def pool_split_bytes(budget_bytes: int, ratio: float = MAMBA_FULL_MEMORY_RATIO) -> tuple[int, int]:
    """(full-attention KV pool, Mamba pool) bytes SGLang carves from ``budget_bytes``:
    ``mamba / kv = ratio`` (``handle_max_mamba_cache`` / the KV cache configurator)."""
    if budget_bytes < 0 or not ratio > 0:
        raise ValueError(f"budget {budget_bytes} must be >= 0 and the ratio {ratio} > 0")
    mamba = int(budget_bytes * ratio / (1 + ratio))
    return budget_bytes - mamba, mamba
