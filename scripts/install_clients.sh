#!/usr/bin/env bash
# Install the third-party benchmark clients benchmarks/bench_clients.py drives: guidellm 0.8.1
# and aiperf 0.13.0, each into its own virtual environment under .venv-clients/, so neither
# their dependencies nor each other's can change the pinned vLLM environment (.venv).
# vLLM's own client (vllm.benchmarks.serve) runs from .venv and needs nothing here.
# Optional: nothing else in the project needs these tools. Idempotent: an environment whose
# tool imports at the pinned version is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${VLLM_HYBRID_CLIENTS_VENV:-.venv-clients}"
PY="${PYTHON:-python3}"
# guidellm requires torch (unpinned); left alone pip picks the newest CUDA build (~5 GB of
# nvidia-* wheels). The main environment's CPU torch is pinned here instead; on a machine
# without a local CPU wheel pass TORCH_INDEX=https://download.pytorch.org/whl/cpu.
TORCH_REQ="${TORCH_REQ:-torch==2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-}"

install_one() {  # name, pip requirement, module to import, version it must report
  local name="$1" req="$2" module="$3" want="$4" venv="$ROOT/$1"
  if [ -x "$venv/bin/python" ] && [ "$("$venv/bin/python" -c \
      "from importlib.metadata import version; print(version('$name'))" 2>/dev/null)" = "$want" ] \
      && "$venv/bin/python" -c "import $module" 2>/dev/null; then
    echo "[clients] $name $want is installed in $venv"
    return 0
  fi
  echo "[clients] installing $req into $venv"
  mkdir -p "$ROOT"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  if [ "$name" = guidellm ]; then
    "$venv/bin/pip" install -q ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$TORCH_REQ"
    "$venv/bin/pip" freeze | grep -i '^torch==' > "$venv/torch-constraint.txt"
    "$venv/bin/pip" install -q -c "$venv/torch-constraint.txt" "$req"
  else
    "$venv/bin/pip" install -q "$req"
  fi
  "$venv/bin/python" -c "import $module; from importlib.metadata import version; \
print('[clients] ok: $name', version('$name'))"
}

install_one guidellm "guidellm==0.8.1" guidellm 0.8.1
install_one aiperf "aiperf==0.13.0" aiperf 0.13.0
