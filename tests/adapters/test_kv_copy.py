"""The partial-hit block copy (``kv_copy``) on the KV cache layouts a GPU worker gets.

Both vLLM 0.32.0 runners take their KV cache views from the same device-agnostic code:
``get_kv_cache_config_from_groups`` (vllm/v1/core/kv_cache_utils.py) places the layers, and
``allocate_kv_cache`` (vllm/v1/worker/utils.py) views one backing buffer per layer. Only the
layout and the kernel block size differ by platform and backend: the CPU backend takes
``LBHNC``; backends that declare no layout (FlashAttention) get ``LBNHC``, the first
block-compact default; ``BL*`` layouts come from ``VLLM_KV_CACHE_LAYOUT`` or a connector;
FlashAttention may split a block into kernel blocks. Here the same two vLLM functions build
the tiny Nemotron-H's cache (Mamba layers 0, 4, 6; attention layers 2, 7; the Mamba page padded
to the attention page) on the CPU device, in those layouts, and the copy is checked against a
copy of whole pages of the backing buffer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="needs the cpu extra")

from vllm_hybrid.adapters.vllm import kv_copy, plugin, version  # noqa: E402

NUM_BLOCKS = 8
BLOCK = 16  # tokens per block
#: (layer name, group): the tiny Nemotron-H's KV cache groups, as vLLM formed them on CPU.
GROUPS = (
    ["model.layers.0.mixer", "model.layers.6.mixer"],
    ["model.layers.4.mixer"],
    ["model.layers.2.mixer.attn", "model.layers.7.mixer.attn"],
)


def _specs() -> tuple[object, object]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    attention = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32
    )  # page: 16 tokens * 2 heads * (8 + 8) * 4 bytes = 2,048 bytes
    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 40), (2, 4, 8)),
        dtypes=(torch.float32, torch.float32),
        page_size_padded=attention.page_size_bytes,  # 736 real bytes in a 2,048-byte page
        mamba_cache_mode="align",
    )
    return mamba, attention


def build(layout_name: str, kernel_block: int = BLOCK, order: str = "layer_index"):
    """The runner's ``kv_caches`` list and the backing buffer, as a worker would build them."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    mamba, attention = _specs()
    groups = [
        KVCacheGroupSpec(names, attention if "attn" in names[0] else mamba) for names in GROUPS
    ]
    stub = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=NUM_BLOCKS,
            prefix_cache_retention_interval=None,
        ),
    )
    config = get_kv_cache_config_from_groups(stub, groups, 1 << 30)
    assert config.num_blocks == NUM_BLOCKS
    views = allocate_kv_cache(config, torch.device("cpu"), layout, [BLOCK, BLOCK, kernel_block])
    names = list(views)  # allocation order: the v2 runner (vllm/v1/worker/gpu/model_runner.py)
    if order == "layer_index":  # bind_kv_cache's order: GPUModelRunner and the CPU runner
        names.sort(key=extract_layer_index)
    caches = [views[name] for name in names]
    raw = caches[0].untyped_storage()
    buf = torch.empty(0, dtype=torch.int8)
    buf.set_(raw)
    gen = torch.Generator().manual_seed(0)
    buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=gen))
    return caches, buf, layout, attention.page_size_bytes


def whole_pages(buf, layout, page: int, pairs) -> torch.Tensor:
    """The reference: ``buf`` after copying every page (each layer slot's) of each pair, one
    pair after the other (the scheduler's list is a sequence)."""
    want = buf.clone()
    if layout.is_block_outermost:  # one row per block holds every layer's page
        rows = want.view(NUM_BLOCKS, -1)
    else:  # layer-outermost: a region of NUM_BLOCKS pages per layer slot
        rows = want.view(-1, NUM_BLOCKS, page).transpose(0, 1)
    for src, dst in pairs:
        rows[dst] = rows[src].clone()
    return want


LAYOUTS = ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]


