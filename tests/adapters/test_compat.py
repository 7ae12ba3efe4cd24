"""The compatibility layer (``adapters/vllm/compat/``) against the installed vLLM: one contract
test per name of the layer (what it reaches exists, with the signature and return shape it
relies on), the check that nothing outside the layer reaches a private vLLM name
(``private_access.py`` states the rules), and docs/compat.md's table == the layer."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the cpu extra")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    BlockHash,
    make_block_hash_with_group_id,
)

from tests.adapters import private_access  # noqa: E402
from vllm_hybrid.adapters.vllm import compat, version  # noqa: E402
from vllm_hybrid.adapters.vllm.compat import block_pool as compat_pool  # noqa: E402
from vllm_hybrid.adapters.vllm.compat import patches  # noqa: E402
from vllm_hybrid.adapters.vllm.compat import scheduler as compat_sched  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "compat.md"


def source(obj: Any) -> str:
    return inspect.getsource(obj)


def params(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def named_params(function: Any) -> set[str]:
    """Parameter names, without ``*args``/``**kwargs``."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    found = inspect.signature(function).parameters.values()
    return {p.name for p in found if p.kind not in variadic}


def returns(function: Any) -> Any:
    """The return annotation (vLLM's modules evaluate theirs)."""
    return inspect.signature(function).return_annotation


def vllm_file(relative: str) -> str:
    import vllm

    return (Path(vllm.__file__).parent / relative).read_text()


# ------------------------------------------------------------------------------ scheduler
def test_contract_SchedulerHooks() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    lookup = Scheduler._get_local_prefix_cache_hit
    assert params(lookup) == ["self", "request"]
    assert returns(lookup) == tuple[KVCacheBlocks, int, int, bool]
    assert params(Scheduler._mamba_block_aligned_split)[:3] == ["self", "request", "num_new_tokens"]
    assert "self.mamba_shared_prefix_checkpoint" in source(Scheduler._mamba_block_aligned_split)
    free = Scheduler._free_request
    assert params(free) == ["self", "request", "delay_free_blocks"]
    assert returns(free) == tuple[dict[str, Any] | None, dict[str, Any] | None]
    schedule = source(Scheduler.schedule)  # vLLM calls them on self, so overrides run
    assert "request.shared_prefix_boundary,\n" in schedule
    assert "= self._get_local_prefix_cache_hit(request)" in schedule
    assert "self._mamba_block_aligned_split(" in schedule
    assert "self._free_request(" in source(Scheduler.finish_requests)
    # the wait hook: asked per waiting request before its lookup; False skips it this step
    assert params(Scheduler._handle_blocked_waiting_request) == ["self", "request"]
    assert returns(Scheduler._handle_blocked_waiting_request) is bool
    assert "ready_to_schedule = self._handle_blocked_waiting_request(request)" in schedule
    skip = schedule.index("if not ready_to_schedule:")
    assert "skip_request(request_queue)" in schedule[skip : skip + 80]
    assert skip < schedule.index("= self._get_local_prefix_cache_hit(request)")
    hooks = ("before_prefix_lookup", "after_prefix_lookup", "ends_chunk_exactly", "holds_back")
    for name in (*hooks, "before_free_request", "after_free_request", "hooks_active"):
        assert not hasattr(Scheduler, name) and not hasattr(AsyncScheduler, name), name


def _bare_scheduler() -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler

    class Probe(compat_sched.SchedulerHooks, Scheduler):
        pass

    return Probe.__new__(Probe)  # no __init__: only the methods matter here


def test_contract_skip_split_hook() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    probe = _bare_scheduler()
    assert (
        probe._mamba_block_aligned_split.__func__
        is compat_sched.SchedulerHooks.__dict__["_mamba_block_aligned_split"]
    )
    compat.skip_split_hook(probe)
    assert probe._mamba_block_aligned_split.__func__ is Scheduler._mamba_block_aligned_split
    compat.skip_split_hook(probe, skip=False)  # a sub-block stop is pending: the hook again
    assert (
        probe._mamba_block_aligned_split.__func__
        is compat_sched.SchedulerHooks.__dict__["_mamba_block_aligned_split"]
    )


def test_contract_set_retention_interval() -> None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.kv_cache_interface import KVCacheConfig

    assert "self.retention_interval = kv_cache_config.prefix_cache_retention_interval" in (
        source(KVCacheCoordinator.__init__)
    )
    assert "retention_interval=self.retention_interval" in source(KVCacheCoordinator.cache_blocks)
    assert "prefix_cache_retention_interval" in KVCacheConfig.__dataclass_fields__
    sched = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(retention_interval=0)),
        kv_cache_config=SimpleNamespace(prefix_cache_retention_interval=0),
    )
    assert compat.set_retention_interval(sched, 256)
    assert sched.kv_cache_manager.coordinator.retention_interval == 256
    assert sched.kv_cache_config.prefix_cache_retention_interval == 256


