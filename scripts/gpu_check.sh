#!/usr/bin/env bash
# One command on a machine with a GPU: install what is missing from carried wheels, run the GPU tests,
# then short GPU benchmarks, the GPT step against PyTorch and a time-boxed GPT run; every figure
# goes into one JSON file. Sized for 8 minutes: the steps' timeouts add up to 450 s (tests 100,
# profile 45, ring 30, step 30, all-reduces 25 + 25, 4-rank training 40, GPT step benchmark 155),
# and the time-boxed GPT run gets what is left of 470 s, at most 120 s (none under 30 s).
#
#   bash scripts/gpu_check.sh [OUT.json]        (wheels: .whl/ or $MINIMP_WHEELS; mpich + mpi4py)
#
# $PYTHON is the interpreter (default: python3 from PATH); a venv's, unactivated, works too, e.g.
# PYTHON=.venv/bin/python bash scripts/gpu_check.sh (the tests pass their own), and the mpirun
# next to it comes first on PATH.
#
# The machine needs CuPy, NumPy, ml_dtypes, threadpoolctl and pytest; only MPI is installed here, from
# the wheels, because a GPU machine without a registry rarely has an mpirun.
set -u
cd "$(dirname "$0")/.."
OUT_JSON=${1:-gpu_check.json}
WHEELS=${MINIMP_WHEELS:-.whl}
PY=${PYTHON:-python3}
LOGS=${MINIMP_GPU_LOGS:-$(mktemp -d)}
mkdir -p "$LOGS"
ERRORS=$LOGS/errors.txt
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*"; }

# No GPU, no run: one line saying why, before anything is installed or started.
check_gpu="from minimp import backend
try:
    backend.check_device('gpu')
except backend.DeviceError as error:
    raise SystemExit(str(error))"
if ! problem=$($PY -c "$check_gpu" 2>&1); then
  echo "gpu_check: ${problem##*$'\n'}" >&2
  exit 2
fi

PATH=$(dirname "$($PY -c 'import sys; print(sys.executable)')"):$PATH
if ! (command -v mpirun >/dev/null 2>&1 && $PY -c "from mpi4py import MPI" >/dev/null 2>&1); then
  stamp "installing MPI from $WHEELS"
  $PY -m pip install -q --no-index --no-deps --no-compile --prefix /tmp/minimp-mpi "$WHEELS"/*.whl || exit 1
  export PATH=/tmp/minimp-mpi/bin:$PATH LD_LIBRARY_PATH=/tmp/minimp-mpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONPATH=$(echo /tmp/minimp-mpi/lib/python3*/site-packages):$PYTHONPATH
  export MPI4PY_LIBMPI=/tmp/minimp-mpi/lib/libmpi.so.12
fi
export MPIEXEC_ALLOW_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

stamp "GPU tests"
timeout 100 $PY -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_staging.py \
  tests/test_gpu_gpt_bench.py -p no:cacheprovider -rs >"$LOGS/tests.txt" 2>&1
echo "exit $?" >>"$LOGS/tests.txt"
tail -5 "$LOGS/tests.txt"

# Where the fp16 step goes (its GEMMs alone through cuBLAS, phases, host time, the optimizer's
# update); then the ring staged once per collective against the ring staged per message and MPI
# on host copies.
stamp "profile of the fp16 step"
timeout 45 $PY benchmarks/gpu_step_profile.py --batch 4096 --width 4096 --layers 4 --repeats 10 \
  --save "$LOGS/profile.json" 2>>"$ERRORS" || tail -5 "$ERRORS"
stamp "ring staged once per collective, 2 ranks"
timeout 30 mpirun -n 2 $PY benchmarks/gpu_ring_bench.py --max-mib 64 --repeats 5 \
  --save "$LOGS/ring2.json" 2>>"$ERRORS" || tail -5 "$ERRORS"

stamp "fp16 vs fp32 training step"
timeout 30 $PY benchmarks/step_bench.py --device gpu --batch 4096 --width 4096 --layers 4 \
  --repeats 10 --json >"$LOGS/step.json" 2>>"$ERRORS" || tail -5 "$ERRORS"

for ranks in 2 4; do
  stamp "ring all-reduce on device arrays, $ranks ranks"
  timeout 25 mpirun -n $ranks $PY mpirun_examples/allreduce_bench.py --device gpu --max-mib 64 \
    --repeats 5 --json >"$LOGS/allreduce$ranks.json" 2>>"$ERRORS" || tail -5 "$ERRORS"
done

stamp "4-rank data-parallel training on the GPU"
timeout 40 mpirun -n 4 $PY -m minimp.train --device gpu --steps 300 --log-every 100 \
  --metrics "$LOGS/train.jsonl" >"$LOGS/train.txt" 2>&1 || tail -5 "$LOGS/train.txt"
tail -3 "$LOGS/train.txt"

# nanoGPT's GPU config of shakespeare_char (6 blocks, 6 heads, width 384, context 256, batch 64,
# dropout 0.2): one training step in minimp fp32/fp16/bf16 and PyTorch eager fp32/AMP/SDPA, in
# alternating blocks, tokens/s, the step against its GEMMs alone and the peak memory of each.
stamp "GPT step, minimp against PyTorch eager, nanoGPT's GPU config"
timeout 155 $PY benchmarks/gpu_gpt_bench.py --max-seconds 100 --save "$LOGS/gpt_bench.json" \
  2>>"$ERRORS" || tail -5 "$ERRORS"

# The same config trained in fp16, time-boxed: the validation loss every 250 steps and the step
# rate give the loss reached and the projected time of all 5,000 steps.
gpt_seconds=$(( 470 - ($(date +%s) - start) ))
gpt_seconds=$(( gpt_seconds > 120 ? 120 : gpt_seconds ))
if (( gpt_seconds < 30 )); then
  stamp "GPT training skipped: $gpt_seconds s left of the 8 minutes"
else
  stamp "GPT, nanoGPT's GPU config, fp16, at most $gpt_seconds s"
  timeout $gpt_seconds $PY -m minimp.train --device gpu --dataset shakespeare --layers 6 \
    --heads 6 --hidden 384 --context 256 --batch-size 64 --dropout 0.2 --steps 5000 \
    --eval-every 250 --eval-batches 4 --log-every 250 --metrics "$LOGS/gpt.jsonl" \
    >"$LOGS/gpt.txt" 2>&1
  tail -3 "$LOGS/gpt.txt"
fi

stamp "writing $OUT_JSON"
$PY scripts/gpu_report.py "$LOGS" "$OUT_JSON"
stamp "done"
