#!/usr/bin/env bash
# Install (idempotent) and run the demo: a tiny local hybrid model served by vLLM with the
# plugin, a multi-turn chat, and the prompt tokens served from cache per turn.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/vllm-hybrid demo "$@"
