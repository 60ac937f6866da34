#!/usr/bin/env bash
# Set everything up (./.venv) and run the main job: FedAvg on the embedded digits data
# over 2 MPI ranks. Extra arguments go to the launcher (e.g. --rounds 10).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
out=${OUT:-runs/digits-fedavg-$(date +%Y%m%d-%H%M%S)}
.venv/bin/mpiexec -n 2 .venv/bin/python -m fedhpc.launch --config launch/digits_fedavg.yaml --out "$out" "$@"
echo "outputs in $out (metrics.jsonl, final_model.pt, tensorboard/)"
