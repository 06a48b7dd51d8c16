#!/usr/bin/env bash
# The test command: set up, lint (ruff), type-check (mypy), build the docs (mkdocs --strict), run the examples and
# the test suite (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
# The documentation site, strictly: a page left out of the nav, a broken link or anchor fails (mkdocs.yml).
site=$(mktemp -d)
.venv/bin/mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
# In parallel (pytest-xdist): the tests mostly wait on child processes, so more workers than cores pay off
# (VMMSHARE_TEST_WORKERS=0 runs them in this one process). The tests marked `alone` keep the xdist group "alone",
# scheduled after the rest (no reordering of groups by size); see tests/conftest.py.
.venv/bin/python -m pytest -q -n "${VMMSHARE_TEST_WORKERS:-3}" --dist loadgroup --no-loadscope-reorder "$@"
