"""``vllm-hybrid serve --replicas N``'s bad input fails at once with the fix named (no Ray, no
model, no engine is started)."""

from __future__ import annotations

import sys

import pytest

from vllm_hybrid import cli


def serve(capsys, *argv):
    code = cli.main(["serve", "/nonexistent/model", *argv])
    return code, capsys.readouterr().err


def test_zero_replicas(capsys):
    code, err = serve(capsys, "--replicas", "0")
    assert code == 2 and "--replicas must be >= 1, got 0" in err
    assert "without --replicas" in err


def test_unknown_router_names_the_known_ones(capsys):
    code, err = serve(capsys, "--replicas", "2", "--router", "nope")
    assert code == 2 and "unknown router 'nope'" in err and "state" in err and "round-robin" in err


def test_router_without_replicas(capsys):
    code, err = serve(capsys, "--router", "state")
    assert code == 2 and "--router needs --replicas N" in err


def test_bad_router_tflops(capsys, monkeypatch):
    monkeypatch.setattr("vllm_hybrid.cluster.ray_api.require_ray", lambda: None)
    code, err = serve(capsys, "--replicas", "2", "--router-tflops", "0")
    assert code == 2 and "--router-tflops must be > 0" in err


def test_ray_missing_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code, err = serve(capsys, "--replicas", "2")
    assert code == 2
    assert "pip install 'vllm-hybrid[cluster]'" in err and "ray[serve]==2.60.0" in err


def test_wrong_ray_release_names_the_pin(capsys, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "__version__", "2.99.0")
    monkeypatch.delenv("VLLM_HYBRID_RAY_ANY_VERSION", raising=False)
    code, err = serve(capsys, "--replicas", "2")
    assert code == 2 and "Ray 2.99.0 is installed" in err and "ray[serve]==2.60.0" in err
