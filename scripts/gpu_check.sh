#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU where torch, triton and pytest (and, for the
# kernel bench's plots, matplotlib) are installed and nothing can be downloaded. Each step is bounded in time (about 14 minutes in all); a
# summary goes to $OUT/summary.txt when OUT is set (else /tmp/nano_spec_gpu_check) and
# to stdout, each step's whole output to its NAME.log beside it.
#   1. the kernel tests, compiled (not interpreted), and the model on the triton backend
#   2. the lossless tests on CUDA (the engine picks the triton backend there)
#   3. the kernel bench, full sweep: every kernel beside its reference, torch.compile and the installed
#      baselines; time, CUDA-graph time, GB/s, % of peak; kernel_bench/<kernel>.csv and .png (each kernel's
#      as soon as it is done, so a step that runs out of time keeps the kernels it finished)
#   4. the roofline on paper (no kernel runs): predicted kernel and step times, the speedup they imply
#   5. the end-to-end bench on the shipped weights, to hold against 4's "shipped" tokens/s
#   6. the compiled step captured as CUDA graphs (LLM(compile=True)), its outputs checked against eager plain
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"  # nano_spec and nano_spec_kernels, installed or not
unset TRITON_INTERPRET
dir="${OUT:-/tmp/nano_spec_gpu_check}"
mkdir -p "$dir"
summary="$dir/summary.txt"
: > "$summary"

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$dir/$name.log" 2>&1
  rc=$?
  {
    echo "== $name: exit $rc in $(( $(date +%s) - start )) s (limit $limit s): $*"
    tail -n "${TAIL:-45}" "$dir/$name.log"
    echo
  } | tee -a "$summary"
}

python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$summary"
step kernel_tests 170 python -m pytest -q -x tests/test_kernels_mamba.py tests/test_kernels_attention.py \
  tests/test_kernels_verdict.py tests/test_triton_backend.py
step lossless 120 python -m pytest -q -x tests/test_engine.py -k "lossless or batch_invariance or admission"
step kernel_bench 360 python -m nano_spec_kernels.bench --out "$dir/kernel_bench"
TAIL=100 step predict 30 python -m nano_spec_kernels.bench --predict --model shipped 350m 1b
step e2e_bench 100 python -m nano_spec.bench --num-prompts 8 --max-new-tokens 48 --batch 1 8 --gammas 3 --dflash-gammas 3
step compiled 90 python -m nano_spec.bench --compile --num-prompts 4 --max-new-tokens 32 --batch 1 4 --gammas 3 \
  --no-ngram --no-dflash --no-auto
