#!/usr/bin/env bash
# Download wheels for the GPU machine (Python 3.12, x86-64 manylinux) into .whl/, which scripts/gpu_check.sh installs
# there and the device call carries (`carry: [".whl"]`; at most 64 MiB with the tree). Run here, in the repo root:
#
#   scripts/fetch_wheels.sh NAME==VERSION ...
#
# Pure-Python wheels (py3-none-any) match any platform; for compiled ones pip matches the manylinux tag exactly, so
# several are tried. --no-deps: name every missing dependency too (`unzip -p .whl/NAME-*.whl '*/METADATA' | grep
# ^Requires-Dist` lists them). Keep one version of each package: two stop the whole install. .whl/ is git-ignored
# locally (.git/info/exclude), never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: scripts/fetch_wheels.sh NAME==VERSION ... (the GPU check itself needs none: docs/gpu.md)" >&2; exit 2; }
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
py=${PYTHON:-python3}
plat=()
for n in 28 27 24 17; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p .whl
for req in "$@"; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl "$req"
done
ls -l .whl
du -sh .whl
