#!/usr/bin/env bash
# Several lane runs in one device call, one after the other, each through scripts/gpu_lane.sh:
#
#   bash scripts/gpu_runs.sh ENGINE SPEC [SPEC ...] [-- ARGS FOR EVERY RUN]
#   SPEC = NAME:LANE[:VAR=VALUE[,VAR=VALUE ...]]
#   e.g. bash scripts/gpu_runs.sh tokenspeed plain:e2e-1gpu-pd n64:e2e-1gpu-pd:E2E_GSM8K_N=64
#
# A device call returns at most 8 files and stops at 10 minutes; a lane run is 1-3 minutes. So:
#   - each run's results folder (E2E_RESULTS_DIR=/tmp/res/NAME), its lane log and what
#     gpu_lane.sh printed go into one file, $OUT/NAME.tar.xz (without $OUT: /tmp/res);
#     `scripts/device_session.py publish` reads those files;
#   - the call has a budget, E2E_CALL_LIMIT_S (default 560 s of the call's 600): each run gets
#     the smaller of its own limit (E2E_LANE_LIMIT_S, default 570) and what is left less a
#     margin for teardown (E2E_RUN_MARGIN_S, default 30); a run with less than E2E_RUN_MIN_S
#     (default 60) left is not started and is named as skipped;
#   - NAME is letters, digits, '.', '_' and '-' (a file name the device returns), unique;
#     VAR must be an E2E_*, TOKENSPEED_* or VLLM_* variable, or PYTEST_ADDOPTS (pytest options
#     of that run alone, e.g. --e2e-shuffle=1). Bad specs stop it before any run.
# Prints one line per run (`gpu_runs: NAME rc=R wall=Ws`) and exits 1 if any run failed or was
# skipped.
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then    # usage and the comment above
  echo "usage: bash scripts/gpu_runs.sh ENGINE NAME:LANE[:VAR=VALUE,...] ... [-- ARGS]"
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  exit 0
fi
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
usage() { echo "usage: scripts/gpu_runs.sh ENGINE NAME:LANE[:VAR=VALUE,...] ... [-- ARGS]" >&2; exit 2; }
[ $# -ge 2 ] || usage
eng=$1; shift
specs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do specs+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#specs[@]} -ge 1 ] || usage
names=" "
for spec in "${specs[@]}"; do          # every spec checked before the first run starts
  IFS=: read -r name lane envs extra <<< "$spec"
  [ -n "${extra:-}" ] && { echo "gpu_runs: '$spec': more than three ':'-separated fields" >&2; exit 2; }
  [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "gpu_runs: '$spec': NAME must be letters, digits, '.', '_' or '-'" >&2; exit 2; }
  [ -n "${lane:-}" ] || { echo "gpu_runs: '$spec': no LANE" >&2; exit 2; }
  [[ "$names" == *" $name "* ]] && { echo "gpu_runs: '$name' named twice" >&2; exit 2; }
  names="$names$name "
  IFS=, read -ra kvs <<< "${envs:-}"
  for kv in "${kvs[@]}"; do
    [[ "$kv" =~ ^((E2E|TOKENSPEED|VLLM)_[A-Z0-9_]+|PYTEST_ADDOPTS)=.*$ ]] || { echo "gpu_runs: '$spec': '$kv' is not VAR=VALUE with an E2E_, TOKENSPEED_ or VLLM_ variable or PYTEST_ADDOPTS" >&2; exit 2; }
  done
done
call_limit=${E2E_CALL_LIMIT_S:-560}; margin=${E2E_RUN_MARGIN_S:-30}; min_run=${E2E_RUN_MIN_S:-60}
dest=${OUT:-/tmp/res}; mkdir -p "$dest" /tmp/res
start=$(date +%s); bad=0
for spec in "${specs[@]}"; do
  IFS=: read -r name lane envs _ <<< "$spec"
  IFS=, read -ra kvs <<< "${envs:-}"
  own=${E2E_LANE_LIMIT_S:-570}
  for kv in "${kvs[@]}"; do [[ "$kv" == E2E_LANE_LIMIT_S=* ]] && own=${kv#*=}; done
  left=$(( call_limit - ($(date +%s) - start) - margin ))
  lim=$(( own < left ? own : left ))
  if [ "$lim" -lt "$min_run" ]; then
    echo "gpu_runs: $name skipped: ${left}s left of the call's ${call_limit}s (at least ${min_run}s needed)"
    bad=1; continue
  fi
  dir=/tmp/res/$name; rm -rf "$dir"; mkdir -p "$dir"
  s=$(date +%s)
  env "${kvs[@]}" E2E_LANE_LIMIT_S="$lim" E2E_RESULTS_DIR="$dir/results" \
    E2E_LANE_LOG="$dir/lane.log" bash scripts/gpu_lane.sh "$eng" "$lane" "$@" > "$dir/driver.log" 2>&1
  rc=$?
  printf '%s\n' "$spec" > "$dir/spec.txt"
  cat "$dir/driver.log"
  echo "gpu_runs: $name rc=$rc wall=$(( $(date +%s) - s ))s limit=${lim}s"
  [ $rc = 0 ] || bad=1
  tar cJf "$dest/$name.tar.xz" -C /tmp/res "$name" 2>/dev/null
done
exit $bad
