"""End-of-output states: the state a conversation's next turn resumes from (vLLM 0.32.0).

The scheduler (``scheduler.py``) installs :class:`OutputStates` when the core is in charge of
the prefix cache; see the class docstring for vLLM's decode layout it relies on and what it
changes. vLLM's internals go through ``compat`` (``replace_cache_blocks``,
``evict_cached_block``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hybrid.adapters.vllm.compat.block_pool import evict_cached_block
from vllm_hybrid.adapters.vllm.compat.scheduler import replace_cache_blocks
from vllm_hybrid.adapters.vllm.config import is_full_attention


@dataclass
class _OutputMark:
    """The block-boundary state a decoding request kept last: a tentative end of its output."""

    tokens: int
    pages: list[tuple[Any, Any, Any]]  # (Mamba manager, block, its block_hash when kept)


class OutputStates:
    """Keep the recurrent state at the end of each request's output where the policy says so
    (``core/policy.py::output_state_position``), so that the next turn of a conversation
    (previous prompt + answer + new message) resumes from the end of the answer rather than
    from the previous prompt's end. Written against vLLM 0.32.0, align-mode Mamba caching.

    What vLLM keeps during decode (``vllm/v1/core/single_type_kv_cache_manager.py``): in align
    mode the running state of a request whose computed length is ``n`` lives in its Mamba block
    ``cdiv(n, B) - 1``, advanced in place by every decode step. When decode crosses a block
    boundary ``k*B``, ``MambaManager.allocate_new_blocks`` gives the request block ``k`` and
    records block ``k-1`` (``last_state_block_idx``), whose state the worker copies forward; so
    block ``k-1`` keeps exactly the state at ``k*B``, and ``MambaManager.remove_skipped_blocks``
    frees it a step later. Whether that freed block stays in the prefix cache is decided when
    the step computing token ``k*B - 1`` is scheduled (``KVCacheManager.allocate_slots`` ->
    ``KVCacheCoordinator.cache_blocks`` -> ``SingleTypeKVCacheManager.cache_blocks``): its hash
    is registered only where ``MambaManager.reachable_block_mask`` says so: every block with no
    retention interval (dense), the interval's multiples, and the ``replay_boundaries``
    (``num_prompt_tokens - 1``) and ``shared_prefix_boundary`` positions. With the default
    interval 0 no decode boundary is among them, so the state is freed unhashed: a next turn
    resumes from the previous prompt's end. Attention KV blocks are all hashed (dense).

    What this does:

    * block boundaries (every ``B``): :meth:`keeps` and :meth:`kept`, the boundary hook of
      the coordinator's ``cache_blocks`` (``compat.replace_cache_blocks``, on the instance). At
      the step that completes block ``k-1`` past the prompt, it asks the policy whether the end
      of the output would be kept there; if so vLLM's ``KVCacheCoordinator.cache_blocks`` loop
      runs with ``k*B`` added to the replay boundaries, so ``reachable_block_mask`` keeps
      that block's state as it keeps a prompt end's. The boundary kept before is dropped (it
      is no longer the end; unless a retention interval keeps it or another request holds
      it). At finish the last one stays: the block-floor of the request's computed tokens.
    * with ``U`` below the block (sub-block hits on, see ``compat.enable_exact_stops``):
      :meth:`on_finished` registers the state at exactly the computed length ``E`` when ``E``
      is a multiple of ``U`` (always at ``U = 1``): the running Mamba block of each group holds
      the state at ``E`` once the last step ran, and the request is finishing, so no copy is
      needed; it gets a partial prefix-cache key at ``E`` (``BlockPool.cache_partial_block``,
      as vLLM's ``MambaManager._cache_partial_tail_block`` does for prompt tails), and so does
      the attention block holding token ``E - 1``. The block-boundary state below it is then
      dropped. Where ``E`` is not a multiple of ``U`` the state at ``floor(E / U) * U`` was
      overwritten in place by decode; the block-boundary state stays.
    """

    def __init__(self, scheduler: Any, policy: Any, sub_block: bool) -> None:
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager

        manager = scheduler.kv_cache_manager
        self.policy = policy
        self.pool = manager.block_pool
        self.coordinator = manager.coordinator
        self.block_tokens = int(scheduler.cache_config.block_size)
        self.unit_tokens = int(self.pool.hash_block_size)
        managers = self.coordinator.single_type_managers
        self.mamba = [m for m in managers if isinstance(m, MambaManager)]
        self.kv = list(filter(is_full_attention, managers))
        self.sub_block = sub_block and self.unit_tokens < self.block_tokens
        self.marks: dict[str, _OutputMark] = {}
        self.kept_boundaries = 0  # block-boundary output states kept (tentatively)
        self.kept_exact = 0  # sub-block end states registered at finish
        self.dropped = 0  # superseded boundary states dropped
        # vLLM's KVCacheCoordinator.cache_blocks, written out in compat with our boundary
        # hook (keeps / kept) at each block boundary past the prompt; False where the gate refused.
        self.installed = replace_cache_blocks(self.coordinator, self)

    @classmethod
    def install(cls, scheduler: Any, policy: Any, sub_block: bool) -> OutputStates | None:
        """Install on ``scheduler`` where vLLM's decode state layout is the one described in
        the class docstring: vLLM 0.32.0, every Mamba group in align mode, full-attention
        groups otherwise, no speculative decoding (no EAGLE groups, draft or MTP tokens)."""
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager

        coordinator = scheduler.kv_cache_manager.coordinator
        managers = coordinator.single_type_managers
        mamba = [m for m in managers if isinstance(m, MambaManager)]
        if not mamba or any(getattr(m, "mamba_cache_mode", None) != "align" for m in mamba):
            return None
        if any(not isinstance(m, MambaManager) and not is_full_attention(m) for m in managers):
            return None
        if (
            getattr(coordinator, "eagle_group_ids", None)
            or getattr(coordinator, "num_reprefillable_tokens", 0)
            or getattr(scheduler, "num_spec_tokens", 0)
            or any(getattr(m, "num_speculative_blocks", 0) for m in mamba)
        ):
            return None
        states = cls(scheduler, policy, sub_block)
        return states if states.installed else None

    # ------------------------------------------------------------------ block boundaries
    def keeps(self, request: Any, tokens: int) -> bool:
        """At a block boundary ``tokens`` past the prompt (``compat.replace_cache_blocks``
        asks before vLLM's managers cache the step's blocks): whether the policy keeps the
        state there, among the reachable boundaries; at a finish, at its sub-block end."""
        from vllm_hybrid.core import output_state_position

        return (
            output_state_position(
                self.policy,
                request.num_prompt_tokens,
                tokens,
                self.block_tokens,
                self.unit_tokens,
                hit_tokens=max(int(getattr(request, "num_cached_tokens", 0) or 0), 0),
            )
            == tokens
        )

    def kept(self, request: Any, tokens: int) -> None:
        """The step's blocks are cached with ``tokens`` among the replay boundaries: remember
        the state block's key, and drop the request's previous boundary state."""
        index = tokens // self.block_tokens - 1
        pages = []
        for manager in self.mamba:
            blocks = manager.req_to_blocks.get(request.request_id) or ()
            if index < len(blocks) and not blocks[index].is_null:
                block = blocks[index]
                if block.block_hash is not None:
                    pages.append((manager, block, block.block_hash))
        if not pages:
            return
        previous = self.marks.get(request.request_id)
        self.marks[request.request_id] = _OutputMark(tokens, pages)
        self.kept_boundaries += 1
        if previous is not None:
            self._drop(request.request_id, previous)

    def _retained_anyway(self, tokens: int) -> bool:
        """Kept by vLLM's retention interval (``reachable_block_mask``): dense or a multiple."""
        interval = self.coordinator.retention_interval
        return interval is None or (interval > 0 and tokens % interval == 0)

    def _drop(self, request_id: str, mark: _OutputMark) -> None:
        """Forget a superseded end state (``BlockPool._maybe_evict_cached_block``, as vLLM's
        ``MambaManager._cache_partial_tail_block`` does for a transient checkpoint), unless
        vLLM's interval keeps it, its block was reused, or another request holds it."""
        if self._retained_anyway(mark.tokens):
            return
        dropped = False
        for manager, block, key in mark.pages:
            if block.block_hash != key:
                continue  # evicted (and maybe reused) since
            own = manager.req_to_blocks.get(request_id) or ()
            if block.ref_cnt == 0 or (block.ref_cnt == 1 and any(b is block for b in own)):
                dropped |= evict_cached_block(self.pool, block)
        self.dropped += dropped

    def _key_partial(self, request: Any, manager: Any, block: Any, end: int) -> None:
        """Key ``block`` at ``end`` (``BlockPool.cache_partial_block``), keeping its shorter
        keys: vLLM drops every key of a block whose primary key is shorter than the new one
        (an attention block holding the prompt's tail or a breakpoint stop as well as the end
        of the answer), so those found among the request's own keys are registered again,
        after the longer one (as secondary keys they stay)."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        group = manager.kv_cache_group_id
        held = set(self.pool.cached_block_hashes_by_block.get(block.block_id, ()))
        if block.block_hash is not None:
            held.add(block.block_hash)
        unit, hashes = self.unit_tokens, request.block_hashes
        start = (end - 1) // self.block_tokens * self.block_tokens
        earlier = [
            t
            for t in range(start + unit, end, unit)
            if held and make_block_hash_with_group_id(hashes[t // unit - 1], group) in held
        ]
        for tokens in (end, *earlier):
            self.pool.cache_partial_block(
                request=request,
                block=block,
                num_tokens=tokens,
                kv_cache_group_id=group,
                block_size=self.block_tokens,
            )

    def totals(self) -> dict[str, float]:
        """Counters for ``/metrics`` (``core/cache_stats.py``)."""
        return {
            "output_states_kept": self.kept_boundaries + self.kept_exact,
            "output_states_dropped": self.dropped,
        }

    # ------------------------------------------------------------------ finish
    def on_finished(self, request: Any) -> None:
        """Called from ``Scheduler._free_request`` before vLLM frees the request's blocks."""
        mark = self.marks.pop(request.request_id, None)
        if not self.sub_block or int(getattr(request, "num_in_flight_tokens", 0) or 0):
            return
        end = int(request.num_computed_tokens)
        b = self.block_tokens
        if end <= request.num_prompt_tokens or end % b == 0 or end % self.unit_tokens:
            return
        if not self.keeps(request, end):
            return
        index = (end - 1) // b  # the running state block, and the KV block holding end - 1
        pages = []
        for state, groups in ((True, self.mamba), (False, self.kv)):
            for manager in groups:
                blocks = manager.req_to_blocks.get(request.request_id) or ()
                if index >= len(blocks) or blocks[index].is_null:
                    return
                if state and blocks[index].block_hash is not None:
                    return  # not an unkeyed running state block (never so in align mode)
                pages.append((manager, blocks[index]))
        if len(request.block_hashes) * self.unit_tokens < end:
            return
        for manager, block in pages:
            self._key_partial(request, manager, block, end)
        self.kept_exact += 1
        if mark is not None:
            self._drop(request.request_id, mark)
