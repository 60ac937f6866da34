#!/bin/bash
# One pre-emptible fedhpc run as a multi-rank srun step, called by run.sbatch, run_gpu.sbatch
# and the array scripts `python -m fedhpc.sweep` writes (never submitted on its own).
#
#   bash slurm/step.sh OUT_DIR [launcher flags...]
#
# - rendezvous: rank 0 runs on the first node of the allocation (block distribution), so
#   MASTER_ADDR is the first host of SLURM_JOB_NODELIST, expanded by `scontrol show hostnames`
#   or, where scontrol cannot, by fedhpc's own parser (fedhpc/hostlist.py); MASTER_PORT is
#   derived from the job id, so array tasks sharing a node do not collide.
# - threads per rank = SLURM_CPUS_PER_TASK, passed to srun explicitly (srun stopped inheriting
#   --cpus-per-task from sbatch in SLURM 22.05) and to fedhpc as --threads.
# - pre-emption: SLURM's warning signal (sbatch --signal=B:USR1@120) reaches this shell; it is
#   forwarded to the step, fedhpc checkpoints at the end of the round and exits 75, and the job
#   (or array task) is requeued; the requeued job passes --resume and continues.
# - OUT_DIR/status.json records how the attempt ended (fedhpc.sweep.state reads it).
set -uo pipefail
OUT=${1:?usage: step.sh OUT_DIR [launcher flags...]}
shift
PY=${FEDHPC_PYTHON:-.venv/bin/python}
THREADS=${SLURM_CPUS_PER_TASK:-1}

if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n 1)
    [ -n "$MASTER_ADDR" ] || MASTER_ADDR=$("$PY" -m fedhpc.hostlist --first "$SLURM_JOB_NODELIST") || exit 2
    export MASTER_ADDR
fi
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
echo "fedhpc step: out $OUT, rendezvous ${MASTER_ADDR:-local}:$MASTER_PORT, $THREADS thread(s) per rank"

# Forward the warning to the job step.
trap 'echo "pre-emption warning: checkpointing"; kill -USR1 "$step" 2>/dev/null' USR1

# --mpi=none: ranks bootstrap over TCP from SLURM's variables (fedhpc/world.py), not PMI.
srun --kill-on-bad-exit=1 --mpi=none --cpus-per-task="$THREADS" --cpu-bind=cores \
     "$PY" -m fedhpc.launch "$@" --out "$OUT" --resume --threads "$THREADS" &
step=$!
wait "$step"; code=$?
# `wait` returns early when the trap fires; wait again for the step to finish its checkpoint.
while kill -0 "$step" 2>/dev/null; do wait "$step"; code=$?; done

mkdir -p "$OUT"
printf '{"exit_code": %d, "where": "slurm job %s", "ended": %s}\n' "$code" "${SLURM_JOB_ID:-?}" "$(date +%s)" \
    > "$OUT/.status.json.tmp" && mv -f "$OUT/.status.json.tmp" "$OUT/status.json"

if [ "$code" -eq 75 ]; then
    # An array task is requeued by its own id (ARRAYJOB_TASK), a plain job by its job id.
    job=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}
    job=${job:-${SLURM_JOB_ID}}
    echo "checkpointed after a signal; requeueing $job"
    scontrol requeue "$job"
fi
exit "$code"
