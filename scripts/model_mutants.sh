#!/usr/bin/env bash
# Show that the model-based test catches two deliberate breakages within its CI budget.
# Usage: scripts/model_mutants.sh [REPO]   (default: this checkout)
# Each mutant is applied to a throwaway copy of the repo (git worktree-free: cp -a of the
# tracked tree), the local-disk model runs with its CI settings, and the result is printed.
set -u
REPO=${1:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${PY:-$REPO/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

run_mutant() {  # name, python snippet that edits files under $dir
  local name=$1 edit=$2 dir="$work/$1"
  mkdir -p "$dir" && git -C "$REPO" archive HEAD | tar -x -C "$dir"
  (cd "$dir" && "$PY" -c "$edit") || { echo "$name: mutation did not apply"; return; }
  local start=$SECONDS
  # The local-disk state machine and the named replays of shrunk sequences, as CI runs them.
  if (cd "$dir" && PYTHONPATH="$dir" timeout 600 "$PY" -m pytest -q -p no:cacheprovider \
        -o timeout=0 tests/reliability/test_model_based.py -k "model_on_local_disk or regression" \
        >"$dir/out.txt" 2>&1); then
    echo "$name: NOT caught ($((SECONDS - start)) s)"
  else
    echo "$name: caught in $((SECONDS - start)) s by: $(grep -o '^FAILED [^ ]*' "$dir/out.txt" | sed 's/.*:://' | tr '\n' ' ')"
    grep -m1 -o 'Violation: .*' "$dir/out.txt" | cut -c1-300
  fi
}

# 1. Retention counts damaged checkpoints as intact: it judges only manifests, never the sizes
#    of the files it lists (what issue 25 case 1 was).
run_mutant retention_counts_damaged_as_intact '
import pathlib
p = pathlib.Path("statereg/engine/retention.py"); s = p.read_text()
assert "scan.intact" in s, "retention.py changed shape: edit the mutant"
p.write_text(s.replace("scan.intact", "scan.committed"))
'

# 2. Incremental reuse without re-verification: a referenced base file is never re-read
#    (what case 2 was).
run_mutant incremental_reuse_without_reverification '
import pathlib
p = pathlib.Path("statereg/engine/incremental.py"); s = p.read_text()
anchor = "    def _check(self, path: str) -> bool:\n"
assert anchor in s, "incremental.py changed shape: edit the mutant"
p.write_text(s.replace(anchor, anchor + "        return True  # MUTANT: trust every reference\n", 1))
'
