"""Torch custom ops over the csrc/ kernels, each with a pure-torch ``*_ref`` twin.

Importing this package needs torch but not the compiled extension; calling an op without it
raises ``MissingExtensionError`` with build instructions.
"""

from vllm_hybrid.ops._loader import MissingExtensionError, extension_available
from vllm_hybrid.ops.checkpoint import store_prefill_checkpoint, store_prefill_checkpoint_ref
from vllm_hybrid.ops.snapshot import (
    int8_error_bound,
    int8_pool_like,
    snapshot_copy,
    snapshot_copy_ref,
    snapshot_dequantize_int8,
    snapshot_dequantize_int8_ref,
    snapshot_quantize_int8,
    snapshot_quantize_int8_ref,
)
from vllm_hybrid.ops.ssd import prepare_dt, ssd_chunk_scan, ssd_chunk_scan_ref

__all__ = [
    "MissingExtensionError",
    "extension_available",
    "int8_error_bound",
    "int8_pool_like",
    "prepare_dt",
    "snapshot_copy",
    "snapshot_copy_ref",
    "snapshot_dequantize_int8",
    "snapshot_dequantize_int8_ref",
    "snapshot_quantize_int8",
    "snapshot_quantize_int8_ref",
    "ssd_chunk_scan",
    "ssd_chunk_scan_ref",
    "store_prefill_checkpoint",
    "store_prefill_checkpoint_ref",
]
