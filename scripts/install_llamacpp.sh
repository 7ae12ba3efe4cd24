#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in llama-cpp-python 0.3.36 (PyPI
# sdist), for benchmarks/vs_llamacpp.py. Optional: nothing else in the project needs it.
# Result: .llama/llama.cpp (sources, with the GGUF converter) and .llama/llama.cpp/build/bin/
# llama-server. Idempotent: an existing binary is kept. Needs cmake and a C++ compiler
# (~10 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
DIR=.llama
SRC="$DIR/llama.cpp"
BIN="$SRC/build/bin/llama-server"
if [ -x "$BIN" ]; then
  echo "[llama.cpp] $BIN is built"
  exit 0
fi
mkdir -p "$DIR"
if [ ! -d "$SRC" ]; then
  PIP="${PIP:-.venv/bin/pip}"
  "$PIP" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR"
  tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
  mv "$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
  rm -rf "$DIR/llama_cpp_python-$VERSION" "$DIR/llama_cpp_python-$VERSION.tar.gz"
fi
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$SRC/build" --target llama-server -j "$(nproc)"
echo "[llama.cpp] built $BIN"
