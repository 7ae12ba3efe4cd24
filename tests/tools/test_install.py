"""scripts/install.sh on an installed checkout does no pip work: it only checks and returns.

The check runs against a stand-in of the installed venv (the same interpreter, site-packages and
stamp, through symlinks) whose ``pip`` records its calls and fails, so a broken up-to-date probe
fails this test instead of reinstalling the real venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)


def _stand_in(tmp_path: Path) -> Path:
    if not (VENV / ".install-stamp").exists():
        pytest.skip("the suite runs outside an environment made by scripts/install.sh")
    fake = tmp_path / "venv"
    (fake / "bin").mkdir(parents=True)
    shutil.copy(VENV / "pyvenv.cfg", fake / "pyvenv.cfg")
    shutil.copy(VENV / ".install-stamp", fake / ".install-stamp")
    (fake / "lib").symlink_to(VENV / "lib")
    (fake / "bin" / "python").symlink_to(VENV / "bin" / "python")
    pip = fake / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "pip-calls"}\nexit 1\n')
    pip.chmod(0o755)
    return fake


def test_a_second_install_does_no_pip_work(tmp_path: Path) -> None:
    fake = _stand_in(tmp_path)
    env = {**os.environ, "VLLM_HYBRID_VENV": str(fake)}
    run = subprocess.run(
        ["bash", str(ROOT / "scripts/install.sh")], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "is up to date" in run.stdout
    assert not (tmp_path / "pip-calls").exists(), "install.sh ran pip on an installed checkout"


def test_a_changed_input_reinstalls(tmp_path: Path) -> None:
    """The other side: a stale stamp is not taken for up to date (pip is asked, and fails)."""
    fake = _stand_in(tmp_path)
    (fake / ".install-stamp").write_text("stale\n")
    env = {**os.environ, "VLLM_HYBRID_VENV": str(fake)}
    run = subprocess.run(
        ["bash", str(ROOT / "scripts/install.sh")], env=env, capture_output=True, text=True
    )
    assert run.returncode != 0 and (tmp_path / "pip-calls").exists()
