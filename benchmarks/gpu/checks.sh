#!/usr/bin/env bash
# The GPU half of issues 12 and 14, run on a lent device machine from the repository root:
#   bash benchmarks/gpu/checks.sh [tests] [standard] [kernels] [ops] [bench] [plain]   (logs under $OUT, default /tmp/fedhpc-gpu)
#   bash benchmarks/gpu/checks.sh all      # = tests standard ops plain profile bench: everything the GPU side needs, in one command
#   bash benchmarks/gpu/checks.sh acceptance   # what issues 41 and 42 still need, in one call of under 10 minutes
#                                              # (a session's device time is 15 minutes, machine start included)
# tests: environment, the CUDA extension's JIT build, then on the GPU (the tests' device "auto"
#        picks it): tests/test_ops.py, tests/test_batched*.py (every family opted in), tests/test_distributed.py (under the
#        machine's Open MPI), tests/test_engine.py, and the GPU-only tests elsewhere (the
#        ImageNet transform on CUDA, FedMix's double backward through a cuDNN-less LSTM)
# standard: tests/test_algorithm_standard.py on the GPU (8 workers): every registered algorithm
#        on CUDA against its CPU round, and the standard set (resume, 1 vs 2 ranks sharing the GPU)
# ops:   benchmarks/bench_ops.py and bench_reproducible_sum.py --device cuda
# plain: issue 41's table: benchmarks/bench_gpu.py --modes plain,seq,batched on cnn, cnn50, lenet5 (the
#        hand-written loop beside fedhpc sequential and batched, ratios of one run, |w - w_plain|);
#        PLAIN_REPEATS (default 2) alternations, PLAIN_ROUNDS (default 15) rounds each; then the same
#        three modes --in-process (rounds interleaved in one process), with cnn_bn_do (BatchNorm + dropout);
#        benchmarks/bench_device_training.py --device cuda (the main job's device training, FD and Mix2FLD,
#        plain / seq / batched); then benchmarks/bench_batched_families.py --device cuda (sequential vs
#        batched, every family opted in)
# profile: benchmarks/profile_round.py --device cuda: what a round of the plain loop, fedhpc sequential and
#        batched launches and waits for (kernels, syncs, copies, cudaMalloc/Free a round; the operators and
#        kernels seq runs beyond plain), Chrome traces under $OUT/traces, and each mode's host waits of
#        one round by the line of code that caused them (set_sync_debug_mode): where the sequential
#        path's 1.5-2x of the plain loop on the H200 goes (issue 41 s.2)
# bench: benchmarks/bench_gpu.py (rounds/s, GPU utilisation; plain, sequential, batched, ranks sharing)
# acceptance: the open acceptance points, most needed first, each cut to fit one call: env and the
#        extension build; issue 42's (a') (test_algorithm_standard -k gpu: every algorithm's round on
#        CUDA against its CPU round); issue 41's table in one process (plain, seq, batched: cnn, cnn50,
#        lenet5, 12 rounds); the main job's device training against a plain loop (8 rounds); the
#        batched families (6 rounds); the profile (2 rounds); the batched
#        equality tests on CUDA. Logs and JSON under $OUT as the other stages write them.
# The machine's own python3 (with a CUDA torch) runs everything; nothing is installed.
set -u
OUT=${OUT:-/tmp/fedhpc-gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # build for the card in hand only: a shorter nvcc run
# the device machine runs commands as root, which Open MPI's mpiexec refuses without these
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# it has no ssh or rsh either, whose absence stops Open MPI's mpiexec even on one node: `false`
# is found on PATH and never called (v4 reads rsh_agent, v5 ssh_agent)
export OMPI_MCA_plm_rsh_agent=${OMPI_MCA_plm_rsh_agent:-false} OMPI_MCA_plm_ssh_agent=${OMPI_MCA_plm_ssh_agent:-false}
# several tests' mpiexec jobs at once (pytest -n) would each bind their ranks to the same first cores
export OMPI_MCA_hwloc_base_binding_policy=${OMPI_MCA_hwloc_base_binding_policy:-none}
# the real GPU runs the CUDA kernels: no second build of them against the CPU emulation
export FEDHPC_TEST_NO_CUDA_EMULATION=1
PY=${PY:-python3}
step() { echo "== $1 ($(date +%T))"; }
stages=("${@:-tests}")
[ "${stages[*]}" = all ] && stages=(tests standard ops plain profile bench)
for stage in "${stages[@]}"; do
case $stage in
tests)
  step env
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    $PY -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,torch.cuda.get_device_name(),'python',sys.version.split()[0])"
    nproc; } 2>&1 | tee "$OUT/env.txt"
  step "extension build + backends"
  ( time timeout 300 $PY -m fedhpc.ops ) 2>&1 | tee "$OUT/ops_backend.txt"
  for t in ${TEST_FILES:-test_ops test_batched test_batched_more test_batched_distillation test_batched_personal test_batched_local_learning test_distributed test_engine}; do
    sel=(); case $t in test_distributed|test_batched|test_batched_*) sel=(-n 4);; esac  # their mpiexec launches in parallel
    step "$t ${sel[*]}"
    timeout 240 $PY -m pytest -q -p no:cacheprovider "tests/$t.py" "${sel[@]}" 2>&1 | tee "$OUT/$t.txt" | tail -12
  done
  step "GPU-only tests of other files"
  timeout 120 $PY -m pytest -q -rs -p no:cacheprovider tests/test_augment.py tests/test_fedmix.py -k gpu 2>&1 \
    | tee "$OUT/test_gpu_only.txt" | tail -12
  ;;
