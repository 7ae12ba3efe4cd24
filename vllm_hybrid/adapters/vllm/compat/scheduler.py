"""The scheduler's internals in vLLM 0.32.0: three private methods turned into hooks, and the
scheduler-side switches the hybrid cache sets.

Sources: ``vllm/v1/core/sched/scheduler.py`` (``Scheduler``), ``vllm/v1/core/
kv_cache_coordinator.py`` (``KVCacheCoordinator``), ``vllm/v1/core/single_type_kv_cache_manager.py``
(``MambaManager``, ``FullAttentionManager``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_hybrid.adapters.vllm.config import is_full_attention
from vllm_hybrid.adapters.vllm.version import check_vllm_version


class SchedulerHooks:
    """Mixin for a subclass of vLLM's ``Scheduler`` or ``AsyncScheduler``, put before vLLM's
    class in the bases (so ``super()`` reaches vLLM's methods). It overrides three private
    methods of ``Scheduler`` and calls a named hook in each; the defaults do nothing:

    * ``_get_local_prefix_cache_hit(request)`` (vLLM returns ``(blocks, hit_tokens,
      shared_prefix_boundary, hit_diverged)``; ``Scheduler.schedule`` stores the third in
      ``request.shared_prefix_boundary``): :meth:`before_prefix_lookup` first,
      :meth:`after_prefix_lookup` chooses the boundary the request runs with.
    * ``_mamba_block_aligned_split(request, num_new_tokens, ...) -> int`` (the prefill chunk
      length in align mode): where :meth:`ends_chunk_exactly` says so, vLLM's own branch for
      shared-prefix checkpoints (``Scheduler.mamba_shared_prefix_checkpoint``, EAGLE-only in
      vLLM) is on for that call only, so the chunk ends exactly at
      ``request.shared_prefix_boundary`` rather than block-floored. :func:`skip_split_hook`
      binds vLLM's method on the instance where that can never be wanted.
    * ``_free_request(request, delay_free_blocks=False) -> (kv_transfer_params,
      ec_transfer_params)``: :meth:`before_free_request` before vLLM frees the blocks,
      :meth:`after_free_request` may replace the ``kv_transfer_params`` (which vLLM returns to
      the client in ``EngineCoreOutput``).

    Version gate: on another vLLM release the three overrides are bound away on the instance
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
            if n < num_new_tokens and self.drops_prompt_tail_stop(request):
                return extend_past_prompt_tail(self, request, num_new_tokens, n, *args)
            return n
        saved = self.mamba_shared_prefix_checkpoint
        self.mamba_shared_prefix_checkpoint = True
        try:
            return int(split(request, num_new_tokens, *args, **kwargs))
        finally:
            self.mamba_shared_prefix_checkpoint = saved

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


def replace_cache_blocks(coordinator: Any, cache_blocks: Callable[[Any, int], None]) -> bool:
    """Replace ``KVCacheCoordinator.cache_blocks(request, num_computed_tokens)`` on one
    coordinator instance (``KVCacheManager.allocate_slots`` calls it for every scheduled
    request at every step). ``cache_blocks`` does vLLM's work itself (the loop over
    ``single_type_managers`` with ``retention_interval`` and ``replay_boundaries``); False (not
    replaced) on another vLLM release."""
    if not check_vllm_version("end-of-output states"):
        return False
    coordinator.cache_blocks = cache_blocks
    return True


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
