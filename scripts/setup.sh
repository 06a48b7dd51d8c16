#!/usr/bin/env bash
# Create .venv (once) and install vmmshare into it (the install builds the C library too): `scripts/setup.sh` (or
# `test`) with its development, test and docs tools and the system packages the tests use (scripts/test.sh);
# `scripts/setup.sh demo` the package alone, nothing from apt (scripts/demo.sh: the demo needs no more). The install
# is skipped when .venv already holds it for this pyproject.toml, this script, setup.py and the C library's sources
# (a stamp of their hash and the mode; a test set-up serves the demo too), so repeated runs are quick; a fresh clone,
# or a change to any of them, installs in full.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-test}
case "$mode" in
  test|demo) ;;
  *) echo "usage: scripts/setup.sh [test|demo]" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.vmmshare-setup
want=$(cat pyproject.toml scripts/setup.sh setup.py src/vmmshare/clib/* | sha256sum | cut -d' ' -f1)  # C: rebuilt
here=$(.venv/bin/python -c 'import vmmshare, os; print(os.path.dirname(vmmshare.__file__))' 2>/dev/null || true)
if [ "$here" = "$PWD/src/vmmshare" ]; then
  case "$(cat "$stamp" 2>/dev/null)" in
    "$want test") exit 0 ;;
    "$want demo") [ "$mode" = demo ] && exit 0 ;;
  esac
fi
rm -f "$stamp"
if [ "$mode" = demo ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e .
  echo "$want demo" > "$stamp"
  exit 0
fi
# The cross-server transport's engine (vmmshare[fabric]) loads libibverbs, libnuma and libcurl even over TCP.
missing=""
for lib in libibverbs.so.1 libnuma.so.1 libcurl.so.4; do
  ldconfig -p 2>/dev/null | grep -q "$lib" || missing="$missing $lib"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing the fabric engine's system libraries (missing:$missing)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnuma1 libcurl4 >/dev/null
  else
    echo "the fabric engine needs system libraries that are missing:$missing" \
         "(install them with: sudo apt-get install libibverbs1 libnuma1 libcurl4); cross-server tests will not run"
  fi
fi
# systemd-analyze checks the shipped units (tests/test_cli_service.py); no systemd needs to run for it.
if ! command -v systemd-analyze >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing systemd (for systemd-analyze verify of packaging/systemd/)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null
  else
    echo "systemd-analyze is missing (sudo apt-get install systemd): the unit files' check will not run"
  fi
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,fabric,docs,deploy]'
# CPU torch for the DLPack interop test, only from a local wheel (never a multi-GB download); else that test skips.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  tag=$(.venv/bin/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=$(ls "${VMMSHARE_WHEELS:-/opt/wheels}"/torch-*+cpu-"$tag"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$wheel" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "$wheel" || echo "torch not installed: its test will skip"
  fi
fi
echo "$want test" > "$stamp"