standard)
  step "test_algorithm_standard (every algorithm on the GPU)"
  timeout 420 $PY -m pytest -q -rf -p no:cacheprovider -n 8 tests/test_algorithm_standard.py 2>&1 \
    | tee "$OUT/test_algorithm_standard.txt" | tail -15
  ;;
kernels)  # the CUDA ops and the engine on the GPU, quickly
  ( time timeout 300 $PY -m fedhpc.ops ) 2>&1 | tee "$OUT/ops_backend.txt" | tail -3
  step test_ops; timeout 200 $PY -m pytest -q -p no:cacheprovider tests/test_ops.py 2>&1 | tee "$OUT/test_ops.txt" | tail -12
  step "test_engine gpu"; timeout 100 $PY -m pytest -q -p no:cacheprovider tests/test_engine.py -k gpu 2>&1 | tail -5
  ;;
ops)
  step bench_ops
  timeout 300 $PY benchmarks/bench_ops.py --device cuda --repeats 9 2>&1 | tee "$OUT/bench_ops_cuda.txt"
  step bench_reproducible_sum
  timeout 120 $PY benchmarks/bench_reproducible_sum.py --device cuda --sizes 1000000 11000000 --repeats 5 2>&1 \
    | tee "$OUT/bench_reproducible_sum_cuda.txt"
  ;;
plain)
  step "bench_gpu plain,seq,batched (issue 41)"
  timeout 480 $PY benchmarks/bench_gpu.py --only cnn,cnn50,lenet5 --modes plain,seq,batched --rounds "${PLAIN_ROUNDS:-15}" \
    --warmup 3 --repeats "${PLAIN_REPEATS:-2}" --json "$OUT/bench_gpu_plain.json" 2>&1 | tee "$OUT/bench_gpu_plain.txt"
  step "bench_gpu --in-process plain,seq,batched (the same ratios, rounds interleaved in one process)"
  timeout 300 $PY benchmarks/bench_gpu.py --in-process --only cnn,cnn50,cnn_bn_do,lenet5 --modes plain,seq,batched \
    --rounds "${PLAIN_ROUNDS:-15}" --warmup 3 --json "$OUT/bench_gpu_plain_inprocess.json" 2>&1 \
    | tee "$OUT/bench_gpu_plain_inprocess.txt"
  step "bench_device_training (the main job's device training, FD and Mix2FLD, against a plain loop)"
  timeout 120 $PY benchmarks/bench_device_training.py --device cuda --rounds 15 --warmup 3 \
    --json "$OUT/bench_device_training.json" 2>&1 | grep -v '^note' | tee "$OUT/bench_device_training.txt"
  step "bench_batched_families (the families opted in with issue 41, the main job among them)"
  timeout 300 $PY benchmarks/bench_batched_families.py --device cuda --rounds 10 --warmup 3 \
    --json "$OUT/bench_batched_families.json" 2>&1 | grep -v '^note' | tee "$OUT/bench_batched_families.txt"
  ;;
