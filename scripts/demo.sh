#!/usr/bin/env bash
# The main job: set up what the demo needs (the package alone; quick when already done), then run `vmmshare demo`
# on the node's default broker (started on first use; it exits by itself once idle). Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh demo
exec .venv/bin/vmmshare demo "$@"
