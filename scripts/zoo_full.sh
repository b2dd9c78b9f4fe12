#!/usr/bin/env bash
# Run the whole stateful zoo (tests/state/zoo.py's table: every row x loop x kill point), not
# only the sample CI runs. 351 cells; the distributed ones start 2 or 3 gloo ranks each,
# so expect tens of minutes on two cores.
#
#   ./scripts/zoo_full.sh                      # the whole table
#   ./scripts/zoo_full.sh -k "ddp and not plain"   # arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
STATEREG_ZOO=full exec "${STATEREG_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider \
  -rxXfs tests/state/test_zoo.py "$@"
