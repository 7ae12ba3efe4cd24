"""Check the Dockerfile where no Docker engine runs: its build context, its steps, its command.

The development machines have the Docker client but no engine, so ``docker build`` cannot run
here. This tool checks what can be checked without one:

* **static** (fast; ``tests/tools/test_dockerfile_check.py`` runs it in CI): the Dockerfile
  parses (``ARG``/``ENV`` substitution, line continuations), the build context left by
  ``.dockerignore`` holds no virtual environment, build output, compiled extension, generated
  model or benchmark output, every ``COPY`` source exists in it, and the default ``CMD`` parses
  with our CLI's own parser;
* **emulated** (``--run``, a few minutes): the context is copied to a fresh directory standing
  for ``WORKDIR``, every ``RUN`` step runs there with the image's ``ENV`` (``apt-get`` steps
  are not run: the packages they install are looked up on this machine instead), then the
  default ``CMD`` runs and must exit 0.

What it cannot check: the base image itself (``python:3.11-slim-bookworm`` or a CUDA base), and
anything that differs between that image and this machine. ``.dockerignore`` patterns are
matched with :func:`fnmatch.fnmatchcase` per path and per parent directory (``**/`` matches any
depth); ``!`` exceptions are refused, as this checker does not implement them.

    .venv/bin/python tools/dockerfile_check.py            # static checks
    .venv/bin/python tools/dockerfile_check.py --run      # + emulated build and default command
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: What must never reach the image (relative paths of the context).
FORBIDDEN = (".venv", "out", "build", "models", ".git")
FORBIDDEN_SUFFIXES = (".so", ".pyc")


class DockerfileError(ValueError):
    """The Dockerfile or its context fails a check; the message says which and where."""


@dataclass
class Image:
    """What the Dockerfile says, with ``ARG`` and ``ENV`` values substituted."""

    args: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    copies: list[tuple[str, str]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    base: str = ""


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Instructions with their first line number: comments dropped, continuations joined."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    if buf:
        raise DockerfileError(f"line {start}: instruction ends with a continuation")
    return out


def _subst(value: str, scope: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: scope.get(m.group(1) or m.group(2), ""), value)


def parse_dockerfile(path: Path, build_args: dict[str, str] | None = None) -> Image:
    img, build_args = Image(), dict(build_args or {})
    for n, line in _logical_lines(path.read_text()):
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        scope = {**img.args, **img.env}
        if op == "ARG":
            name, _, default = rest.partition("=")
            img.args[name] = build_args.pop(name, _subst(default, scope))
        elif op == "FROM":
            img.base = _subst(rest, scope)
        elif op == "ENV":
            for item in shlex.split(rest):
                key, eq, value = item.partition("=")
                if not eq:
                    raise DockerfileError(f"line {n}: ENV {item!r} is not KEY=VALUE")
                img.env[key] = _subst(value, {**img.args, **img.env})
        elif op == "WORKDIR":
            img.workdir = _subst(rest, scope)
        elif op == "COPY":
            parts = shlex.split(_subst(rest, scope))
            if len(parts) != 2 or parts[0].startswith("--"):
                raise DockerfileError(f"line {n}: only 'COPY SRC DST' is checked, got {rest!r}")
            img.copies.append((parts[0], parts[1]))
        elif op == "RUN":
            img.runs.append(rest)  # the shell substitutes from ENV when it runs
        elif op == "CMD":
            try:
                img.cmd = json.loads(rest)
            except json.JSONDecodeError:
                raise DockerfileError(f"line {n}: CMD must be the exec (JSON) form") from None
        elif op not in ("EXPOSE", "LABEL"):
            raise DockerfileError(f"line {n}: instruction {op} is not known to this checker")
    if build_args:
        raise DockerfileError(f"build args not declared by any ARG: {', '.join(build_args)}")
    if not img.base or not img.cmd:
        raise DockerfileError("the Dockerfile needs a FROM and a CMD")
    return img


def ignore_patterns(root: Path) -> list[str]:
    path = root / ".dockerignore"
    if not path.is_file():
        raise DockerfileError(".dockerignore is missing: COPY . . would send the whole checkout")
    pats = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!"):
            raise DockerfileError(f".dockerignore: exception {line!r} is not supported here")
        pats.append(line.strip("/"))
    return pats


def ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        for cand in prefixes:
            if fnmatch.fnmatchcase(cand, pat):
                return True
            if pat.startswith("**/"):
                tail = pat[3:]
                segs = cand.split("/")
                if any(fnmatch.fnmatchcase("/".join(segs[i:]), tail) for i in range(len(segs))):
                    return True
    return False


def build_context(root: Path) -> list[str]:
    """Relative paths of the files ``docker build`` would send (after ``.dockerignore``)."""
    patterns, out = ignore_patterns(root), []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(d for d in dirnames if not ignored(rel_dir + d, patterns))
        out.extend(rel_dir + f for f in sorted(filenames) if not ignored(rel_dir + f, patterns))
    return out


def static_checks(root: Path, img: Image, context: list[str]) -> list[str]:
    """Problems found without running anything (empty: all good)."""
    problems = []
    for rel in context:
        top = rel.split("/", 1)[0]
        if top in FORBIDDEN or rel.endswith(FORBIDDEN_SUFFIXES):
            problems.append(f"build context contains {rel} (add it to .dockerignore)")
    names = set(context)
    for src, _dst in img.copies:
        if (
            src != "."
            and src not in names
            and not any(n.startswith(src.rstrip("/") + "/") for n in names)
        ):
            problems.append(f"COPY source {src} is not in the build context")
    if not img.cmd or not img.cmd[0].endswith("vllm-hybrid"):
        problems.append(f"default CMD {img.cmd} does not run vllm-hybrid")
    else:
        sys.path.insert(0, str(ROOT))
        from vllm_hybrid.cli import build_parser

        try:
            build_parser().parse_args(img.cmd[1:])
        except SystemExit:
            problems.append(f"default CMD {img.cmd[1:]} does not parse with vllm-hybrid's CLI")
    return problems


def _apt_packages(run: str) -> list[str]:
    m = re.search(r"apt-get install ([^&;|]*)", run)
    return [w for w in (m.group(1).split() if m else []) if not w.startswith("-")]


def emulate(root: Path, img: Image, context: list[str], timeout_s: int) -> list[str]:
    """Copy the context, run the RUN steps and the CMD outside a container; problems found."""
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dockerfile-check-") as tmp:
        work = Path(tmp) / img.workdir.lstrip("/")
        work.mkdir(parents=True)
        for rel in context:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, work / rel)
        env = {**os.environ, **img.env}
        env.pop("VIRTUAL_ENV", None)
        for run in img.runs:
            if run.startswith("apt-get"):
                for pkg in _apt_packages(run):
                    found = subprocess.run(["dpkg", "-s", pkg], capture_output=True).returncode == 0
                    print(
                        f"[dockerfile] apt package {pkg}: {'present' if found else 'MISSING'} here"
                    )
                    if not found:
                        problems.append(f"apt package {pkg} is not installed on this machine")
                continue
            print(f"[dockerfile] RUN {run}")
            rc = subprocess.run(
                ["bash", "-c", run], cwd=work, env=env, timeout=timeout_s
            ).returncode
            if rc:
                problems.append(f"RUN {run!r} exited {rc}")
                return problems
        print(f"[dockerfile] CMD {img.cmd}")
        rc = subprocess.run(img.cmd, cwd=work, env=env, timeout=timeout_s).returncode
        if rc:
            problems.append(f"CMD {img.cmd} exited {rc}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", default=str(ROOT), help="build context (default: the repo)")
    p.add_argument("--dockerfile", default=None, help="default: CONTEXT/Dockerfile")
    p.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--run", action="store_true", help="emulate the build and run the CMD")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per RUN step and the CMD")
    args = p.parse_args(argv)
    try:
        build_args = dict(a.split("=", 1) for a in args.build_arg)
        root = Path(args.context).resolve()
        img = parse_dockerfile(Path(args.dockerfile or root / "Dockerfile"), build_args)
        context = build_context(root)
        problems = static_checks(root, img, context)
        print(
            f"[dockerfile] base {img.base}; {len(context)} files in the build context; "
            f"{len(img.runs)} RUN steps; CMD {img.cmd}"
        )
        if args.run and not problems:
            problems = emulate(root, img, context, args.timeout)
    except (DockerfileError, ValueError) as exc:
        print(f"[dockerfile] error: {exc}", file=sys.stderr)
        return 2
    for prob in problems:
        print(f"[dockerfile] problem: {prob}", file=sys.stderr)
    print("[dockerfile] ok" if not problems else f"[dockerfile] {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
