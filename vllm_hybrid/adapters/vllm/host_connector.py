"""``HybridHostTierConnector``: the pipe of the engine's host tier for Mamba state snapshots
(vLLM 0.32.0 KV connector API v1; design in docs/host_tier_engine.md).

It never loads KV (``get_num_new_matched_tokens`` -> 0 tokens): a promoted snapshot is an
ordinary *local* hit that vLLM's own lookup finds (``block_pool.py::hy_promote``). All decisions
are made on the scheduler side by :class:`~vllm_hybrid.core.host_ledger.HostLedger`;
this connector ships the step's ordered copies to the worker in its metadata
(``build_connector_meta``, called at the end of ``Scheduler.schedule``), and its worker half
copies the bytes in ``handle_preemptions``, which ``GPUModelRunner.execute_model``
(``v1/worker/gpu_model_runner.py``, also the CPU runner's) calls first, before
``_update_states`` zeroes new blocks or applies copy-on-write and before ``preprocess_mamba``
reads a hit's state. ``SupportsHMA``: the hybrid allocator stays on (Mamba models need it).

Configured automatically: with ``host_tier_gb > 0`` the plugin fills ``kv_transfer_config``
(``configure_host_tier``, called from ``EngineArgs.create_engine_config``) and refuses a user's
own connector. The host budget travels in ``kv_connector_extra_config["host_tier_bytes"]``, so
the scheduler and every worker derive the same slot count from the same ``KVCacheConfig``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_hybrid.core import DEMOTE, PROMOTE, HostLedger, HostOp, host_slots

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("vllm_hybrid")

CONNECTOR_NAME = "HybridHostTierConnector"
MODULE_PATH = "vllm_hybrid.adapters.vllm.host_connector"
BYTES_KEY = "host_tier_bytes"


def mamba_groups(kv_cache_config: KVCacheConfig) -> list[int]:
    from vllm.v1.kv_cache_interface import MambaSpec

    return [
        i
        for i, group in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, MambaSpec)
    ]


def real_page_bytes(kv_cache_config: KVCacheConfig, group: int) -> int:
    """``MambaSpec.real_page_size_bytes`` of a Mamba group: its states' bytes, without the
    padding that makes a Mamba page as large as an attention page on the device (the group
    is one of :func:`mamba_groups`; typed ``KVCacheSpec`` in vLLM's config)."""
    spec: Any = kv_cache_config.kv_cache_groups[group].kv_cache_spec
    return int(spec.real_page_size_bytes)


def snapshot_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one snapshot on the host: the states of every layer of every Mamba group
    (:func:`real_page_bytes`; the page view the worker copies is that wide)."""
    groups = kv_cache_config.kv_cache_groups
    return sum(
        real_page_bytes(kv_cache_config, g) * len(groups[g].layer_names)
        for g in mamba_groups(kv_cache_config)
    )


class HostTierMetadata(KVConnectorMetadata):
    """The step's copies, in order (``host_ledger.HostOp``); pickled to the workers."""

    def __init__(self, ops: list[HostOp]) -> None:
        self.ops = ops


class HostStateBuffer:
    """Worker side: per Mamba layer, the device pages as ``[num_blocks, page bytes]`` int8
    rows (the raw page view ``MambaBase.bind_kv_cache`` slices its states from,
    ``model_executor/layers/mamba/abstract.py``) and a host buffer of ``[slots, page bytes]``.
    Copying a page's bytes copies every state of the layer at that block, whatever their
    shapes or conv layout."""

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        kv_cache_config: KVCacheConfig,
        groups: list[int],
        num_slots: int,
    ) -> None:
        self.device_rows: list[list[torch.Tensor]] = []  # per Mamba group, per layer
        self.host_rows: list[list[torch.Tensor]] = []
        pin = torch.cuda.is_available()
        for g in groups:
            dev_layers, host_layers = [], []
            for name in kv_cache_config.kv_cache_groups[g].layer_names:
                pages = kv_caches[name]
                if pages.dim() != 4 or pages.shape[1:3] != (1, 1) or pages.dtype != torch.int8:
                    raise RuntimeError(
                        f"vllm-hybrid host tier: Mamba layer {name} has a KV cache view of "
                        f"shape {tuple(pages.shape)} {pages.dtype}, expected [blocks, 1, 1, bytes]"
                        " int8 (vLLM 0.32's raw page view)"
                    )
                rows = pages.squeeze(2).squeeze(1)
                width = real_page_bytes(kv_cache_config, g)
                if rows.shape != (kv_cache_config.num_blocks, width):  # never split, unpadded
                    raise RuntimeError(
                        f"vllm-hybrid host tier: Mamba layer {name} has {rows.shape[0]} pages "
                        f"of {rows.shape[1]} bytes, the pool {kv_cache_config.num_blocks} "
                        f"blocks of {width} state bytes"
                    )
                dev_layers.append(rows)
                host_layers.append(
                    torch.empty((num_slots, rows.shape[1]), dtype=torch.int8, pin_memory=pin)
                )
            self.device_rows.append(dev_layers)
            self.host_rows.append(host_layers)
        self.bytes = sum(h.numel() for hs in self.host_rows for h in hs)

    def run(self, ops: list[HostOp]) -> None:
        """The copies, in order (the order is what makes them safe: host_ledger.py)."""
        for kind, slot, blocks in ops:
            for block, devs, hosts in zip(blocks, self.device_rows, self.host_rows, strict=True):
                for dev, host in zip(devs, hosts, strict=True):
                    if kind == DEMOTE:
                        host[slot].copy_(dev[block])
                    elif kind == PROMOTE:
                        dev[block].copy_(host[slot])
                    else:
                        raise ValueError(f"unknown host op {kind}")


class HybridHostTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Both roles; see the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        if kv_cache_config is None:
            raise ValueError(f"{CONNECTOR_NAME} needs the KV cache config (vLLM >= 0.32)")
        #: the engine's KV cache layout (kept here: the base class's copy is private)
        self.layout: KVCacheConfig = kv_cache_config
        transfer = vllm_config.kv_transfer_config  # the base class refuses None
        extra = (transfer.kv_connector_extra_config if transfer is not None else None) or {}
        budget = int(extra.get(BYTES_KEY, 0))
        self.groups = mamba_groups(kv_cache_config)
        self.snapshot_bytes = snapshot_bytes(kv_cache_config)
        self.num_slots = host_slots(budget, self.snapshot_bytes) if self.groups else 0
        self.ledger: HostLedger | None = None  # scheduler role: bound by scheduler.activate
        self.buffer: HostStateBuffer | None = None  # worker role: register_kv_caches
        self.ops_run = 0

    # ---------------------------------------------------------------- scheduler side
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False  # never loads KV: promoted states are local hits

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        ops = self.ledger.take_ops() if self.ledger is not None else []
        return HostTierMetadata(ops)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        return False, None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.num_slots <= 0:
            return
        from vllm_hybrid.adapters.vllm.logs import share_vllm_logging

        share_vllm_logging()  # a worker logs before any scheduler ran this
        self.buffer = HostStateBuffer(kv_caches, self.layout, self.groups, self.num_slots)
        logger.info(
            "vllm-hybrid: host tier: %d snapshot slots, %.1f MB of host memory",
            self.num_slots,
            self.buffer.bytes / 1e6,
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        ops = getattr(kv_connector_metadata, "ops", None)
        if not ops:
            return
        if self.buffer is None:
            raise RuntimeError("vllm-hybrid host tier: copies ordered before the buffers exist")
        self.buffer.run(ops)
        self.ops_run += len(ops)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def find_host_connector(scheduler: Any) -> HybridHostTierConnector | None:
    connector = getattr(scheduler, "connector", None)
    return connector if isinstance(connector, HybridHostTierConnector) else None


def attach_host_tier(scheduler: Any, pool: Any, config: Any) -> HostLedger | None:
    """Called by ``scheduler.py::activate`` when ``host_tier_gb > 0``: give the hybrid pool a
    :class:`HostLedger` whose copies our connector ships. ConfigError if the connector is
    missing (the engine's config was not built through ``EngineArgs``, where the plugin fills
    it in); None (tier off, with a warning) if not even one snapshot fits."""
    from vllm_hybrid.core import ConfigError

    connector = find_host_connector(scheduler)
    if connector is None:
        raise ConfigError(
            f"vllm_hybrid: host_tier_gb {config.host_tier_gb:g} is set but the engine has no "
            f"{CONNECTOR_NAME} (kv_transfer_config: {scheduler.vllm_config.kv_transfer_config}); "
            "build the engine through LLM(...) / vllm serve, which select it, or set "
            "host_tier_gb to 0"
        )
    if connector.num_slots <= 0:
        logger.warning(
            "vllm-hybrid: host_tier_gb %g holds no snapshot of %d bytes; the host tier is off",
            config.host_tier_gb,
            connector.snapshot_bytes,
        )
        return None
    ledger = HostLedger(pool.hybrid.mirror, connector.num_slots, connector.snapshot_bytes)
    if ledger.state_groups != connector.groups:
        raise RuntimeError(f"Mamba groups differ: {ledger.state_groups} != {connector.groups}")
    pool.hybrid.host = ledger
    connector.ledger = ledger
    logger.info(
        "vllm-hybrid: host tier: %d snapshot slots of %d bytes",
        ledger.num_slots,
        connector.snapshot_bytes,
    )
    return ledger