def test_contract_enable_exact_stops() -> None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager, SingleTypeKVCacheManager

    assert "self.shared_prefix_checkpoint = False" in source(SingleTypeKVCacheManager.__init__)
    assert "self.shared_prefix_checkpoint" in source(MambaManager)
    assert "self.mamba_partial_cache_hit = (" in source(Scheduler.__init__)
    assert "self.num_reprefillable_tokens =" in source(KVCacheCoordinator.__init__)
    fake = SimpleNamespace(mamba_partial_cache_hit=False, kv_cache_manager=None)
    assert compat.enable_exact_stops(fake) is False  # no sub-block hits: nothing touched


def test_contract_replace_cache_blocks() -> None:
    """vLLM's coordinator loop as we write it out: its signature, what it hands each manager,
    and the replay boundaries it computes."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator, replay_boundaries
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    assert params(KVCacheCoordinator.cache_blocks) == ["self", "request", "num_computed_tokens"]
    assert "self.coordinator.cache_blocks(request" in source(KVCacheManager)
    loop = source(KVCacheCoordinator.cache_blocks)
    for part in (
        "replay_boundaries(",
        "if not manager.enable_caching:",
        "self.get_num_cacheable_tokens(num_computed_tokens, group_id)",
        "retention_interval=self.retention_interval",
        "replay_boundaries=boundaries",
    ):
        assert part in loop
    assert replay_boundaries(300, 128, use_eagle=False) == (299,)
    inner = inspect.signature(SingleTypeKVCacheManager.cache_blocks).parameters
    assert list(inner)[:4] == ["self", "request", "num_tokens", "retention_interval"]
    assert inner["replay_boundaries"].kind is inspect.Parameter.KEYWORD_ONLY
    calls: list[tuple[int, int | None, tuple[int, ...]]] = []

    def cache(request: Any, tokens: int, retention_interval: Any, replay_boundaries: Any) -> None:
        calls.append((tokens, retention_interval, replay_boundaries))

    managers = [
        SimpleNamespace(enable_caching=True, cache_blocks=cache),
        SimpleNamespace(enable_caching=False, cache_blocks=cache),
    ]
    coordinator = SimpleNamespace(
        single_type_managers=managers,
        get_num_cacheable_tokens=lambda n, group: n - 1,
        eagle_group_ids=set(),
        scheduler_block_size=128,
        retention_interval=0,
    )
    assert compat.replace_cache_blocks(coordinator)
    coordinator.cache_blocks(SimpleNamespace(num_prompt_tokens=300, num_computed_tokens=0), 257)
    assert calls == [(256, 0, (299,))]


def test_contract_observe_prefix_lookups() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert returns(KVCacheManager.get_computed_blocks) == tuple[KVCacheBlocks, int, int]
    seen = []
    manager = SimpleNamespace(get_computed_blocks=lambda request: ("blocks", 16, 32))
    assert compat.observe_prefix_lookups(manager, lambda *a: seen.append(a))
    assert manager.get_computed_blocks("r") == ("blocks", 16, 32)
    assert seen == [("r", "blocks", 16)]


# ------------------------------------------------------------------------------ block pool
class Recording(compat.HookedBlockPool):
    def on_hash_inserted(self, key: Any, block: Any, num_tokens: Any) -> None:
        self.log.append(("insert", key, block.block_id, num_tokens))

    def on_hashes_removed(self, block: Any, removed: Any) -> None:
        self.log.append(("remove", block.block_id, list(removed)))


def recording_pool(**kwargs: Any) -> Any:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4, **kwargs)
    assert compat.swap_pool_class(pool, Recording)
    pool.log = []
    return pool


def fake_request(n_blocks: int) -> Any:
    hashes = [BlockHash(f"h{i}".encode()) for i in range(n_blocks)]
    return SimpleNamespace(request_id="r", block_hashes=hashes)


def test_contract_HookedBlockPool() -> None:
    assert params(BlockPool._insert_block_hash) == [
        "self",
        "block_hash_with_group_id",
        "block",
        "num_tokens",
    ]
    assert params(BlockPool._remove_cached_block_hashes) == ["self", "block"]
    pool = recording_pool()
    blocks = pool.get_new_blocks(2)
    assert [kind for kind, *_ in pool.log] == ["remove", "remove"]  # vLLM's reuse of a block
    pool.log.clear()
    pool.cache_full_blocks(fake_request(2), blocks, 0, 2, 4, 0)  # through _insert_block_hash
    key0 = make_block_hash_with_group_id(BlockHash(b"h0"), 0)
    assert pool.log[:1] == [("insert", key0, blocks[0].block_id, 4)] and len(pool.log) == 2
    pool.free_blocks(blocks)
    pool.evict_blocks({blocks[0].block_id})  # through _remove_cached_block_hashes
    assert pool.log[-1] == ("remove", blocks[0].block_id, [key0])


def test_contract_swap_pool_class(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4)
    free = pool.get_num_free_blocks()
    with pytest.raises(TypeError, match="not a HookedBlockPool"):
        compat.swap_pool_class(pool, BlockPool)  # type: ignore[arg-type]
    monkeypatch.setattr(compat_pool, "check_vllm_version", lambda what: False)
    assert not compat.swap_pool_class(pool, Recording) and type(pool) is BlockPool
    monkeypatch.undo()
    assert compat.swap_pool_class(pool, Recording) and type(pool) is Recording
    assert pool.get_num_free_blocks() == free  # vLLM's state kept
    with pytest.raises(TypeError, match="expected vLLM's BlockPool"):
        compat.swap_pool_class(pool, Recording)


def test_contract_cache_block_key() -> None:
    pool = recording_pool()
    (block,) = pool.get_new_blocks(1)
    pool.log.clear()
    key = make_block_hash_with_group_id(BlockHash(b"k"), 1)
    compat.cache_block_key(pool, key, block, 4)
    assert pool.get_cached_block(BlockHash(b"k"), [1]) == [block]
    assert pool.log == [("insert", key, block.block_id, 4)]


def test_contract_drop_cached_hashes() -> None:
    from vllm.distributed.kv_events import BlockRemoved

    pool = recording_pool(enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(1)
    key = make_block_hash_with_group_id(BlockHash(b"h0"), 0)
    compat.cache_block_key(pool, key, blocks[0], 4)
    assert compat.drop_cached_hashes(pool, blocks[0]) == [key]
    assert blocks[0].block_hash is None and pool.get_cached_block(BlockHash(b"h0"), [0]) is None
    assert [type(e) for e in pool.take_events()] == [BlockRemoved]
    assert compat.drop_cached_hashes(pool, blocks[0]) == [] and not pool.take_events()


def test_contract_evict_cached_block() -> None:
    pool = recording_pool()
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(fake_request(1), blocks[:1], 0, 1, 4, 0)
    assert compat.evict_cached_block(pool, blocks[0]) is True
    assert compat.evict_cached_block(pool, blocks[1]) is False  # never cached


def test_contract_observe_hash_removals() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4)
    assert "self._remove_cached_block_hashes(block)" in source(BlockPool._maybe_evict_cached_block)
    seen: list[tuple[int, int]] = []
    assert compat.observe_hash_removals(pool, lambda b, keys: seen.append((b.block_id, len(keys))))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(fake_request(1), blocks[:1], 0, 1, 4, 0)
    assert compat.evict_cached_block(pool, blocks[0]) and seen == [(blocks[0].block_id, 1)]
    assert not compat.evict_cached_block(pool, blocks[1]) and len(seen) == 1  # held nothing


def test_contract_notify_reuse() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4)
    assert pool._reuse_watchers == {}
    blocks = pool.get_new_blocks(2)
    reused: list[int] = []
    pool.unpin_blocks(blocks[:1], on_reuse=lambda b: reused.append(b.block_id))
    compat.notify_reuse(pool, blocks)
    compat.notify_reuse(pool, blocks)  # a watcher fires once
    assert reused == [blocks[0].block_id] and pool._reuse_watchers == {}


# ------------------------------------------------------------------------------ patches
def test_contract_install_scheduler_selector() -> None:
    from vllm.config.scheduler import SchedulerConfig
    from vllm.v1.engine.core import EngineCore

    init = source(EngineCore.__init__)
    assert "Scheduler = vllm_config.scheduler_config.get_scheduler_cls()" in init
    assert "self.scheduler: SchedulerInterface = Scheduler(" in init
    assert "kv_cache_config=kv_cache_config," in init
    import vllm

    callers = [
        p
        for p in Path(vllm.__file__).parent.rglob("*.py")
        if "get_scheduler_cls()" in p.read_text(errors="ignore")
    ]
    assert [p.name for p in callers] == ["core.py"]  # EngineCore only
    assert params(SchedulerConfig.get_scheduler_cls) == ["self"]
    choice = patches.SchedulerChoice(dict, lambda default, v, k: SimpleNamespace)
    built = choice(vllm_config="v", kv_cache_config="k")  # builds the chosen class
    assert built == SimpleNamespace(vllm_config="v", kv_cache_config="k")


def test_contract_wrap_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_hybrid.adapters.vllm.plugin import hook_engine_config

    assert hook_engine_config()  # the plugin's own hooks (idempotent: installed once)
    # vLLM's own signature, seen through the wrapper's __wrapped__
    assert params(EngineArgs.create_engine_config) == ["self", "usage_context", "headless"]
    assert "engine_args.create_engine_config(usage_context)" in vllm_file("v1/engine/llm_engine.py")
    assert "engine_args.create_engine_config(" in vllm_file(
        "entrypoints/launchers/api_server/entry.py"
    )
    assert getattr(EngineArgs.create_engine_config, patches.MARK, False)
    # the model-config hook: vLLM builds the ModelConfig first, with no argument
    assert params(EngineArgs.create_model_config) == ["self"]
    assert "model_config = self.create_model_config()" in vllm_file("engine/arg_utils.py")
    assert getattr(EngineArgs.create_model_config, patches.MARK, False)


def test_contract_declare_scheduler_stats_field() -> None:
    import dataclasses

    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    assert dataclasses.is_dataclass(SchedulerStats)
    assert compat.declare_scheduler_stats_field("vllm_hybrid_probe")
    stats = SchedulerStats()
    assert stats.vllm_hybrid_probe is None  # type: ignore[attr-defined]
    stats.vllm_hybrid_probe = {"x": 1.0}  # type: ignore[attr-defined]
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    got = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats
    assert got.vllm_hybrid_probe == {"x": 1.0}  # type: ignore[union-attr]


def test_contract_replace_cpu_mamba2_ops() -> None:
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mixer2
    import vllm.model_executor.layers.mamba.ops.ssd_combined as ssd_combined
    from vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm import (
        _mamba_chunk_scan_combined_fwd_cpu as vllm_scan,
    )
    from vllm.model_executor.layers.mamba.ops.ssd_checkpoint import store_prefill_checkpoint

    from vllm_hybrid.adapters.vllm import cpu_mamba2

    assert "_mamba_chunk_scan_combined_fwd" in vars(ssd_combined)
    varlen = source(ssd_combined.mamba_chunk_scan_combined_varlen)
    assert "= _mamba_chunk_scan_combined_fwd(" in varlen  # looked up at call time
    assert "store_prefill_checkpoint(" in source(mixer2)  # called through the module global
    ours = named_params(cpu_mamba2.mamba_chunk_scan_combined_fwd_cpu)
    assert named_params(vllm_scan) <= ours
    assert params(store_prefill_checkpoint) == params(cpu_mamba2.store_prefill_checkpoint_cpu)


def test_contract_replace_cpu_selective_scan() -> None:
    """selective_scan_fn calls ``ops.selective_scan_fwd`` through the module at call time with
    the arguments our drop-in takes, and returns z (or delta), which the op wrote in place."""
    import vllm._custom_ops as custom_ops
    import vllm.model_executor.layers.mamba.ops.mamba_ssm as mamba_ssm

    from vllm_hybrid.adapters.vllm import cpu_mamba1

    text = source(mamba_ssm.selective_scan_fn)
    assert "ops.selective_scan_fwd(" in text and "return z" in text and "return delta" in text
    assert "from vllm import _custom_ops as ops" in source(mamba_ssm)
    vllms = getattr(custom_ops.selective_scan_fwd, "__wrapped__", custom_ops.selective_scan_fwd)
    if vllms is not cpu_mamba1.selective_scan_fwd_cpu:
        assert params(vllms) == params(cpu_mamba1.selective_scan_fwd_cpu)[: len(params(vllms))]
    assert patches.replace_cpu_selective_scan(cpu_mamba1.selective_scan_fwd_cpu)
    assert custom_ops.selective_scan_fwd is cpu_mamba1.selective_scan_fwd_cpu


def test_contract_replace_mamba1_state_update() -> None:
    """Mamba1's decode calls ``selective_state_update`` through mamba_mixer.py's module global
    with vLLM's keywords; Mamba2's mixer has its own binding."""
    import vllm.model_executor.layers.mamba.mamba_mixer as mixer
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mixer2
    from vllm.model_executor.layers.mamba.ops import ssu_dispatch

    from vllm_hybrid.adapters.vllm import cpu_mamba1

    text = source(mixer.MambaMixer.forward_impl)
    assert "selective_state_update(\n                ssm_state," in text
    for keyword in ("z=", "dt_softplus=", "state_batch_indices=", "out="):
        assert keyword in text.split("selective_state_update(")[1], keyword
    assert named_params(ssu_dispatch.selective_state_update) <= named_params(
        cpu_mamba1.mamba1_state_update
    )
    assert patches.replace_mamba1_state_update(cpu_mamba1.mamba1_state_update)
    assert mixer.selective_state_update is cpu_mamba1.mamba1_state_update
    assert mixer2.selective_state_update is not cpu_mamba1.mamba1_state_update


def test_contract_contiguous_mamba1_out_proj_inputs() -> None:
    import torch
    import vllm.model_executor.layers.mamba.mamba_mixer as mixer

    assert "scan_outputs_combined.transpose(-2, -1))[0]" in source(mixer.MambaMixer.forward_impl)
    assert "self.out_proj = " in source(
        getattr(mixer.MambaMixer.__init__, "__wrapped__", mixer.MambaMixer.__init__)
    )
    assert patches.contiguous_mamba1_out_proj_inputs()
    assert patches.contiguous_mamba1_out_proj_inputs()  # idempotent
    assert patches._marked(mixer.MambaMixer.__init__)
    seen = []
    layer = torch.nn.Identity()
    layer.register_forward_hook(lambda m, args, out: seen.append(args[0].stride(-1)))
    layer.register_forward_pre_hook(patches.contiguous_first_input)
    layer(torch.zeros(3, 5).t())
    layer(torch.zeros(5, 3))
    assert seen == [1, 1]


def test_contract_replace_kv_block_copy() -> None:
    import vllm.v1.worker.utils as worker_utils

    from vllm_hybrid.adapters.vllm import kv_copy

    vllms = kv_copy.VLLM_KV_CACHE_BLOCK_COPY or worker_utils.copy_kv_cache_blocks_inplace
    assert params(vllms) == ["kv_caches", "num_blocks", "kv_cache_block_copies"]
    assert params(kv_copy.copy_kv_cache_blocks_every_view) == params(vllms)
    for name in patches.RUNNER_MODULES:
        text = vllm_file(name.removeprefix("vllm.").replace(".", "/") + ".py")
        assert "    copy_kv_cache_blocks_inplace,\n" in text, name  # bound by name at import


def test_contract_flatten_cpu_rotary_inputs() -> None:
    """vLLM's CPU rotary hands q/k to the in-place op as given and returns them; LFM2 (dense
    and MoE) gives them in 3D, which is why the wrapper exists."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    forward_cpu = RotaryEmbedding.forward_cpu  # not wrapped: the fix sits on LFM2's layers
    assert params(forward_cpu) == ["self", "positions", "query", "key"]
    text = source(forward_cpu)
    assert "ops.rotary_embedding(" in text and "return query, key" in text
    for name in ("lfm2", "lfm2_moe"):
        model = vllm_file(f"model_executor/models/{name}.py")
        assert "q = q.view(n_tokens, self.num_heads, self.head_dim)" in model, name
        assert "q, k = self.rotary_emb(positions, q, k)" in model, name


