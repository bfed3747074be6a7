#!/usr/bin/env bash
# Build the sdist and the wheel, install each into a fresh venv, and check that the installed
# package runs with its Cython cores (the sdist once lacked ext/*.pyx and _gear.pxi, so
# `pip install` from it failed). Usage: scripts/dist_check.sh [PYTHON]  (make dist-check)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
for artifact in "$work"/dist/*.tar.gz "$work"/dist/*.whl; do
  venv="$work/venv-$(basename "$artifact")"
  "$PY" -m venv "$venv"
  TB5SYNC_REQUIRE_CYTHON=1 "$venv/bin/pip" install -q "$artifact"
  (cd "$work" && "$venv/bin/python" -c "
import tb5sync, tb5sync.engine.chunking as c, tb5sync.tree.scan as s
assert c.IMPLEMENTATION == 'cython', c.IMPLEMENTATION
assert s.SCAN_IMPLEMENTATION == 'cython', s.SCAN_IMPLEMENTATION
print('$(basename "$artifact"):', tb5sync.__version__, c.IMPLEMENTATION, s.SCAN_IMPLEMENTATION)
")
  (cd "$work" && "$venv/bin/tb5sync" --version)
  mkdir -p "$work/src/d" && echo hello >"$work/src/d/f"
  (cd "$work" && "$venv/bin/tb5sync" sync src/ "dst-$(basename "$artifact")/" && cmp src/d/f "dst-$(basename "$artifact")/d/f")
done
echo "dist-check: sdist and wheel install and run"
