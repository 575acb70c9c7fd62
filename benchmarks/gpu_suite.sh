#!/usr/bin/env bash
# Every GPU check in one call, each step under its own time limit so one failure does
# not eat the rest (the device lease is 15 minutes, start-up included). Logs go to $OUT (or ./gpu_out).
#
#   bash benchmarks/gpu_suite.sh            # from the repository root, on a machine with CUDA
#
# 1. CUDA-graph tests (replay == eager logits; engine greedy tokens with graphs == --enforce-eager)
# 2. benchmarks/gpu_decode.py: Llama-3-8B-shaped decode step through ModelRunner, eager vs graphs,
#    against the measured bandwidth floor; the Engine's per-step overhead at batch 1/64/256
# 3. benchmarks/kernels_gpu.py: the Triton kernels' correctness and bandwidth on the GPU
# 4. tests/kernels compiled on the GPU (the conftest leaves the interpreter alone when CUDA is present)
# 5. with QUANTIZED=1: benchmarks/quantized_gpu.py (int8/int4/fp8 linears against the bandwidth
#    floor) and gpu_decode.py --quantization int4 (a decode step); QUANTIZED=only runs these alone
# Without CUDA it says so and exits 0.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TIDAL_CPU_KERNELS=0  # the session-start build of the CPU kernels (tests/conftest.py) is not needed here
PY=${PYTHON:-python3}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_suite: CUDA is not available here; nothing run." | tee "$OUT/summary.txt"
    exit 0
fi
status=0
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.txt, note the exit code
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.txt"
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || status=1
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.memory --format=csv
    $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/summary.txt"

QUANTIZED=${QUANTIZED:-0}
if [ "$QUANTIZED" != only ]; then
    step graph_tests "${T_GRAPH_TESTS:-100}" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graphs.py
    step gpu_decode "${T_GPU_DECODE:-200}" $PY benchmarks/gpu_decode.py ${GPU_DECODE_ARGS:-}
    step kernels_gpu "${T_KERNELS_GPU:-90}" $PY benchmarks/kernels_gpu.py --contexts 1024 4096 --batches 1 16 64 256 \
        --e2e-batches 1 32 128
    step kernel_tests "${T_KERNEL_TESTS:-100}" $PY -m pytest -q -p no:cacheprovider ${KERNEL_TEST_PATHS:-tests/kernels}
fi
if [ "$QUANTIZED" != 0 ]; then
    step quantized_gpu "${T_QUANTIZED_GPU:-120}" $PY benchmarks/quantized_gpu.py
    step gpu_decode_int4 "${T_GPU_DECODE_INT4:-150}" $PY benchmarks/gpu_decode.py --quantization int4 --skip-engine \
        --skip-torch-layers --batches 1 8 64
fi
exit $status
