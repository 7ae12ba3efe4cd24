"""The scheduler's internals in vLLM 0.32.0: four private methods turned into hooks, and the
scheduler-side switches the hybrid cache sets.

Sources: ``vllm/v1/core/sched/scheduler.py`` (``Scheduler``), ``vllm/v1/core/
kv_cache_coordinator.py`` (``KVCacheCoordinator``), ``vllm/v1/core/single_type_kv_cache_manager.py``
(``MambaManager``, ``FullAttentionManager``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from vllm_hybrid.adapters.vllm.config import is_full_attention
from vllm_hybrid.adapters.vllm.version import check_vllm_version


class SchedulerHooks:
    """Mixin for a subclass of vLLM's ``Scheduler`` or ``AsyncScheduler``, put before vLLM's
    class in the bases (so ``super()`` reaches vLLM's methods). It overrides four private
    methods of ``Scheduler`` and calls a named hook in each; the defaults do nothing:

    * ``_get_local_prefix_cache_hit(request)`` (vLLM returns ``(blocks, hit_tokens,
      shared_prefix_boundary, hit_diverged)``; ``Scheduler.schedule`` stores the third in
      ``request.shared_prefix_boundary``): :meth:`before_prefix_lookup` first,
      :meth:`after_prefix_lookup` chooses the boundary the request runs with.
    * ``_mamba_block_aligned_split(request, num_new_tokens, ...) -> int`` (the prefill chunk
      length in align mode): where :meth:`ends_chunk_exactly` says so, vLLM's own branch for
      shared-prefix checkpoints (``Scheduler.mamba_shared_prefix_checkpoint``, EAGLE-only in
      vLLM) is on for that call only, so the chunk ends exactly at
      ``request.shared_prefix_boundary`` rather than block-floored; either way, where
      :meth:`drops_prompt_tail_stop` says so, a chunk vLLM ends at the prompt's tail checkpoint
      runs on to the prompt's end (:func:`extend_past_prompt_tail`). :func:`skip_split_hook`
      binds vLLM's method on the instance where neither can be wanted.
    * ``_free_request(request, delay_free_blocks=False) -> (kv_transfer_params,
      ec_transfer_params)``: :meth:`before_free_request` before vLLM frees the blocks,
      :meth:`after_free_request` may replace the ``kv_transfer_params`` (which vLLM returns to
      the client in ``EngineCoreOutput``).

    * ``_handle_blocked_waiting_request(request) -> bool`` (``Scheduler.schedule`` asks it
      for every waiting request it reaches, before the prefix lookup; False: vLLM's
      ``skip_request`` leaves the request waiting for this step): :meth:`holds_back` may say
      a ready request waits.

    Version gate: on another vLLM release the four overrides are bound away on the instance
    (vLLM's methods run, no hook is called) and :attr:`hooks_active` is False.
    """

    mamba_shared_prefix_checkpoint: bool  # vLLM's Scheduler attribute
    hooks_active: bool
    #: Set where :meth:`drops_prompt_tail_stop` may say yes: :func:`skip_split_hook` then
    #: leaves the override in place.
    split_hook_always: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hooks_active = check_vllm_version("vllm-hybrid's scheduler hooks")
        if not self.hooks_active:
            vllm: Any = super()
            self._get_local_prefix_cache_hit = vllm._get_local_prefix_cache_hit  # type: ignore[method-assign]
            self._mamba_block_aligned_split = vllm._mamba_block_aligned_split  # type: ignore[method-assign]
            self._free_request = vllm._free_request  # type: ignore[method-assign]
            self._handle_blocked_waiting_request = vllm._handle_blocked_waiting_request  # type: ignore[method-assign]

    # ------------------------------------------------------------------ hooks
    def before_prefix_lookup(self, request: Any) -> None:
        """Before vLLM's prefix-cache lookup of a waiting ``request``."""

    def after_prefix_lookup(self, request: Any, hit_tokens: int, junction: int) -> int:
        """The ``shared_prefix_boundary`` ``request`` runs with (vLLM's is ``junction``)."""
        return junction

    def ends_chunk_exactly(self, request: Any) -> bool:
        """Whether ``request``'s next prefill chunk ends exactly at its boundary."""
        return False

    def drops_prompt_tail_stop(self, request: Any) -> bool:
        """Whether a prefill chunk that vLLM ends at ``request``'s prompt tail checkpoint
        (only there: see :func:`extend_past_prompt_tail`) runs on to the prompt's end."""
        return False

    def holds_back(self, request: Any) -> bool:
        """Whether a waiting ``request`` that vLLM would schedule waits for this step."""
        return False

    def before_free_request(self, request: Any) -> None:
        """A finished ``request``, before vLLM frees its blocks."""

    def after_free_request(self, request: Any, kv_params: Any) -> Any:
        """The ``kv_transfer_params`` returned for a finished ``request`` (vLLM's: given)."""
        return kv_params

    # ------------------------------------------------------------------ vLLM's methods
    def _get_local_prefix_cache_hit(self, request: Any) -> Any:
        self.before_prefix_lookup(request)
        blocks, hit, junction, diverged = super()._get_local_prefix_cache_hit(request)  # type: ignore[misc]
        return blocks, hit, self.after_prefix_lookup(request, hit, junction), diverged

    def _mamba_block_aligned_split(
        self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any
    ) -> int:
        split = super()._mamba_block_aligned_split  # type: ignore[misc]
        if not self.ends_chunk_exactly(request):
            n = int(split(request, num_new_tokens, *args, **kwargs))
        else:
            saved = self.mamba_shared_prefix_checkpoint
            self.mamba_shared_prefix_checkpoint = True
            try:
                n = int(split(request, num_new_tokens, *args, **kwargs))
            finally:
                self.mamba_shared_prefix_checkpoint = saved
        if n < num_new_tokens and self.drops_prompt_tail_stop(request):
            return extend_past_prompt_tail(self, request, num_new_tokens, n, *args)
        return n

    def _handle_blocked_waiting_request(self, request: Any) -> bool:
        ready = super()._handle_blocked_waiting_request(request)  # type: ignore[misc]
        return bool(ready) and not self.holds_back(request)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self.before_free_request(request)
        kv_params, ec_params = super()._free_request(request, *args, **kwargs)  # type: ignore[misc]
        return self.after_free_request(request, kv_params), ec_params


def extend_past_prompt_tail(
    scheduler: Any,
    request: Any,
    num_new_tokens: int,
    split_tokens: int,
    num_new_local_computed_tokens: int = 0,
    num_external_computed_tokens: int = 0,
) -> int:
    """The chunk length without vLLM's prompt-tail stop, where that stop alone ended it.

    With a match unit ``U`` below the block, ``Scheduler._mamba_block_aligned_split`` ends a
    prompt's last chunk at its tail checkpoint ``floor((P - 1) / U) * U``
    (``get_mamba_prefill_checkpoint_position``) whenever the backend cannot export that state
    from inside the forward pass (``is_mamba_prefill_checkpoint_valid``: the chunk starts in
    the prompt's last block), and computes the last token(s) in a forward pass of their own.
    A prompt that shares the first ``tail`` tokens resumes at that state (at ``U`` = 1 only an
    exact repeat of the whole prompt). Returned unchanged
    (``split_tokens``) unless the chunk ended exactly at the tail, the tail is inside a block
    and is not the request's ``shared_prefix_boundary`` (a junction vLLM stops at for
    siblings), and the unsplit chunk completes the prefill. ``MambaManager.
    _cache_partial_tail_block`` then caches no partial state (its ``num_tokens`` is past the
    tail), so no key promises a state that was not written."""
    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

    if not getattr(scheduler, "mamba_partial_cache_hit", False):
        return split_tokens
    start = request.num_computed_tokens + num_new_local_computed_tokens
    start += num_external_computed_tokens
    tail = get_mamba_prefill_checkpoint_position(
        request.num_prompt_tokens, scheduler.hash_block_size, scheduler.use_eagle_block_drop
    )
    prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
    if (
        start + split_tokens != tail
        or tail % scheduler.block_size == 0
        or tail == request.shared_prefix_boundary
        or start + num_new_tokens < prefill_end
    ):
        return split_tokens
    return num_new_tokens


def skip_split_hook(scheduler: SchedulerHooks, skip: bool = True) -> None:
    """Bind vLLM's ``Scheduler._mamba_block_aligned_split`` on ``scheduler`` itself, so the
    override costs nothing while no chunk has to end exactly at a boundary of ours (vLLM calls
    it for every running request at every step); ``skip=False`` puts the override back, as does
    ``scheduler.split_hook_always``."""
    if not skip or scheduler.split_hook_always:
        scheduler.__dict__.pop("_mamba_block_aligned_split", None)
        return
    vllm: Any = super(SchedulerHooks, scheduler)
    scheduler._mamba_block_aligned_split = vllm._mamba_block_aligned_split  # type: ignore[method-assign]


def set_retention_interval(scheduler: Any, interval: int | None) -> bool:
    """Set the snapshot retention interval of ``scheduler``'s cache: the coordinator's
    ``retention_interval`` (read by ``KVCacheCoordinator.cache_blocks`` at every step and handed
    to ``MambaManager.cache_blocks`` -> ``reachable_block_mask``; ``None``: a state at every
    block) and ``KVCacheConfig.prefix_cache_retention_interval``, where vLLM set both in
    ``KVCacheCoordinator.__init__``. False (nothing set) on another vLLM release."""
    if not check_vllm_version("periodic snapshots"):
        return False
    scheduler.kv_cache_manager.coordinator.retention_interval = interval
    scheduler.kv_cache_config.prefix_cache_retention_interval = interval
    return True


def enable_exact_stops(scheduler: Any) -> bool:
    """Let vLLM cache a Mamba state inside a block at a boundary of ours; True if it did.

    vLLM 0.32 caches a state inside a block only at a prefix-match-unit (``U``) boundary,
    through ``MambaManager._cache_partial_tail_block``: at the prompt's tail, and, where the
    manager's ``shared_prefix_checkpoint`` is set, at a chunk end equal to the request's
    ``shared_prefix_boundary``. vLLM sets that flag only for EAGLE (``KVCacheManager.__init__``);
    nothing in the manager's path depends on EAGLE, so it is set on each Mamba manager when the
    scheduler takes sub-block hits (``Scheduler.mamba_partial_cache_hit``: align mode, ``U``
    below the block, partial hash hits on), no MTP re-prefill tail shifts ``cache_blocks``'s
    token count (``KVCacheCoordinator.num_reprefillable_tokens``, vLLM's own condition), and
    every other manager is a ``FullAttentionManager`` (whose partial entries the cache control
    adds itself). Chunks then end there through :class:`SchedulerHooks`."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    if not check_vllm_version("sub-block breakpoint states"):
        return False
    if not getattr(scheduler, "mamba_partial_cache_hit", False):
        return False
    coordinator = scheduler.kv_cache_manager.coordinator
    if getattr(coordinator, "num_reprefillable_tokens", 0) != 0:
        return False
    managers = coordinator.single_type_managers
    mamba = [m for m in managers if isinstance(m, MambaManager)]
    if not mamba or not all(hasattr(m, "shared_prefix_checkpoint") for m in mamba):
        return False
    others = [m for m in managers if not isinstance(m, MambaManager)]
    if not others or not all(map(is_full_attention, others)):
        return False
    for manager in mamba:
        manager.shared_prefix_checkpoint = True
    return True


class CacheBoundary(Protocol):
    """What :func:`replace_cache_blocks` asks at a block boundary past a prompt
    (``output_states.OutputStates``)."""

    block_tokens: int

    def keeps(self, request: Any, tokens: int) -> bool:
        """Whether the state at ``tokens`` (a block boundary past the prompt, not computed
        yet) joins the replay boundaries of this step's ``cache_blocks``."""

    def kept(self, request: Any, tokens: int) -> None:
        """After vLLM's managers cached the blocks of a step that kept ``tokens``."""


def replace_cache_blocks(coordinator: Any, boundary: CacheBoundary | None = None) -> bool:
    """Replace ``KVCacheCoordinator.cache_blocks(request, num_computed_tokens)`` on one
    coordinator instance (``vllm/v1/core/kv_cache_coordinator.py``; every caller goes through
    it: ``KVCacheManager.allocate_slots`` for every scheduled request at every step, the
    scheduler's connector paths) by vLLM's loop, written out here so that the two additions
    cost no Python frame of their own:

    * the mid-block guard on each align-mode ``MambaManager`` that
      :func:`keep_mid_block_mamba_states_unhashed` prepared (its table of where each request's
      state stands), before that manager's ``cache_blocks``;
    * where ``boundary`` is given, at a block boundary ``n`` past the prompt that the request
      has not computed yet, ``n`` joins ``replay_boundaries`` when ``boundary.keeps`` says so,
      and ``boundary.kept`` runs after the loop.

    vLLM's loop: each manager with ``enable_caching`` gets ``cache_blocks(request,
    get_num_cacheable_tokens(n, group), retention_interval=..., replay_boundaries=
    replay_boundaries(num_prompt_tokens, scheduler_block_size, use_eagle))``. False (nothing
    replaced) on another vLLM release."""
    from vllm.v1.core.kv_cache_coordinator import replay_boundaries

    if not check_vllm_version("the coordinator's cache_blocks"):
        return False
    cacheable = coordinator.get_num_cacheable_tokens
    eagle, scheduler_block = bool(coordinator.eagle_group_ids), coordinator.scheduler_block_size
    #: (group id, manager, its cache_blocks, its mid-block guard or None), caching groups only
    caching = [
        (group_id, manager, manager.cache_blocks, manager.__dict__.get(STATE_AT))
        for group_id, manager in enumerate(coordinator.single_type_managers)
        if manager.enable_caching
    ]
    block = boundary.block_tokens if boundary is not None else 0

    def cache_blocks(request: Any, num_computed_tokens: int) -> None:
        prompt = request.num_prompt_tokens
        boundaries = replay_boundaries(prompt, scheduler_block, True) if eagle else (prompt - 1,)
        kept = (
            boundary is not None
            and num_computed_tokens > prompt
            and not num_computed_tokens % block
            and request.num_computed_tokens < num_computed_tokens
            and boundary.keeps(request, num_computed_tokens)
        )
        if kept:
            boundaries = (*boundaries, num_computed_tokens)
        interval = coordinator.retention_interval
        for group_id, manager, cache, state_at in caching:
            tokens = cacheable(num_computed_tokens, group_id)
            if state_at is not None:  # keep_mid_block_mamba_states_unhashed's guard
                rid = request.request_id
                start = state_at.get(rid, 0)
                if start % manager.block_size:
                    index = start // manager.block_size
                    end = (index + 1) * manager.block_size
                    if (
                        tokens > end
                        and manager.num_cached_block.get(rid, 0) == index
                        and manager._checkpoints.get(rid) != (end, index)
                    ):
                        manager.num_cached_block[rid] = index + 1
                if tokens > start:
                    state_at[rid] = tokens
            cache(request, tokens, retention_interval=interval, replay_boundaries=boundaries)
        if kept:
            boundary.kept(request, num_computed_tokens)

    coordinator.cache_blocks = cache_blocks
    return True


#: The attribute of a prepared ``MambaManager`` (:func:`keep_mid_block_mamba_states_unhashed`):
#: request id -> the token position its state stands at.
STATE_AT = "_hy_state_at"


def keep_mid_block_mamba_states_unhashed(coordinator: Any) -> bool:
    """Never cache an align-mode Mamba block that holds the state at a position *inside* it
    under its full-block hash (``vllm/v1/core/single_type_kv_cache_manager.py``,
    ``MambaManager``), for an engine's ``KVCacheCoordinator``.

    vLLM caps ``num_cached_block`` at a sub-block hit's block ("cache_blocks() re-caches the
    private copy once full"). That is right for attention, whose copy is filled up to the block's
    end by the next forward. A Mamba block holds one state: after the hit at ``h`` (inside
    block ``i``) a chunk that runs past ``(i + 1) * B`` writes its state into a later block, so
    block ``i`` keeps the state at ``h``. vLLM then hashes it as the state at ``(i + 1) * B``,
    and a later request sharing that block resumes from the wrong state. The same holds for a
    running request whose last chunk stopped inside block ``i``. Each align-mode manager gets a
    table of where each request's state stood before the step (its ``add_local_computed_blocks``
    and ``pop_blocks_for_free`` are wrapped to keep it), and the coordinator's ``cache_blocks``
    (:func:`replace_cache_blocks`) counts block ``i`` as cached (unhashed) before that manager's
    loop in that case; a step that ends exactly at the block's end (the state is written into
    it) or whose prefill checkpoint is that block is left alone. Installed per engine with
    prefix caching (``scheduler.activate``), every policy; only on the pinned release;
    idempotent. True when at least one manager is prepared."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    if not check_vllm_version("Mamba blocks hashed only at their end state"):
        return False
    managers = getattr(coordinator, "single_type_managers", ())
    align = [m for m in managers if isinstance(m, MambaManager) and m.mamba_cache_mode == "align"]
    for manager in align:
        if STATE_AT not in manager.__dict__:
            _track_mamba_states(manager)
    return bool(align) and replace_cache_blocks(coordinator)


def _track_mamba_states(manager: Any) -> None:
    table: dict[str, int] = {}
    add_local, pop = manager.add_local_computed_blocks, manager.pop_blocks_for_free

    @functools.wraps(add_local)
    def add_local_computed_blocks(
        request_id: str,
        new_computed_blocks: Any,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        add_local(
            request_id, new_computed_blocks, num_local_computed_tokens, num_external_computed_tokens
        )
        table[request_id] = num_local_computed_tokens + num_external_computed_tokens

    @functools.wraps(pop)
    def pop_blocks_for_free(request_id: str) -> Any:
        table.pop(request_id, None)
        return pop(request_id)

    manager.add_local_computed_blocks = add_local_computed_blocks
    manager.pop_blocks_for_free = pop_blocks_for_free
    setattr(manager, STATE_AT, table)


def observe_prefix_lookups(kv_cache_manager: Any, observe: Callable[[Any, Any, int], None]) -> bool:
    """Wrap ``KVCacheManager.get_computed_blocks(request) -> (blocks, hit_tokens,
    shared_prefix_boundary)`` on one manager instance so ``observe(request, blocks,
    hit_tokens)`` sees every local prefix-cache hit as vLLM returns it (test harnesses check
    each hit's blocks; ``Scheduler._get_local_prefix_cache_hit`` calls it). False (nothing
    wrapped) on another vLLM release."""
    if not check_vllm_version("prefix-lookup checks"):
        return False
    lookup = kv_cache_manager.get_computed_blocks

    def get_computed_blocks(request: Any) -> Any:
        found = lookup(request)
        observe(request, found[0], found[1])
        return found

    kv_cache_manager.get_computed_blocks = get_computed_blocks
    return True
