#!/bin/bash
# Experiment, not a lane (issue 22): SIGTERM to a Python-API driver holding `1` on a GPU.
# usage: PY=VENV/bin/python bash scripts/sigterm_case.sh   (writes ${OUT:-results}/sigterm-case)
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then    # usage and the comment above
  echo "usage: PY=VENV/bin/python bash scripts/sigterm_case.sh"
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  exit 0
fi
set -u
o=${OUT:-results}/sigterm-case; mkdir -p $o
export E2E_BACKEND=cuda E2E_MODEL_PATH=${E2E_MODEL_PATH:-/root/models/SmolLM2-135M-Instruct} VLLM_USE_FLASHINFER_SAMPLER=0 \
  E2E_ENFORCE_EAGER=1 E2E_RESULTS_DIR=$o PYTHONUNBUFFERED=1 
nvidia-smi --query-gpu=memory.used --format=csv,noheader > $o/nvidia-smi-before.txt
${PY:-python3} scripts/sigterm_case.py $o > $o/driver.log 2>&1 &
pid=$!
for i in $(seq 1 240); do [ -f $o/ready ] && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
t0=$(date +%s.%N)
nvidia-smi --query-gpu=memory.used --format=csv,noheader > $o/nvidia-smi-serving.txt
kill -TERM $pid; wait $pid; rc=$?
t1=$(date +%s.%N)
for k in 0 1 2 3 4 5; do echo "t+$k s: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; sleep 1; done > $o/nvidia-smi-after.txt
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader > $o/compute-apps-after.txt
echo "driver rc=$rc, exited $(python3 -c "print(round($t1-$t0,2))") s after SIGTERM"
grep -v "^INFO\|^(\|^DEBUG\|^WARNING" $o/driver.log | tail -15
python3 - $o <<'PY'
import json, sys, glob
for f in glob.glob(sys.argv[1] + "/cluster/cluster.json"):
    t = json.load(open(f)).get("teardown")
    print("TEARDOWN", json.dumps({k: t.get(k) for k in ("ok", "verdict", "seconds", "gpu_checked", "gpu_settle_s", "gpu_wait_s", "gpu_leaks", "gpu_holders", "survivors", "escalated")} if t else None))
PY
cat $o/nvidia-smi-before.txt $o/nvidia-smi-serving.txt $o/nvidia-smi-after.txt $o/compute-apps-after.txt
rm -rf $o/cluster/logs/*.1.log 2>/dev/null; true
