#!/usr/bin/env bash
# The GPU check from a source tree, on a machine where the project is not pip-installed (a lent GPU machine):
#
#   scripts/gpu_check.sh OUT_DIR [gpu-check options, e.g. --phases 3]
#
# Puts the tree on PYTHONPATH, installs the wheels in .whl/ (if any: scripts/fetch_wheels.sh fetches them; the check
# itself needs none on the GPU image, see docs/gpu.md) into a target folder, then runs
# `python3 -m torchmoe_harness.gpu_check --out OUT_DIR ...`, its output also in OUT_DIR/gpu_check.log.
# Exit status: the check's (0: every phase passed).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [gpu-check options]}
shift
mkdir -p "$out"
py=${PYTHON:-python3}
site=${TMOE_SITE:-/tmp/tmoe-site}
if compgen -G "$root/.whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$root"/.whl/*.whl \
    || { echo "gpu_check.sh: installing $root/.whl/*.whl failed" >&2; exit 3; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$root"
"$py" -m torchmoe_harness.gpu_check --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