def test_contract_replace_cpu_gdn_attention_core() -> None:
    """vLLM's op: its signature, registered by name from the module at first layer build."""
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn

    from vllm_hybrid.adapters.vllm import cpu_gdn

    vllms = cpu_gdn.VLLM_CPU_GDN_CORE or gdn.cpu_gdn_attention_core
    names = ["mixed_qkv", "b", "a", "core_attn_out", "layer_name"]
    assert params(vllms) == names and params(cpu_gdn.cpu_gdn_attention_core) == names
    assert "op_func=cpu_gdn_attention_core" in source(gdn.register_cpu_gdn_attention_ops)
    assert "CPU GDN attention requires BF16." in source(vllms)
    assert "_cpu_gdn_attention_nonspec(" in source(vllms)
    assert isinstance(gdn._CPU_GDN_ATTENTION_OPS_REGISTERED, bool)


def test_contract_replace_olmo_gdn_forward_core() -> None:
    """The three OLMo-Hybrid names are module globals looked up when a layer is built or run,
    and the conv loader gets the shard from the tensor as ``WeightsMapper.apply`` puts it."""
    import torch
    from vllm.model_executor.layers.mamba.gdn import olmo_gdn_linear_attn as olmo
    from vllm.model_executor.models.utils import WeightsMapper

    init = source(olmo.OlmoHybridGatedDeltaNetAttention.__init__)
    assert "set_triton_allocator(" in init and "_make_fused_conv1d_weight_loader(" in init
    assert "self._forward_core(" in source(olmo.OlmoHybridGatedDeltaNetAttention._full_forward)
    assert "weight_loader(param, weight_data)" in vllm_file("model_executor/models/utils.py")
    assert "shard_data.shard_id = one_shard_id" in source(WeightsMapper.apply)
    core_params = ["self", "mixed_qkv", "b", "a", "core_attn_out"]
    original = olmo.OlmoHybridGatedDeltaNetAttention._forward_core
    assert params(getattr(original, "__wrapped__", original)) == core_params
    from vllm_hybrid.adapters.vllm import cpu_gdn

    assert patches.replace_olmo_gdn_forward_core(cpu_gdn.olmo_forward_core_cpu)
    assert patches.replace_olmo_gdn_forward_core(cpu_gdn.olmo_forward_core_cpu)  # idempotent
    installed = olmo.OlmoHybridGatedDeltaNetAttention._forward_core
    assert patches._marked(installed) and params(installed.__wrapped__) == core_params
    assert olmo.set_triton_allocator("cpu") is None
    loader = olmo._make_fused_conv1d_weight_loader([2, 2, 4], 1, 0)
    param = torch.nn.Parameter(torch.zeros(8, 1, 3), requires_grad=False)
    weight = torch.ones(2, 3)
    weight.shard_id = 1  # type: ignore[attr-defined]
    loader(param, weight)
    assert param[2:4].eq(1).all() and param[:2].eq(0).all() and param[4:].eq(0).all()


