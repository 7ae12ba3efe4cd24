"""The plugin's CPU patch: version gate, idempotence, and agreement with vLLM's own CPU scan."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs the cpu extra")

from tests.ops.conftest import chunk_layout, requires_ext, scan_inputs  # noqa: E402
from vllm_hybrid.adapters.vllm import cpu_mamba2, version  # noqa: E402
from vllm_hybrid.adapters.vllm.plugin import register  # noqa: E402


def test_version_gate_refuses_other_vllm(monkeypatch, caplog):
    monkeypatch.setattr(version, "installed_vllm_version", lambda: "0.31.9")
    assert not version.check_vllm_version("the thing")
    assert "written for vLLM 0.32.0 but vLLM 0.31.9 is installed" in caplog.text
    monkeypatch.setattr(version, "installed_vllm_version", lambda: "0.32.0+cpu")
    assert version.check_vllm_version("the thing")


def test_disabled_plugin_patches_nothing(monkeypatch):
    monkeypatch.setenv("VLLM_HYBRID_ENABLE", "0")
    monkeypatch.setattr(cpu_mamba2, "_PATCHED", False)
    called = []
    monkeypatch.setattr(cpu_mamba2, "patch_cpu_mamba2_prefix_caching", lambda: called.append(1))
    register()
    assert called == []


@requires_ext
def test_patch_installs_both_functions_idempotently():
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mixer2
    import vllm.model_executor.layers.mamba.ops.ssd_combined as ssd_combined

    assert cpu_mamba2.patch_cpu_mamba2_prefix_caching()
    assert cpu_mamba2.patch_cpu_mamba2_prefix_caching()
    assert (
        ssd_combined._mamba_chunk_scan_combined_fwd is cpu_mamba2.mamba_chunk_scan_combined_fwd_cpu
    )
    assert mixer2.store_prefill_checkpoint is cpu_mamba2.store_prefill_checkpoint_cpu


@requires_ext
@pytest.mark.parametrize("with_init", [False, True])
def test_matches_vllm_cpu_scan(with_init):
    """Our scan agrees with vLLM's own CPU kernel on what that kernel computes (final states)."""
    from vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm import (
        _mamba_chunk_scan_combined_fwd_cpu as vllm_scan,
    )

    lens = [77, 300, 5]
    cu, bounds, owners, last = chunk_layout(lens, 64, extra_splits=[[40], [129], []])
    inp = scan_inputs(sum(lens), 8, 16, 2, 32, seed=4)
    raw_dt, dt_bias = torch.randn(sum(lens), 8), torch.randn(8)
    init = torch.randn(len(lens), 8, 16, 32) if with_init else None
    common = dict(
        D=inp["D"],
        dt_bias=dt_bias,
        initial_states=init,
        seq_idx=owners,
        cu_seqlens=cu,
        cu_chunk_seqlens=bounds,
        last_chunk_indices=last,
        dt_softplus=True,
        state_dtype=torch.float32,
    )
    args = (inp["x"], raw_dt, inp["A"], inp["B"], inp["C"], 64)
    out_vllm, out_ours = torch.empty_like(inp["x"]), torch.empty_like(inp["x"])
    final_vllm = vllm_scan(*args, out_vllm, **common)
    final_ours = cpu_mamba2.mamba_chunk_scan_combined_fwd_cpu(*args, out_ours, **common)
    chunks_ours = cpu_mamba2.mamba_chunk_scan_combined_fwd_cpu(
        *args, torch.empty_like(inp["x"]), return_intermediate_states=True, **common
    )
    torch.testing.assert_close(out_ours, out_vllm, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final_ours, final_vllm, rtol=1e-4, atol=1e-4)
    assert chunks_ours.shape == (len(owners), 8, 16, 32)
    assert torch.equal(chunks_ours[last], final_ours)
