#!/usr/bin/env bash
# Run the test suite, setting up the virtualenv first if needed.
#
#   ./scripts/test.sh                         # everything
#   ./scripts/test.sh tests/engine -k commit  # arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${STATEREG_VENV:-.venv}/bin/python" -m pytest -q "$@"