def test_contract_forward_context_layer() -> None:
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn
    from vllm.utils.torch_utils import _encode_layer_name, _resolve_layer_name

    from vllm_hybrid.adapters.vllm import cpu_gdn

    text = source(cpu_gdn.VLLM_CPU_GDN_CORE or gdn.cpu_gdn_attention_core)
    assert "_resolve_layer_name(layer_name)" in text and "no_compile_layers[" in text
    assert _resolve_layer_name(_encode_layer_name("model.layers.0.linear_attn")) == (
        "model.layers.0.linear_attn"
    )


def test_contract_keep_mid_block_mamba_states_unhashed() -> None:
    """vLLM caps a sub-block hit's cached count at its block (for attention's sake), keeps the
    prefill checkpoint per request, and the three wrapped methods keep their signatures."""
    from vllm.v1.core.single_type_kv_cache_manager import (
        MambaManager,
        SingleTypeKVCacheManager,
    )

    base = source(SingleTypeKVCacheManager.add_local_computed_blocks)
    assert "self.num_cached_block[request_id] = block_idx" in base
    assert "self._checkpoints[request_id] = (" in source(MambaManager.get_num_blocks_to_allocate)
    assert params(SingleTypeKVCacheManager.add_local_computed_blocks) == [
        "self",
        "request_id",
        "new_computed_blocks",
        "num_local_computed_tokens",
        "num_external_computed_tokens",
    ]
    assert named_params(MambaManager.cache_blocks) >= {
        "self",
        "request",
        "num_tokens",
        "retention_interval",
        "replay_boundaries",
    }
    assert params(MambaManager.pop_blocks_for_free) == ["self", "request_id"]
    for name in ("num_cached_block", "_checkpoints", "mamba_cache_mode", "block_size"):
        assert f"self.{name}" in source(MambaManager) + source(SingleTypeKVCacheManager.__init__)
    coordinator = SimpleNamespace(single_type_managers=[object()])
    assert not compat.keep_mid_block_mamba_states_unhashed(coordinator)
    assert not vars(coordinator).keys() - {"single_type_managers"}


