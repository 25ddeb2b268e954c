#!/usr/bin/env bash
# Mutation testing of the verdict modules ([tool.mutmut] in pyproject.toml; docs/mutation.md):
# mutmut runs each file's mutants against the unit tests, one file at a time, then
# scripts/mutation_scores.py writes the per-file and per-function scores to docs/mutation.json
# with the git SHA, refusing a score below the file's committed floor.
#   bash scripts/mutation.sh [--children N] [--raise-floor] [FILE ...]
#     FILE         a file of only_mutate (default: all five), e.g. e2e_test/infra/load/bursts.py
#     --children   mutants tested at once (default 1)
#     --raise-floor  set each file's floor to the score reached
#     --fresh      remove mutmut's previous results (mutants/) first
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: bash scripts/mutation.sh [--children N] [--raise-floor] [--fresh] [FILE ...]"; sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
CHILDREN=1
FLOOR=()
FILES=()
FRESH=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --children) [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "mutation: --children needs a number >= 1" >&2; exit 2; }
                CHILDREN="$2"; shift 2 ;;
    --raise-floor) FLOOR=(--raise-floor); shift ;;
    --fresh) FRESH=1; shift ;;
    -*) echo "mutation: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) FILES+=("$1"); shift ;;
  esac
done
PY=${PYTHON:-python}
"$PY" -c "import mutmut" 2>/dev/null || { echo "mutation: mutmut is not installed (pip install -e '.[dev]')" >&2; exit 2; }
ALL=$("$PY" -c "import sys; sys.path.insert(0, 'scripts'); import mutation_scores as m; print(' '.join(m.mutated_files()))")
[ ${#FILES[@]} -gt 0 ] || read -r -a FILES <<< "$ALL"
for f in "${FILES[@]}"; do
  [[ " $ALL " == *" $f "* ]] || { echo "mutation: $f is not one of the mutated files: $ALL" >&2; exit 2; }
done
[ "$FRESH" = 0 ] || rm -rf mutants
mkdir -p mutants
# The commit the mutants are made from; "+dirty" where the package, tests or config differ
# from it (mutation_scores.py writes it into docs/mutation.json).
sha=$(git rev-parse HEAD)
[ -z "$(git status --porcelain --untracked-files=no -- e2e_test tests pyproject.toml)" ] || sha="$sha+dirty"
echo "$sha" > mutants/SHA
MUTMUT="$(dirname "$(command -v "$PY")")/mutmut"
[ -x "$MUTMUT" ] || MUTMUT=mutmut
for f in "${FILES[@]}"; do
  mod=${f%.py}; mod=${mod//\//.}
  echo "mutation: $f" >&2
  # mutmut exits 0 whatever survives; its per-mutant results land in mutants/$f.meta
  "$MUTMUT" run --max-children "$CHILDREN" "$mod.*" > "mutants/run-$(basename "$f" .py).log" 2>&1 \
    || { echo "mutation: mutmut failed on $f (mutants/run-$(basename "$f" .py).log)" >&2; exit 1; }
done
exec "$PY" scripts/mutation_scores.py "${FLOOR[@]}" "${FILES[@]}"
