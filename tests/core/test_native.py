"""The compiled core (scripts/build_core.py, vllm_hybrid/core/_native.py): used only while it
matches its sources, and it decides exactly what the Python sources decide."""

from __future__ import annotations

import importlib.machinery
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hybrid.core import _native
from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.layers import AttentionLayers, Mamba2Layers
from vllm_hybrid.core.policies import POLICIES
from vllm_hybrid.core.pool_mirror import PoolMirror
from vllm_hybrid.core.shapes import ModelShape

ROOT = Path(__file__).resolve().parents[2]
PURE = {**os.environ, _native.ENV_PURE: "1"}


def _digests() -> dict[str, str]:
    return {m: _native.source_digest(m) for m in _native.COMPILED}


def test_a_manifest_that_matches_the_sources_allows_the_compiled_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(_native.ENV_PURE, raising=False)
    manifest = tmp_path / "native.json"
    monkeypatch.setattr(_native, "MANIFEST", manifest)
    assert _native.stale_reason() == "no readable manifest native.json"
    manifest.write_text("{not json")
    assert _native.stale_reason() == "no readable manifest native.json"
    manifest.write_text(json.dumps(_digests()))
    assert _native.stale_reason() is None
    edited = {**_digests(), "policies": "0" * 64}  # policies.py changed after the build
    manifest.write_text(json.dumps(edited))
    assert _native.stale_reason() == "sources changed since the build: policies.py"
    manifest.write_text(json.dumps(_digests()))
    monkeypatch.setenv(_native.ENV_PURE, "1")
    assert _native.stale_reason() == f"{_native.ENV_PURE}=1"


def test_the_source_finder_takes_the_compiled_modules_only() -> None:
    finder = _native._SourceFinder()
    spec = finder.find_spec("vllm_hybrid.core.pool_mirror")
    assert spec is not None and spec.origin == str(_native.HERE / "pool_mirror.py")
    spec = finder.find_spec("vllm_hybrid.core.feed")  # not built, yet a stray build is shadowed
    assert spec is not None and spec.origin == str(_native.HERE / "feed.py")
    assert finder.find_spec("vllm_hybrid.core.no_such_module") is None
    assert finder.find_spec("vllm_hybrid.pool_mirror") is None
    assert finder.find_spec("json") is None


def test_a_compiled_module_the_build_does_not_list_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(_native.ENV_PURE, raising=False)
    fake = tmp_path / "core"
    fake.mkdir()
    for m in _native.COMPILED:
        (fake / f"{m}.py").write_bytes((_native.HERE / f"{m}.py").read_bytes())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (fake / f"pool_mirror{suffix}").write_bytes(b"")
    (fake / f"native__mypyc{suffix}").write_bytes(b"")  # the shared library is no module
    monkeypatch.setattr(_native, "HERE", fake)
    monkeypatch.setattr(_native, "MANIFEST", fake / "native.json")
    (fake / "native.json").write_text(json.dumps(_digests()))
    assert [p.name for p in _native.compiled_files()] == [f"pool_mirror{suffix}"]
    assert _native.stale_reason() is None
    (fake / f"feed{suffix}").write_bytes(b"")  # left by an older build that compiled feed
    assert _native.stale_reason() == "compiled modules the build does not list: feed"


def test_pure_python_on_request_loads_every_source() -> None:
    code = (
        "import vllm_hybrid.core._native as n, importlib;"
        "print(n.MODE, all(importlib.import_module('vllm_hybrid.core.' + m).__file__"
        ".endswith('.py') for m in n.COMPILED))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=PURE, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python", "True"]


def test_the_install_built_the_compiled_core() -> None:
    """scripts/test.sh installs first, and the install (re)builds a stale compiled core: the
    suite runs against what the engine runs. Skipped only when pure Python was asked for."""
    if os.environ.get(_native.ENV_PURE) == "1":
        pytest.skip("pure Python asked for")
    assert _native.MODE == "compiled", (
        f"compiled core not in use ({_native.REASON or 'not built'}): "
        ".venv/bin/python scripts/build_core.py"
    )


# ---------------------------------------------------------------- compiled == Python
B = 4
KV, S1 = 0, 1
COST = CostModel(
    ModelShape(
        "tiny",
        (
            AttentionLayers(1, 1, 1, 1, 1, 1, kv_dtype_bytes=1),
            Mamba2Layers(1, 1, 1, 1, 1, 1, conv_kernel=2, state_dtype_bytes=1),
        ),
    ),
    B,
)


def trace(policy: str, seed: int, steps: int = 400) -> list[list[int]]:
    """A seeded run of engine events on a mirror: the victims of every eviction, in order."""
    rng = random.Random(seed)
    mirror = PoolMirror(
        block_tokens=B, kv_groups=[KV], state_groups=[S1], policy=POLICIES[policy](COST)
    )
    mirror.use_free_events()
    in_use: set[int] = set()
    next_page, out = 0, []
    for _ in range(steps):
        mirror.tick()
        op = rng.random()
        cached = mirror.cached_pages()
        if op < 0.4:  # a request computes a chain (pages in use), states at some blocks
            chain = "".join(rng.choice("abc") for _ in range(rng.randint(1, 5)))
            for i in range(1, len(chain) + 1):
                for group in [KV] + ([S1] if rng.random() < 0.4 else []):
                    mirror.pages_used([next_page])
                    in_use.add(next_page)
                    mirror.add(next_page, chain[:i], group, i * B, chain[: i - 1] or None, 1)
                    next_page += 1
        elif op < 0.6 and in_use:  # a request ends
            freed = rng.sample(sorted(in_use), min(len(in_use), rng.randint(1, 6)))
            in_use.difference_update(freed)
            mirror.pages_freed(freed)
        elif op < 0.75 and cached:  # a hit
            hit = rng.sample(cached, min(len(cached), 3))
            in_use.update(hit)
            mirror.touch_pages(hit)
        else:
            victims = mirror.pick_victims(rng.randint(1, 4), lambda p: p not in in_use)
            for page in victims:
                mirror.drop_page(page)
            out.append(victims)
    mirror.check_integrity()
    return out


CASES = [(policy, seed) for policy in ("flop", "marconi", "vllm", "sglang") for seed in (1, 2)]


def test_compiled_and_python_pick_the_same_victims() -> None:
    if _native.MODE != "compiled":
        pytest.skip("no compiled core to compare (scripts/build_core.py)")
    ours = {f"{p}/{s}": trace(p, s) for p, s in CASES}
    assert sum(map(len, ours.values())) > 100  # the runs evict
    out = subprocess.run(
        [sys.executable, __file__], env=PURE, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ours


def test_the_mirror_tests_pass_in_pure_python_too() -> None:
    """This suite runs the compiled core; the sources must pass the mirror's tests as well."""
    if _native.MODE != "compiled":
        pytest.skip("the suite itself runs the Python sources")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
    tests = ["tests/core/test_pool_mirror.py", "tests/core/test_flop_policy.py"]
    out = subprocess.run(cmd + tests, env=PURE, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]


if __name__ == "__main__":  # the other side of test_compiled_and_python_pick_the_same_victims
    assert _native.MODE == "python"
    print(json.dumps({f"{p}/{s}": trace(p, s) for p, s in CASES}))
