#!/usr/bin/env bash
# Train a tiny model, kill it with SIGKILL, resume it, and check the resumed losses are
# bit-identical to an uninterrupted run (examples/train_demo.py). About 30 s on 2 CPU cores.
#
#   ./scripts/demo.sh                      # checkpoints go to a new temporary directory
#   ./scripts/demo.sh --workdir /tmp/demo  # or to this one
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${STATEREG_VENV:-.venv}/bin/python" examples/train_demo.py "$@"