#: Imports vLLM's Qwen3.5 model code in a fresh interpreter (argv[1] == "patched": after the
#: stand-in) and prints what the Qwen2-VL image module resolves to.
QWEN3_5_IMPORT = """
import sys
from vllm_hybrid.adapters.vllm.compat import patches
if sys.argv[1] == "patched":
    assert patches.import_qwen3_5_without_torchvision()
    assert patches.import_qwen3_5_without_torchvision()  # idempotent
import vllm.model_executor.models.qwen3_5 as qwen3_5
import importlib
image = importlib.import_module("transformers.models.qwen2_vl.image_processing_qwen2_vl")
pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
assert image.smart_resize is pil.smart_resize
assert image.Qwen2VLImageProcessor is pil.Qwen2VLImageProcessorPil
print("ok", qwen3_5.Qwen3_5ForCausalLM.__name__, qwen3_5.Qwen3_5MoeForCausalLM.__name__)
"""


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed"
)
def test_contract_import_qwen3_5_without_torchvision() -> None:
    """Without torchvision vLLM's qwen3_5.py fails to import (qwen3_vl.py -> transformers'
    image_processing_qwen2_vl -> torchvision); with the stand-in it imports, and the names
    qwen3_vl.py takes from that module are the PIL twin's."""
    env = {**os.environ, "VLLM_HYBRID_ENABLE": "0"}  # no plugin: vLLM's import as it is
    run = [sys.executable, "-c", QWEN3_5_IMPORT]
    bare = subprocess.run([*run, "bare"], capture_output=True, text=True, env=env, timeout=300)
    assert bare.returncode != 0
    assert "No module named 'torchvision'" in bare.stderr
    assert "image_processing_qwen2_vl" in bare.stderr
    patched = subprocess.run(
        [*run, "patched"], capture_output=True, text=True, env=env, timeout=300
    )
    assert patched.returncode == 0, patched.stderr[-2000:]
    assert "ok Qwen3_5ForCausalLM Qwen3_5MoeForCausalLM" in patched.stdout


