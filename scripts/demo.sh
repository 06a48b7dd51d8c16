#!/usr/bin/env bash
# The main job: set up (quick when already done), then run `vmmshare demo` on the node's default broker (started
# on first use; it exits by itself once idle). Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/vmmshare demo "$@"
