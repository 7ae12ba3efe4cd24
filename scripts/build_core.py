"""Compile the core's hot modules with mypyc, in place (``vllm_hybrid/core/_native.py``).

    .venv/bin/python scripts/build_core.py           # build (about 25 s on 2 cores)
    .venv/bin/python scripts/build_core.py --clean   # remove the compiled copies

``scripts/install.sh`` runs it. The extension modules land next to their sources with a
manifest of the sources' SHA-256; ``vllm_hybrid/core/_native.py`` uses them only while the
sources match it. A failed build leaves the pure-Python core in place (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["VLLM_HYBRID_PURE_PYTHON"] = "1"  # this process reads sources only (no stale warning)

from vllm_hybrid.core import _native  # noqa: E402

GROUP = "vllm_hybrid.core.native"  # the shared library: vllm_hybrid/core/native__mypyc*.so


def clean() -> list[Path]:
    """Remove every compiled copy (also of modules no longer listed), the shared library
    and the manifest."""
    gone = [*_native.compiled_files(), *_native.HERE.glob("native__mypyc*"), _native.MANIFEST]
    for path in gone:
        path.unlink(missing_ok=True)
    return gone


def build() -> None:
    from mypyc.build import mypycify
    from setuptools import setup

    clean()
    sources = [f"vllm_hybrid/core/{m}.py" for m in _native.COMPILED]
    digests = {m: _native.source_digest(m) for m in _native.COMPILED}
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        setup(
            name="vllm-hybrid-core-native",
            ext_modules=mypycify(sources, opt_level="3", group_name=GROUP, target_dir=tmp),
            script_args=["-q", "build_ext", "--inplace", "--build-temp", tmp, "--build-lib", tmp],
        )
    if {m: _native.source_digest(m) for m in _native.COMPILED} != digests:
        clean()
        raise SystemExit("build_core: sources changed during the build; run it again")
    _native.MANIFEST.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clean", action="store_true", help="remove the compiled copies")
    args = p.parse_args()
    if args.clean:
        clean()
        print("build_core: removed the compiled core")
        return 0
    try:
        build()
    except (Exception, SystemExit) as exc:  # noqa: BLE001  (any failure: stay pure Python)
        clean()
        print(f"build_core: mypyc build failed, the core stays pure Python: {exc}")
        return 1
    print(f"build_core: compiled {', '.join(_native.COMPILED)} (manifest {_native.MANIFEST})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
