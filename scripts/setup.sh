#!/usr/bin/env bash
# Create .venv (once) and install vmmshare with its development and test tools into it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
