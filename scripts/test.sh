#!/usr/bin/env bash
# Install (idempotent) and run the test suite; extra arguments go to pytest.
# Slow end-to-end tests are deselected by default (pyproject: -m 'not slow'); run them with
#   bash scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
