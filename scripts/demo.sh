#!/usr/bin/env bash
# The main job: set up, then run `vmmshare demo` on the embedded default broker. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/vmmshare demo "$@"
