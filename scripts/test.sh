#!/usr/bin/env bash
# Run the test suite, setting up the virtualenv first if needed.
#
#   ./scripts/test.sh                         # everything
#   ./scripts/test.sh tests/engine -k commit  # arguments go to pytest
#
# Without arguments it first lints: `ruff check statereg tests` (see [tool.ruff] in
# pyproject.toml) and type-checks: `mypy statereg` ([tool.mypy]; about 2 minutes the first
# time, seconds with its cache); a failure stops the run before pytest. With arguments (a developer's
# subset) the lint is skipped, so the inner loop stays fast.
# Without arguments pytest also runs on $STATEREG_TEST_WORKERS worker processes (pytest-xdist;
# default 2, CI's two cores; 0: none), which share the tests out by work stealing; each worker
# starts the storage servers its tests ask for. A subset runs in one process, with no workers
# to start; add `-n 2` to spread a large one.
# Under CI (CI=true, no arguments) it then also proves what pyproject.toml claims: the
# compatibility subset on the newest claimed torch in a virtualenv of its own
# (.ci/torch-matrix) and the cloud extras resolving next to an unpinned boto3
# (.ci/resolve-extras). See docs/compatibility.md.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
venv="${STATEREG_VENV:-.venv}"
if [[ $# -eq 0 ]]; then
  "$venv/bin/ruff" check statereg tests
  "$venv/bin/mypy" statereg
fi
pytest_args=("$@")
if [[ $# -eq 0 && "${STATEREG_TEST_WORKERS:-2}" != 0 ]]; then
  pytest_args=(-n "${STATEREG_TEST_WORKERS:-2}" --dist worksteal)
fi
status=0
"$venv/bin/python" -m pytest -q "${pytest_args[@]}" || status=$?
if [[ $status -eq 0 && "${CI:-}" == "true" && $# -eq 0 ]]; then
  .ci/resolve-extras || status=$?
  if [[ $status -eq 0 ]]; then
    .ci/torch-matrix || status=$?
  fi
fi
exit $status
