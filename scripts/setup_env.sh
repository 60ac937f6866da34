#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs fedhpc with every pinned dependency.
# Safe to re-run: pip skips what is already there. Needs only python3 (>=3.10) and a
# package registry; torch is pinned so that no CUDA build is pulled on CPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -r requirements.txt 2>&1 | grep -v "^WARNING: Location" || true
# --no-build-isolation: the build must see the already-installed CPU torch, not fetch another.
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, mpi4py, h5py, sklearn, yaml, fedhpc; print('fedhpc environment ready: torch', torch.__version__)"
