"""tools/dockerfile_check.py: the repo's Dockerfile passes the static checks, and the checker
catches what it is there to catch (a leaking build context, a bad CMD, a missing ignore file).
The emulated build (``--run``) is not run here: it reinstalls everything (minutes)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "dockerfile_check", ROOT / "tools/dockerfile_check.py"
)
dc = importlib.util.module_from_spec(_spec)
sys.modules["dockerfile_check"] = dc  # dataclasses look their module up
_spec.loader.exec_module(dc)

DOCKERFILE = """\
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG EXTRA=cpu
ENV A=1 \\
    B=${EXTRA}
WORKDIR /opt/app
# a comment
COPY . .
RUN echo $B \\
    && true
CMD [".venv/bin/vllm-hybrid", "demo", "--port", "8000"]
"""


def test_repo_dockerfile_passes_static_checks():
    img = dc.parse_dockerfile(ROOT / "Dockerfile")
    context = dc.build_context(ROOT)
    assert dc.static_checks(ROOT, img, context) == []
    assert "scripts/install.sh" in context and "pyproject.toml" in context
    assert not any(p.startswith((".venv/", "out/", ".git/")) for p in context)
    assert img.cmd[1] == "demo"
    # exactly the repository's files: tracked ones, plus new ones git does not ignore
    if shutil.which("git") and (ROOT / ".git").exists():
        git = ["git", "-C", str(ROOT), "ls-files", "-z"]
        tracked = set(subprocess.check_output(git, text=True).split("\0")) - {""}
        others = git + ["--others", "--exclude-standard"]
        new = set(subprocess.check_output(others, text=True).split("\0")) - {""}
        tracked = {p for p in tracked if (ROOT / p).exists()}  # deleted, not committed yet
        assert tracked <= set(context) <= tracked | new


def test_parse_substitutes_args_and_env(tmp_path):
    (tmp_path / "Dockerfile").write_text(DOCKERFILE)
    img = dc.parse_dockerfile(tmp_path / "Dockerfile", {"EXTRA": "cuda"})
    assert img.base == "python:3.11-slim"
    assert img.env == {"A": "1", "B": "cuda"}
    assert img.workdir == "/opt/app" and img.copies == [(".", ".")]
    assert img.runs == ["echo $B  && true"]
    with pytest.raises(dc.DockerfileError, match="not declared"):
        dc.parse_dockerfile(tmp_path / "Dockerfile", {"NOPE": "1"})


def _project(tmp_path, ignore: str | None, cmd: str = '"demo", "--port", "8000"') -> Path:
    (tmp_path / "Dockerfile").write_text(DOCKERFILE.replace('"demo", "--port", "8000"', cmd))
    (tmp_path / "src").mkdir()
    (tmp_path / "src/app.py").write_text("")
    (tmp_path / ".venv/bin").mkdir(parents=True)
    (tmp_path / ".venv/bin/python").write_text("")
    (tmp_path / "src/__pycache__").mkdir()
    (tmp_path / "src/__pycache__/app.cpython-311.pyc").write_text("")
    if ignore is not None:
        (tmp_path / ".dockerignore").write_text(ignore)
    return tmp_path


def test_leaking_context_is_a_problem(tmp_path):
    root = _project(tmp_path, "# nothing ignored\n")
    img = dc.parse_dockerfile(root / "Dockerfile")
    problems = dc.static_checks(root, img, dc.build_context(root))
    assert any(".venv/bin/python" in p for p in problems)
    assert any(".pyc" in p for p in problems)


def test_ignore_patterns_prune_context(tmp_path):
    root = _project(tmp_path, ".venv\n**/__pycache__\n")
    assert dc.build_context(root) == [".dockerignore", "Dockerfile", "src/app.py"]
    img = dc.parse_dockerfile(root / "Dockerfile")
    assert dc.static_checks(root, img, dc.build_context(root)) == []


def test_bad_cmd_and_missing_ignore(tmp_path):
    root = _project(tmp_path, ".venv\n**/__pycache__\n", cmd='"demo", "--no-such-flag"')
    img = dc.parse_dockerfile(root / "Dockerfile")
    problems = dc.static_checks(root, img, dc.build_context(root))
    assert any("does not parse" in p for p in problems)
    assert dc.main(["--context", str(root)]) == 1
    (root / ".dockerignore").unlink()
    with pytest.raises(dc.DockerfileError, match=".dockerignore is missing"):
        dc.build_context(root)
    assert dc.main(["--context", str(root)]) == 2


def test_unknown_instruction_is_refused(tmp_path):
    (tmp_path / "Dockerfile").write_text('FROM x\nHEALTHCHECK CMD true\nCMD ["a"]\n')
    with pytest.raises(dc.DockerfileError, match="line 2: instruction HEALTHCHECK"):
        dc.parse_dockerfile(tmp_path / "Dockerfile")
