"""``ops.mamba1``: the Mamba1 selective scan equals a textbook formula (float64, allclose), the
C++ op equals its pure-torch twin bit for bit, and the state after a sequence is the same bits
however the sequence is cut into chunks (what makes Jamba's prefix caching exact)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.ops.conftest import requires_ext
from vllm_hybrid.ops.mamba1 import selective_scan, selective_scan_ref

NULL = -1


def _inputs(lens, dim=24, n=16, groups=2, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return {
        "u": r(dim, total).to(dtype),
        "delta": r(dim, total).to(dtype),
        "A": -torch.rand(dim, n, generator=gen) * 2,
        "B": r(groups, n, total),
        "C": r(groups, n, total),
        "D": r(dim),
        "z": r(dim, total).to(dtype),
        "bias": r(dim) * 0.3,
        "qsl": torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32),
    }


def _run(fn, a, states, slots, has, *, z=True, bias=True, D=True, softplus=True):
    delta, gate, st = a["delta"].clone(), a["z"].clone() if z else None, states.clone()
    fn(
        a["u"], delta, a["A"], a["B"], a["C"], a["D"] if D else None, gate,
        a["bias"] if bias else None, softplus, a["qsl"], slots, has, st, NULL,
    )  # fmt: skip
    return delta, gate, st


def _formula(a, s0, start, end, g_of):
    """y and the final state of one sequence, float64, F.softplus, einsum: no shared code."""
    u, dt = a["u"].double()[:, start:end], a["delta"].double()[:, start:end]
    dt = F.softplus(dt + a["bias"].double().unsqueeze(1))
    B = a["B"].double()[g_of][:, :, start:end]
    C = a["C"].double()[g_of][:, :, start:end]
    s, ys = s0.double(), []
    for t in range(end - start):
        s = (
            torch.exp(dt[:, t, None] * a["A"].double()) * s
            + B[:, :, t] * (dt[:, t] * u[:, t])[:, None]
        )
        ys.append((s * C[:, :, t]).sum(1) + a["D"].double() * u[:, t])
    y = torch.stack(ys, 1) if ys else u.clone()
    return y, y * F.silu(a["z"].double()[:, start:end]), s


def test_ref_equals_textbook_formula():
    lens, dim, groups = [7, 1, 13, 0, 5], 24, 2
    a = _inputs(lens, dim=dim, groups=groups)
    states = torch.randn(8, dim, 16)
    slots = torch.tensor([3, 0, 5, NULL, 7], dtype=torch.int32)
    has = torch.tensor([True, False, True, False, True])
    delta, gate, st = _run(selective_scan_ref, a, states, slots, has)
    g_of = torch.arange(dim) // (dim // groups)
    bounds = a["qsl"].tolist()
    for unnamed in (1, 2, 4, 6):  # slots no sequence names are untouched
        assert torch.equal(st[unnamed], states[unnamed])
    for b, slot in enumerate(slots.tolist()):
        if slot == NULL:
            continue
        s0 = states[slot] if has[b] else torch.zeros(dim, 16)
        y, yz, s = _formula(a, s0, bounds[b], bounds[b + 1], g_of)
        torch.testing.assert_close(
            delta[:, bounds[b] : bounds[b + 1]].double(), y, rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            gate[:, bounds[b] : bounds[b + 1]].double(), yz, rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(st[slot].double(), s, rtol=1e-5, atol=1e-5)


@requires_ext
@pytest.mark.parametrize(
    "options",
    [{}, {"z": False}, {"bias": False, "D": False}, {"softplus": False}],
    ids=["full", "no-z", "no-bias-no-D", "no-softplus"],
)
@pytest.mark.parametrize("groups", [1, 3])
def test_op_equals_ref_bit_for_bit(options, groups):
    lens = [9, 1, 30, 0, 4]
    a = _inputs(lens, dim=24, groups=groups, seed=groups)
    states = torch.randn(6, 24, 16)
    slots = torch.tensor([2, 0, 5, 1, NULL], dtype=torch.int32)
    has = torch.tensor([True, False, True, True, False])
    ours = _run(selective_scan, a, states, slots, has, **options)
    ref = _run(selective_scan_ref, a, states, slots, has, **options)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[2], ref[2])
    if options.get("z", True):
        assert torch.equal(ours[1], ref[1])
    else:
        assert ours[1] is None and ref[1] is None
    assert torch.equal(ours[2][3], states[3]) and torch.equal(ours[2][4], states[4])


@requires_ext
def test_bfloat16_inputs_write_back_in_their_dtype():
    a = _inputs([5, 6], dtype=torch.bfloat16)
    states = torch.randn(2, 24, 16)
    slots, has = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([False, True])
    ours, ref = (_run(f, a, states, slots, has) for f in (selective_scan, selective_scan_ref))
    assert ours[0].dtype == torch.bfloat16 and ours[1].dtype == torch.bfloat16
    assert all(torch.equal(x, y) for x, y in zip(ours, ref, strict=True))


@requires_ext
@pytest.mark.parametrize("fn", [selective_scan, selective_scan_ref], ids=["op", "ref"])
@pytest.mark.parametrize("cut", [1, 17, 39])
def test_resumed_state_continues_bit_identically(fn, cut):
    """One 40-token sequence in one call == its first ``cut`` tokens, then the rest resumed
    from the stored state (what a prefix-cache hit does)."""
    a = _inputs([40], seed=5)
    states = torch.zeros(2, 24, 16)
    slot, has0, has1 = (
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([False]),
        torch.tensor([True]),
    )
    whole = _run(fn, a, states, slot, has0)
    head = {**a, "qsl": torch.tensor([0, cut], dtype=torch.int32)}
    tail = {**a, "qsl": torch.tensor([0, 40 - cut], dtype=torch.int32)}
    for key in ("u", "delta", "z"):
        head[key], tail[key] = a[key][:, :cut], a[key][:, cut:]
    for key in ("B", "C"):
        head[key], tail[key] = a[key][:, :, :cut], a[key][:, :, cut:]
    _, _, mid = _run(fn, head, states, slot, has0)
    d2, z2, end = _run(fn, tail, mid, slot, has1)
    assert torch.equal(end[1], whole[2][1])
    assert torch.equal(d2, whole[0][:, cut:]) and torch.equal(z2, whole[1][:, cut:])


@requires_ext
def test_bad_shapes_are_refused_with_a_message():
    a = _inputs([4])
    with pytest.raises(RuntimeError, match="ssm_states must be"):
        _run(selective_scan, a, torch.zeros(2, 24, 8), torch.tensor([0], dtype=torch.int32), None)
    with pytest.raises(RuntimeError, match="out of range"):
        _run(selective_scan, a, torch.zeros(2, 24, 16), torch.tensor([5], dtype=torch.int32), None)