@pytest.mark.parametrize("order", ["layer_index", "allocation"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_equals_whole_pages(layout, order):
    caches, buf, lay, page = build(layout, order=order)
    pairs = [(3, 6), (1, 2)]
    want = whole_pages(buf, lay, page, pairs)
    kv_copy.copy_kv_cache_blocks_every_view(caches, NUM_BLOCKS, pairs)
    assert torch.equal(buf, want)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_kernel_block_split(layout):
    """An attention view of 2 kernel blocks per block (a FlashAttention-style split)."""
    caches, buf, lay, page = build(layout, kernel_block=BLOCK // 2)
    assert {c.shape[0] for c in caches} == {NUM_BLOCKS, 2 * NUM_BLOCKS}
    pairs = [(5, 1)]
    want = whole_pages(buf, lay, page, pairs)
    kv_copy.copy_kv_cache_blocks_every_view(caches, NUM_BLOCKS, pairs)
    assert torch.equal(buf, want)


CHAINS = {
    # Two requests partially hit one prefix in one step: the first one's CoW fills fresh block
    # 4, the second one's partial hit lands on 4 (cached as a full block this step): 5 gets 3.
    "chain": [(3, 4), (4, 5), (1, 2)],
    "read then overwritten": [(4, 5), (3, 4)],  # 5 gets 4's old bytes, then 4 gets 3's
    "written twice": [(1, 6), (2, 6)],
    "self copy": [(2, 2), (0, 7)],
}


@pytest.mark.parametrize("case", list(CHAINS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pairs_apply_in_order(layout, case):
    """The pairs' effect is that of copying them one by one, in every view and layout."""
    caches, buf, lay, page = build(layout)
    pairs = CHAINS[case]
    want = whole_pages(buf, lay, page, pairs)
    kv_copy.copy_kv_cache_blocks_every_view(caches, NUM_BLOCKS, pairs)
    assert torch.equal(buf, want)


def test_hazard_free_runs():
    runs = kv_copy._hazard_free_runs
    assert runs([(3, 6), (1, 2)]) == [[(3, 6), (1, 2)]]
    assert runs([(3, 4), (4, 5), (1, 2)]) == [[(3, 4)], [(4, 5), (1, 2)]]
    assert runs([(4, 5), (3, 4)]) == [[(4, 5)], [(3, 4)]]
    assert runs([(2, 2)]) == []


def _vllm_copy():
    assert version.check_vllm_version("the canary")  # vLLM is pinned to 0.32.0 exactly
    from vllm.v1.worker import utils as worker_utils

    copy = kv_copy.VLLM_KV_CACHE_BLOCK_COPY or worker_utils.copy_kv_cache_blocks_inplace
    assert copy is not kv_copy.copy_kv_cache_blocks_every_view
    return copy


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_vllm_copy_loses_the_attention_page_in_layer_outer_layouts(layout):
    """The bug, in the CPU layout and the GPU default (LBNHC): the backing buffer holds two
    layer slots, not NUM_BLOCKS pages, so vLLM copies per view, and the Mamba view listed first
    at each slot's address hides the attention view there. When this fails, vLLM fixed it."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    caches, buf, lay, page = build(layout)
    first = caches[0]
    assert buf.numel() == 2 * NUM_BLOCKS * page
    assert first.stride(0) * first.element_size() == page  # per-view branch: 2x the pages
    pairs = [(3, 6)]
    want = whole_pages(buf, lay, page, pairs)
    _vllm_copy()(caches, NUM_BLOCKS, [KVCacheBlockCopy(*p) for p in pairs])
    assert not torch.equal(buf, want)


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC"])
def test_vllm_copy_reads_a_chain_as_one_gather(layout):
    """vLLM's batched ``blocks[dst] = blocks[src]`` reads every source first: in a chain the
    second destination gets the first destination's stale bytes, even in the layouts it
    otherwise copies right. When this fails, vLLM fixed it."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    caches, buf, lay, page = build(layout)
    pairs = CHAINS["chain"]
    want = whole_pages(buf, lay, page, pairs)
    _vllm_copy()(caches, NUM_BLOCKS, [KVCacheBlockCopy(*p) for p in pairs])
    assert not torch.equal(buf, want)


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC"])
def test_vllm_copy_is_right_in_block_outer_layouts(layout):
    """Block-outermost: the buffer is exactly NUM_BLOCKS packed blocks; vLLM copies whole rows."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    caches, buf, lay, page = build(layout)
    pairs = [(3, 6)]
    want = whole_pages(buf, lay, page, pairs)
    _vllm_copy()(caches, NUM_BLOCKS, [KVCacheBlockCopy(*p) for p in pairs])
    assert torch.equal(buf, want)


def test_view_not_split_into_blocks_is_refused():
    with pytest.raises(ValueError, match="does not divide"):
        kv_copy.copy_kv_cache_blocks_every_view([torch.zeros(9, 4)], NUM_BLOCKS, [(0, 1)])


def test_no_copies_touch_nothing():
    cache = torch.zeros(NUM_BLOCKS + 1, 4)  # would be refused if looked at
    kv_copy.copy_kv_cache_blocks_every_view([cache], NUM_BLOCKS, [])


def test_plugin_installs_the_copy_fix_off_cpu(monkeypatch):
    """``register`` installs the copy on every platform, the CPU ops only on CPU."""
    from vllm.platforms import current_platform

    from vllm_hybrid.adapters.vllm import cpu_mamba2

    calls = []
    monkeypatch.delenv(plugin.ENV_ENABLE, raising=False)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(kv_copy, "patch_kv_cache_block_copies", lambda: calls.append("copy"))
    monkeypatch.setattr(cpu_mamba2, "patch_cpu_mamba2_prefix_caching", lambda: calls.append("cpu"))
    monkeypatch.setattr(plugin, "select_hybrid_scheduler", lambda: None)
    monkeypatch.setattr(plugin, "hook_engine_config", lambda: None)
    plugin.register()
    assert calls == ["copy"]


def test_patch_replaces_the_runner_copy():
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner
    import vllm.v1.worker.utils as worker_utils

    assert kv_copy.patch_kv_cache_block_copies()
    assert kv_copy.patch_kv_cache_block_copies()
    ours = kv_copy.copy_kv_cache_blocks_every_view
    assert worker_utils.copy_kv_cache_blocks_inplace is ours
    assert gpu_model_runner.copy_kv_cache_blocks_inplace is ours
    assert kv_copy.VLLM_KV_CACHE_BLOCK_COPY is not None


def test_the_index_reaches_an_accelerator_without_blocking(monkeypatch):
    """Off CPU the copy pairs go through vLLM's pinned, non-blocking ``async_tensor_h2d`` (as
    vLLM's own copy), once per device; on CPU they are used as built. A ``meta`` tensor stands
    for an accelerator's cache here (shapes only: no GPU on this machine)."""
    from vllm.utils import torch_utils

    sent = []

    def spy(data, device=None, **kwargs):
        sent.append(torch.device(device))
        return data.to(device)

    monkeypatch.setattr(torch_utils, "async_tensor_h2d", spy)
    caches = [torch.zeros(NUM_BLOCKS, 4, device="meta"), torch.zeros(NUM_BLOCKS, 8, device="meta")]
    kv_copy.copy_kv_cache_blocks_every_view(caches, NUM_BLOCKS, [(0, 1)])
    assert sent == [torch.device("meta")]
    cpu = torch.arange(NUM_BLOCKS * 2, dtype=torch.float32).view(NUM_BLOCKS, 2)
    kv_copy.copy_kv_cache_blocks_every_view([cpu], NUM_BLOCKS, [(0, 1)])
    assert sent == [torch.device("meta")] and torch.equal(cpu[1], cpu[0])
