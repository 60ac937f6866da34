#!/usr/bin/env bash
# The one command of the peers benchmark (issue 14), from a clean clone:
#     bash benchmarks/peers/run.sh [bench.py options, e.g. --repeats 5 --workloads a]
# 1. the project's .venv (scripts/setup_env.sh) if missing; 2. the peers' venvs under
# .venvs/ if missing (minutes; setup_venvs.sh); 3. the workloads exported from fedhpc to
# .work/; 4. bench.py: interleaved runs, then the table (also saved to .work/table.md).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="$REPO/.venv/bin/python"
if [[ ! -x "$PY" ]]; then
    bash "$REPO/scripts/setup_env.sh" || { echo "error: the project's .venv could not be made" >&2; exit 1; }
fi
bash "$HERE/setup_venvs.sh" || echo "warning: a peer venv could not be made; its columns are left out" >&2
"$PY" "$HERE/export_workload.py" --out "$HERE/.work" || exit 1
exec "$PY" "$HERE/bench.py" --work "$HERE/.work" --save "$HERE/.work/table.md" "$@"
