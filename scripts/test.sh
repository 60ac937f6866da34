#!/usr/bin/env bash
# Set everything up (./.venv) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PYTHONUNBUFFERED=1
# One worker per core, capped at 4, each taking whole test modules (--dist loadfile) so that a
# module's shared fixtures (the 2-rank launch of test_algorithm_standard.py) run once. Most of
# the suite is subprocess launches that use about one core each, so on CI's 2 cores two
# workers take the tests from about 16 to about 10 minutes. FEDHPC_TEST_WORKERS=0 runs them
# serially, in one process.
workers=${FEDHPC_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 1); [ "$n" -gt 4 ] && n=4; [ "$n" -lt 2 ] && n=0; echo $n)}
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile tests "$@"
