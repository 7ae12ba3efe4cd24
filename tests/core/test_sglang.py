"""``sglang``: where SGLang's hybrid radix cache (``extra_buffer``) keeps Mamba states, its KV
cut at the last state, and its default split into a KV pool and a Mamba pool
(``core/sglang.py``; the SGLang code each case follows is cited in docs/policies.md)."""

import pytest

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.policies import SglangPolicy
from vllm_hybrid.core.policy import AdmitContext, output_state_position
from vllm_hybrid.core.sglang import SglangGrid, pool_split_bytes
from vllm_hybrid.core.shapes import load_shape

COST = CostModel(load_shape("marconi-7b"), 64)


def ctx(prompt: int, cacheable: int | None = None, hit: int = 0, kv: int = 0) -> AdmitContext:
    end = prompt if cacheable is None else cacheable
    return AdmitContext(0, prompt, end, hit, kv, False, 64, cacheable is not None, lambda p: p)


@pytest.mark.parametrize(
    ("page", "model_chunk", "expected"),
    [
        (64, 64, (64, 256, 8192)),
        (16, 64, (64, 256, 8192)),  # the model chunk is the grid
        (1, 64, (64, 256, 8192)),  # SGLang's default page
        (128, 64, (128, 256, 8192)),  # the page is the grid
        (512, 64, (512, 512, 8192)),
        (64, 256, (256, 256, 8192)),  # a Mamba2 config's mamba_chunk_size
        (96, 64, (192, 768, 8064)),  # SGLang refuses this page: the nearest grid, chunk cut
    ],
)
def test_grids_follow_the_page_and_the_model_chunk(page, model_chunk, expected) -> None:
    g = SglangGrid.of(page, model_chunk)
    assert (g.checkpoint_tokens, g.track_tokens, g.chunk_tokens) == expected


def test_bad_grid_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        SglangGrid.of(0)


def test_one_state_per_prefill_chunk_at_its_last_grid_point() -> None:
    g = SglangGrid.of(64)
    assert g.prefill_positions(1000, 0, 0) == [960]
    assert g.prefill_positions(20000, 0, 0) == [8192, 16384, 19968]
    assert g.prefill_positions(8192 + 30, 0, 0) == [8192]  # a last chunk under 64: none
    assert g.prefill_positions(63, 0, 0) == []  # a prompt under the grid keeps nothing
    # chunks start at the state hit
    assert g.prefill_positions(20000, 4096, 4096) == [4096 + 8192, 19968]


def test_the_branching_point_replaces_its_chunks_end() -> None:
    """A KV match past the state hit: its grid floor is tracked instead of the chunk's end."""
    g = SglangGrid.of(64)
    assert g.prefill_positions(20000, 0, 5000) == [4992, 16384, 19968]
    assert g.prefill_positions(20000, 8192, 9000) == [8960, 19968]
    assert g.prefill_positions(3000, 1024, 1024) == [2944]  # no KV past the hit: no branch
    assert g.prefill_positions(3000, 1024, 1080) == [2944]  # branch floor == hit: none


def test_a_finished_request_keeps_its_last_decode_track_boundary() -> None:
    g = SglangGrid.of(64)
    assert g.finish_position(1000, 1000 + 600 - 1) == 1536
    assert g.finish_position(1000, 1030) == 1024
    assert g.finish_position(1000, 1023) == 0  # no boundary crossed past the prompt
    assert g.finish_position(1024, 1100) == 0  # the prompt's own end is not a decode track


def test_policy_positions_and_kv_cut() -> None:
    pol = SglangPolicy(COST)
    mooncake = ctx(20000)  # output unknown: cacheable == prompt
    assert pol.snapshot_positions(mooncake) == [8192, 16384, 19968]
    assert pol.kv_end_tokens(mooncake, [8192, 16384, 19968]) == 19968
    chat = ctx(1000, 1600, hit=512, kv=768)
    assert pol.snapshot_positions(chat) == [768, 1536]  # branching point, then decode
    assert pol.kv_end_tokens(chat, pol.snapshot_positions(chat)) == 1536
    assert pol.kv_end_tokens(ctx(40), []) == 0  # nothing kept: no KV either


def test_the_engine_keeps_an_output_state_only_past_a_track_boundary() -> None:
    """``output_state_position``: the engine can hold only the state at the output's end; it
    keeps it where SGLang keeps one in the output (a crossed track boundary)."""
    pol = SglangPolicy(COST)
    assert output_state_position(pol, 638, 661, 64, 64) == 0  # 640 crosses no 256 boundary
    assert output_state_position(pol, 638, 800, 64, 64) == 768
    assert output_state_position(pol, 600, 800, 64, 16) == 800  # the end it holds


def test_default_pool_split() -> None:
    """SGLang: mamba / kv = mamba_full_memory_ratio (0.9): 9/19 of the memory for states."""
    assert pool_split_bytes(19_000) == (10_000, 9_000)
    assert pool_split_bytes(100, 1.0) == (50, 50)
    with pytest.raises(ValueError):
        pool_split_bytes(100, 0.0)
