#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU where torch, triton and pytest (and, for the
# kernel bench's plots, matplotlib) are installed and nothing can be downloaded. In two parts, each
# bounded to fit one 10-minute call:  bash scripts/gpu_check.sh kernels|engine|all  (default all).
# A summary goes to $OUT/summary.txt when OUT is set (else /tmp/nano_spec_gpu_check) and to stdout,
# each step's whole output to its NAME.log beside it.
#   kernels (about 9 minutes):
#     1. the kernel tests, compiled (not interpreted), and the model on the triton backend
#     2. the kernel bench, full sweep: every kernel beside its reference, torch.compile and the installed
#        baselines; time, CUDA-graph time, GB/s, % of peak; kernel_bench/<kernel>.csv and .png (each kernel's
#        as soon as it is done, so a step that runs out of time keeps the kernels it finished)
#     3. the roofline on paper (no kernel runs): predicted kernel and step times, the speedup they imply
#   engine (about 8 minutes):
#     4. the lossless tests on CUDA (the engine picks the triton backend there)
#     5. the step as one CUDA graph against the eager step (scripts/graph_check.py): identity, tokens/s,
#        the step's time beside the sum of its kernels' times
#     6. the end-to-end bench on the shipped weights, eager and graph, to hold against 3's "shipped" tokens/s
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

part=${1:-all}
case $part in kernels|engine|all) ;; *) echo "usage: $0 [kernels|engine|all]" >&2; exit 2 ;; esac
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$summary"
if [ "$part" != engine ]; then
  step kernel_tests 170 python -m pytest -q -x tests/test_kernels_mamba.py tests/test_kernels_attention.py \
    tests/test_kernels_verdict.py tests/test_triton_backend.py
  step kernel_bench 330 python -m nano_spec_kernels.bench --out "$dir/kernel_bench"
  TAIL=100 step predict 30 python -m nano_spec_kernels.bench --predict --model shipped 350m 1b
fi
if [ "$part" != kernels ]; then
  step lossless 120 python -m pytest -q -x tests/test_engine.py tests/test_compiled.py -k "lossless or batch_invariance or admission or capture"
  step graph 200 python scripts/graph_check.py --configs none:0 mtp:3 ngram:3 --batch 1 8 --prompts 8 --max-new-tokens 48
  step e2e_bench 120 python -m nano_spec.bench --compile --num-prompts 8 --max-new-tokens 48 --batch 1 8 --gammas 3 \
    --dflash-gammas 3
fi