acceptance)
  step env
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,torch.cuda.get_device_name(),'python',sys.version.split()[0])"
  } 2>&1 | tee "$OUT/env.txt"
  step "extension build"
  ( time timeout 150 $PY -m fedhpc.ops ) 2>&1 | tee "$OUT/ops_backend.txt" | tail -4
  step "issue 42 (a'): every algorithm on CUDA against its CPU round"
  timeout 150 $PY -m pytest -q -rf -p no:cacheprovider -n 8 tests/test_algorithm_standard.py -k gpu 2>&1 \
    | tee "$OUT/test_standard_gpu.txt" | tail -8
  step "issue 41: plain, seq, batched in one process"
  timeout 120 $PY benchmarks/bench_gpu.py --in-process --only cnn,cnn50,lenet5 --modes plain,seq,batched \
    --rounds 12 --warmup 3 --json "$OUT/bench_gpu_plain_inprocess.json" 2>&1 | tee "$OUT/bench_gpu_plain_inprocess.txt" | tail -12
  step "issue 41: the main job's device training (FD, Mix2FLD) against a plain loop"
  timeout 60 $PY benchmarks/bench_device_training.py --device cuda --rounds 8 --warmup 2 \
    --json "$OUT/bench_device_training.json" 2>&1 | grep -v '^note' | tee "$OUT/bench_device_training.txt" | tail -4
  step "issue 41: the batched families"
  timeout 100 $PY benchmarks/bench_batched_families.py --device cuda --rounds 6 --warmup 2 \
    --json "$OUT/bench_batched_families.json" 2>&1 | grep -v '^note' | tee "$OUT/bench_batched_families.txt" | tail -12
  step "issue 41: the profile"
  timeout 60 $PY benchmarks/profile_round.py --device cuda --only cnn,lenet5 --rounds 2 --warmup 2 \
    --trace-dir "$OUT/traces" --json "$OUT/profile_round.json" 2>&1 | grep -v '^USDT' | tee "$OUT/profile_round.txt" | head -12
  step "issue 41: batched equality tests on CUDA"
  # -n 8: every method whose devices train is batched now (more launcher runs than the 4 workers finished in)
  timeout 120 $PY -m pytest -q -p no:cacheprovider -n 8 tests/test_batched.py tests/test_batched_more.py \
    tests/test_batched_distillation.py tests/test_batched_personal.py tests/test_batched_local_learning.py 2>&1 \
    | tee "$OUT/test_batched_gpu.txt" | tail -6
  ;;
profile)
  step "profile_round (plain, seq, batched under torch.profiler)"
  timeout 300 $PY benchmarks/profile_round.py --device cuda --only cnn,lenet5 --rounds 3 --warmup 3 \
    --trace-dir "$OUT/traces" --json "$OUT/profile_round.json" 2>&1 | grep -v '^USDT' | tee "$OUT/profile_round.txt"
  ;;
bench)
  step bench_gpu
  timeout 400 $PY benchmarks/bench_gpu.py --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.txt"
  ;;
*)
  echo "unknown stage $stage: choose from tests standard kernels ops plain profile bench acceptance all" >&2; exit 2
  ;;
esac
done
step done
