#!/usr/bin/env bash
# Create .venv (once) and install vmmshare with its development and test tools into it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
# CPU torch for the DLPack interop test, only from a local wheel (never a multi-GB download); else that test skips.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  tag=$(.venv/bin/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=$(ls "${VMMSHARE_WHEELS:-/opt/wheels}"/torch-*+cpu-"$tag"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$wheel" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "$wheel" || echo "torch not installed: its test will skip"
  fi
fi
