#!/usr/bin/env bash
# Set everything up (./.venv) and run the main job: Mix2FLD on the embedded digits data over
# 2 MPI ranks under the asymmetric wireless channel (the laptop twin of the Mix2FLD paper's
# Fig. 2). Extra arguments go to the launcher (e.g. --rounds 10, --algo fl).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
out=${OUT:-runs/digits-mix2fld-$(date +%Y%m%d-%H%M%S)}
.venv/bin/mpiexec -n 2 .venv/bin/python -m fedhpc.launch --config launch/mix2fld_digits.yaml --threads 1 --out "$out" "$@"
echo "outputs in $out (metrics.jsonl, final_model.pt, tensorboard/)"
