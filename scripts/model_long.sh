#!/usr/bin/env bash
# Run the local-disk model-based test long: CHUNKS chunks of PER sequences each, JOBS at a
# time, chunk i with STATEREG_MODEL_SEED=BASE+i (hypothesis draws other sequences per seed).
# Usage: scripts/model_long.sh [CHUNKS=100] [PER=100] [JOBS=2] [BASE=1000]
# Runs from a snapshot of HEAD (git archive), so edits made meanwhile do not change the run;
# roots live under BASETEMP (default /dev/shm/statereg-model-long: on tmpfs, since the
# model's thousands of fsyncs and unlinks, not statereg, set the pace on disk; one folder
# there, so tests that watch /dev/shm for leftovers while this runs see nothing new), one
# folder per chunk, removed when it passed.
# Prints one line per chunk and a total; a failing chunk's output stays in its log.
set -u
CHUNKS=${1:-100} PER=${2:-100} JOBS=${3:-2} BASE=${4:-1000}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
work=${WORK:-$(mktemp -d)}
mkdir -p "$work/tree" "$work/logs"
git -C "$REPO" archive HEAD | tar -x -C "$work/tree"
echo "commit $(git -C "$REPO" rev-parse --short HEAD); $CHUNKS chunks x $PER sequences; logs in $work/logs"

chunk() {
  local seed=$(( BASE + $1 )) log="$work/logs/seed-$(( BASE + $1 )).log" start=$SECONDS
  local tmp="$BASETEMP/statereg-model-$seed"
  if (cd "$work/tree" && PYTHONPATH="$work/tree" STATEREG_MODEL_EXAMPLES=$PER \
        STATEREG_MODEL_SEED=$seed timeout 7200 "$PY" -m pytest -q -p no:cacheprovider \
        -o timeout=0 --basetemp="$tmp" tests/reliability/test_model_based.py \
        -k model_on_local_disk >"$log" 2>&1); then
    rm -rf "$tmp"
    echo "seed $seed: $PER sequences passed in $(( SECONDS - start )) s"
  else
    echo "seed $seed: FAILED after $(( SECONDS - start )) s (see $log)"
  fi
}
export -f chunk
BASETEMP=${BASETEMP:-/dev/shm/statereg-model-long}
mkdir -p "$BASETEMP"
export BASE PER PY work BASETEMP
seq 0 $(( CHUNKS - 1 )) | xargs -P "$JOBS" -I{} bash -c 'chunk {}' | tee "$work/summary.txt"
passed=$(grep -c "passed" "$work/summary.txt")
echo "total: $(( passed * PER )) sequences passed in $passed of $CHUNKS chunks"
