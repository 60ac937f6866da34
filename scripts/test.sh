#!/usr/bin/env bash
# Set everything up (./.venv) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
