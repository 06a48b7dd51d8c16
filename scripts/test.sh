#!/usr/bin/env bash
# The test command: set up, lint (ruff), type-check (mypy), run the examples and the test suite (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