def test_contract_cpu_rotary_flattened() -> None:
    assert patches.flatten_cpu_rotary_inputs() and compat.cpu_rotary_flattened()


# ------------------------------------------------------------------------------ server state
def test_contract_server_vllm_config() -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state

    assert "state.vllm_config = vllm_config" in source(init_app_state)
    app = SimpleNamespace(state=SimpleNamespace(vllm_config="c"))
    assert compat.server_vllm_config(app) == "c" and compat.server_vllm_config(None) is None


def test_contract_server_args() -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state

    assert "state.args = args" in source(init_app_state)
    app = SimpleNamespace(state=SimpleNamespace(args="a"))
    assert compat.server_args(app) == "a" and compat.server_args(SimpleNamespace()) is None


def test_contract_anthropic_merge_inline_system() -> None:
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    assert "self._merge_inline_system = " in source(AnthropicServingMessages.__init__)
    convert = inspect.signature(AnthropicServingMessages.to_chat_completion_request)
    assert convert.parameters["merge_inline_system"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "state.anthropic_serving_messages = " in vllm_file("entrypoints/generate/api_router.py")
    serving = SimpleNamespace(_merge_inline_system=True)
    app = SimpleNamespace(state=SimpleNamespace(anthropic_serving_messages=serving))
    assert compat.anthropic_merge_inline_system(app) is True
    assert compat.anthropic_merge_inline_system(SimpleNamespace()) is False


# ------------------------------------------------------------------------------ the layer
def test_every_name_of_the_layer_has_its_contract_test() -> None:
    tests = {n for n in globals() if n.startswith("test_contract_")}
    assert tests == {f"test_contract_{name}" for name in compat.__all__}
    for name in compat.__all__:
        assert getattr(compat, name).__module__ == f"{compat.__name__}.{compat.WHERE[name]}"


def test_every_patch_is_behind_the_version_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """On another vLLM release each installer refuses and changes nothing."""
    monkeypatch.setattr(version, "installed_vllm_version", lambda: "0.31.9")
    for module in (compat_sched, patches):
        monkeypatch.setattr(module, "check_vllm_version", version.check_vllm_version)
    coordinator = SimpleNamespace()
    assert not compat.replace_cache_blocks(coordinator) and not vars(coordinator)
    manager = SimpleNamespace(get_computed_blocks=len)
    assert not compat.observe_prefix_lookups(manager, print) and manager.get_computed_blocks is len
    sched = SimpleNamespace()
    assert not compat.set_retention_interval(sched, 1) and not vars(sched)
    assert not compat.enable_exact_stops(SimpleNamespace(mamba_partial_cache_hit=True))
    assert compat.replace_kv_block_copy(print) is None
    assert not compat.replace_cpu_mamba2_ops(print, print)
    assert not compat.flatten_cpu_rotary_inputs()
    assert compat.replace_cpu_gdn_attention_core(print) is None
    assert not compat.keep_mid_block_mamba_states_unhashed(SimpleNamespace())
    if "transformers.models.qwen2_vl.image_processing_qwen2_vl" not in sys.modules:
        assert not compat.import_qwen3_5_without_torchvision()
    assert not compat.declare_scheduler_stats_field("vllm_hybrid_other_version")


def test_no_private_vllm_access_outside_the_layer() -> None:
    found = [str(f) for f in private_access.findings()]
    assert not found, "reaches into vLLM outside adapters/vllm/compat:\n" + "\n".join(found)


PROBE = """
import vllm.v1.worker.utils as worker_utils
from vllm.config.scheduler import SchedulerConfig
from vllm.v1.core import _private
from vllm.v1.core.block_pool import BlockPool


class Pool(BlockPool):
    def _insert_block_hash(self, key, block, num_tokens):
        return super()._insert_block_hash(key, block, num_tokens)

    def mine(self):
        return self._reuse_watchers, self._hy_own


def go(pool, app, manager, hybrid_pool):
    pool._maybe_evict_cached_block(None)
    getattr(app.state.anthropic_serving_messages, "_merge_inline_system", False)
    pool.__class__ = Pool
    SchedulerConfig.get_scheduler_cls = go
    setattr(SchedulerConfig, "other", 1)
    worker_utils.copy_kv_cache_blocks_inplace = None
    manager.get_computed_blocks = lambda request: None
    hybrid_pool._hy_mirror = None
    return SchedulerConfig.__dict__, hybrid_pool._hy_own
"""


def test_the_check_sees_each_kind_of_reach(tmp_path: Path) -> None:
    """A module (not importable: the scanner then reads its bases from its imports) with
    reaches of each rule, and two private names of ours that are allowed (``_hy_own``)."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    got = private_access.scan(probe, {"_hy_own"}, private_access.vllm_private_names())
    lines = PROBE.splitlines()
    by_rule: dict[str, list[str]] = {}
    for finding in got:
        by_rule.setdefault(finding.rule, []).append(lines[finding.line - 1].strip())
    assert by_rule == {
        "R7": ["from vllm.v1.core import _private"],
        "R2": [
            "def _insert_block_hash(self, key, block, num_tokens):",
            "return super()._insert_block_hash(key, block, num_tokens)",
            "return self._reuse_watchers, self._hy_own",
        ],
        "R1": ["pool._maybe_evict_cached_block(None)", "hybrid_pool._hy_mirror = None"],
        "R3": ['getattr(app.state.anthropic_serving_messages, "_merge_inline_system", False)'],
        "R4": ["pool.__class__ = Pool", "return SchedulerConfig.__dict__, hybrid_pool._hy_own"],
        "R5": [
            "SchedulerConfig.get_scheduler_cls = go",
            'setattr(SchedulerConfig, "other", 1)',
            "worker_utils.copy_kv_cache_blocks_inplace = None",
        ],
        "R6": [
            "SchedulerConfig.get_scheduler_cls = go",
            "manager.get_computed_blocks = lambda request: None",
        ],
    }


# ------------------------------------------------------------------------------ the docs
def doc_rows() -> list[list[str]]:
    """The rows of docs/compat.md's hook table (the one whose header starts with 'our name')."""
    rows, inside = [], False
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| our name"):
            inside = True
        elif inside and line.startswith("|") and not set(line) <= set("|-: "):
            rows.append(cells)
        elif inside and not line.startswith("|"):
            break
    return rows


def test_the_docs_table_lists_exactly_the_layer() -> None:
    rows = doc_rows()
    names = [re.sub(r"[`()]", "", row[0]) for row in rows]
    assert sorted(names) == sorted(compat.__all__), "docs/compat.md's table != compat.__all__"
    assert len(set(names)) == len(names)
    contract_tests = {n for n in globals() if n.startswith("test_contract_")}
    import vllm

    vllm_root = Path(vllm.__file__).parent
    for name, row in zip(names, rows, strict=True):
        assert f"`test_contract_{name}`" in row[-1] and f"test_contract_{name}" in contract_tests
        files = re.findall(r"`vllm/([\w/]+\.py)", row[1])
        assert files, f"{name}: the vLLM file it touches is not named"
        for relative in files:
            assert (vllm_root / relative).is_file(), f"{name}: no vllm/{relative}"


def test_compat_modules_import_nothing_of_the_adapter_but_version_and_config() -> None:
    """The layer sits at the bottom of the adapter: it may use the version gate and config's
    layout helpers, never the modules that use it."""
    allowed = {"vllm_hybrid.adapters.vllm.version", "vllm_hybrid.adapters.vllm.config"}
    for path in sorted(private_access.COMPAT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_hybrid"):
                assert node.module in allowed or node.module.startswith(compat.__name__), (
                    path.name,
                    node.module,
                )
