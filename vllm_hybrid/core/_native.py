"""Compiled or pure Python: which copy of the core's hot modules gets imported.

The modules in :data:`COMPILED` run on every scheduler step of an engine (the mirror of its
page pool, the policies and what they call). ``scripts/build_core.py`` (run by
``scripts/install.sh``) compiles them with mypyc into extension modules next to their sources;
Python then imports those first. They are the same code: the sources are the truth, the tests
hold for both, and everything works without the build (docs/scheduler_overhead.md says what
it saves).

A compiled copy is used only while it matches its sources: the build writes a manifest of
their SHA-256, and this module (imported by ``vllm_hybrid/core/__init__.py``, before any of
them) puts a finder first on ``sys.meta_path`` that loads every core module from its source
when a source differs from the manifest (after an edit: rebuild, or live with the slower
copy), when a compiled module the build does not list is present (left by an older build), or
when ``VLLM_HYBRID_PURE_PYTHON=1``. All or none: the compiled modules call each other
natively, so one stale module takes the others back to source with it.

Compiled classes take no new attribute on an instance and no Python subclass (instantiating
one raises ``TypeError: interpreted classes cannot inherit from compiled``): experiments that
patch or subclass the core run with ``VLLM_HYBRID_PURE_PYTHON=1``.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE = "vllm_hybrid.core"
#: The core modules compiled by scripts/build_core.py (each imports only these, the standard
#: library and pure-Python core modules).
COMPILED = ("node", "cost", "policy", "ghosts", "policies", "pool_mirror")
HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "native.json"  # {module: sha256 of its source}, written by the build
ENV_PURE = "VLLM_HYBRID_PURE_PYTHON"


def source_digest(module: str) -> str:
    return hashlib.sha256((HERE / f"{module}.py").read_bytes()).hexdigest()


def compiled_files() -> list[Path]:
    """Every extension module in the core's directory (the build's; the core has no other),
    the build's shared library aside."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    return sorted(
        path
        for path in HERE.iterdir()
        if any(path.name.endswith(s) for s in suffixes) and not path.name.startswith("native__")
    )


def stale_reason() -> str | None:
    """Why the compiled copies must not be used (None: they may)."""
    if os.environ.get(ENV_PURE) == "1":
        return f"{ENV_PURE}=1"
    stray = sorted({p.name.split(".")[0] for p in compiled_files()} - set(COMPILED))
    if stray:
        return "compiled modules the build does not list: " + ", ".join(stray)
    try:
        manifest = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return f"no readable manifest {MANIFEST.name}"
    changed = [m for m in COMPILED if manifest.get(m) != source_digest(m)]
    if changed:
        return "sources changed since the build: " + ", ".join(f"{m}.py" for m in changed)
    return None


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds every core module that has a ``.py`` source as that source."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        source = HERE / f"{name}.py"
        if package != PACKAGE or not source.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, source)


#: "compiled" or "python": what this process runs (set once, at the package's import).
MODE = "python"
#: Why the compiled copies are not used, when they exist but are not (else None).
REASON: str | None = None


def _choose() -> None:
    global MODE, REASON
    if not compiled_files():
        return  # nothing built: the sources are all there is
    REASON = stale_reason()
    if REASON is None:
        MODE = "compiled"
        return
    if any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _SourceFinder())
    if not REASON.startswith(ENV_PURE):
        warnings.warn(
            f"vllm-hybrid: the compiled core is stale ({REASON}); using the Python sources "
            "(slower scheduler steps). Rebuild with: .venv/bin/python scripts/build_core.py",
            RuntimeWarning,
            stacklevel=2,
        )


_choose()
