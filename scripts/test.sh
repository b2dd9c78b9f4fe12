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
status=0
"$venv/bin/python" -m pytest -q "$@" || status=$?
if [[ $status -eq 0 && "${CI:-}" == "true" && $# -eq 0 ]]; then
  .ci/resolve-extras || status=$?
  if [[ $status -eq 0 ]]; then
    .ci/torch-matrix || status=$?
  fi
fi
exit $status
