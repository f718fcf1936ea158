#!/usr/bin/env bash
# Install the Matrix homeserver the Matrix tests run against (tests/synapse_server.py):
# Synapse from PyPI, pinned, into a venv of its own ($1, default .synapse-venv) so its
# dependency pins never meet the project's. A venv that already has the pinned version is
# left as it is; otherwise pip's cache makes a reinstall fast.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.synapse-venv}"
version="1.163.2"
if [ -x "$venv/bin/python" ] \
  && "$venv/bin/python" -m pip show matrix-synapse 2>/dev/null | grep -qx "Version: $version"; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
"$venv/bin/python" -m pip install -q "matrix-synapse==$version"
