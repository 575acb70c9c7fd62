#!/usr/bin/env bash
# The side-by-side table against vLLM-CPU in rounds, with the host's read bandwidth measured in the same run.
#
#   bash benchmarks/vs_vllm.sh                      # side_by_side.sh's rows: vLLM bf16 against tidal's defaults
#   ROUNDS=3 MODELS=small bash benchmarks/vs_vllm.sh
#   ISA=avx2 bash benchmarks/vs_vllm.sh             # a CPU without native bf16, emulated on this one (below)
#
# side_by_side.sh (../shared/anchors, after bench_vllm_cpu.sh) runs each server once. On a shared host one
# run can differ from the next by 10-20% for either server, so this runs ROUNDS rounds, each round vLLM then
# tidal back to back per model, and appends every row to $OUT (JSON lines from side_by_side.py). Before and
# after each model's round it prints the host's read bandwidth (the fastest of five sums over a 1 GiB float32
# tensor on every core, in torch's 4 KiB pages and again in 2 MiB pages, where tidal keeps its weights: the
# weight-read floor of a decode step is the weights' bytes over this rate) and the
# load average. Summarise with `python benchmarks/vs_vllm_table.py $OUT`.
#
# ISA=avx2 holds oneDNN, MKL and ATen to AVX2 in both servers (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS,
# ATEN_CPU_CAPABILITY), runs vLLM in float32 (its best setting without native bf16: its bf16 is emulated
# there) and holds tidal to what it builds and runs on such a CPU (TIDAL_CPU_ISA=avx2: its kernels built
# without AVX-512, and `--dtype auto` then takes float32 arithmetic on bf16-stored linear weights). vLLM's own
# compiled ops keep the build's ISA, so this approximates, not reproduces, such a host.
set -u
ANCHORS=${ANCHORS:-/tmp/anchors}
SHARED=${SHARED:-$(cd "$(dirname "$0")/../../shared/anchors" 2>/dev/null && pwd)}
PY=$ANCHORS/vllm-venv/bin/python
OUT=${OUT:-$PWD/vs_vllm.jsonl}
ROUNDS=${ROUNDS:-1}
MODELS=${MODELS:-tiny small}
TCM=$ANCHORS/sysroot/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
IOMP=$ANCHORS/vllm-venv/lib/libiomp5.so
if [ ! -x "$PY" ] || [ ! -f "$SHARED/side_by_side.py" ]; then
    echo "vs_vllm: needs $PY and side_by_side.py (run ../shared/anchors/bench_vllm_cpu.sh first)" >&2
    exit 2
fi
VLLM_DTYPE=bfloat16; ISA_ENV=(); TIDAL_ENV=()
if [ "${ISA:-native}" = avx2 ]; then
    VLLM_DTYPE=float32
    ISA_ENV=(--env ONEDNN_MAX_CPU_ISA=AVX2 --env MKL_ENABLE_INSTRUCTIONS=AVX2 --env ATEN_CPU_CAPABILITY=avx2)
    TIDAL_ENV=(--env TIDAL_CPU_ISA=avx2)
fi
host() {
    echo "host: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, flags: $(grep -o -w -E 'avx2|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
}
bandwidth() {
    python3 - <<'EOF'
import os, time, torch
from tidal.gpu import huge_pages
def rate(data):
    best = min((lambda t: (data.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
    return data.numel() * 4 / best / 1e9
plain = rate(torch.ones((1 << 30) // 4))
huge = rate(huge_pages.huge_page_bytes(1 << 30).view(torch.float32).fill_(1))
print(f"read bandwidth {plain:.1f} GB/s ({huge:.1f} from 2 MiB pages; {torch.get_num_threads()} threads), "
      f"load average {os.getloadavg()[0]:.2f}", flush=True)
EOF
}
host
for round in $(seq "$ROUNDS"); do
    for m in $MODELS; do
        if [ "$m" = tiny ]; then rows="1:48,64:256"; warm="64:128"; else rows="1:8,16:64"; warm="16:32"; fi
        echo "round $round, $m: $(date -u +%H:%M:%S) UTC, $(bandwidth)"
        $PY "$SHARED/side_by_side.py" --name "vllm-$VLLM_DTYPE" --model "$ANCHORS/models/$m" --port 18100 \
            --rows "$rows" --warm "$warm" --out "$OUT" --bench-python "$PY" "${ISA_ENV[@]}" \
            --env LD_PRELOAD=$TCM:$IOMP --env VLLM_CPU_KVCACHE_SPACE=4 --env VLLM_CPU_OMP_THREADS_BIND=0-1 \
            --serve "$PY $SHARED/vllm_cli.py serve $ANCHORS/models/$m --host 127.0.0.1 --port 18100 --dtype $VLLM_DTYPE --max-model-len 2048"
        $PY "$SHARED/side_by_side.py" --name tidal --model "$ANCHORS/models/$m" --port 18200 \
            --rows "$rows" --warm "$warm" --out "$OUT" --bench-python "$PY" "${ISA_ENV[@]}" "${TIDAL_ENV[@]}" \
            --serve "tidal serve --model $ANCHORS/models/$m --served-model-name $ANCHORS/models/$m --host 127.0.0.1 --port 18200"
        echo "round $round, $m done: $(date -u +%H:%M:%S) UTC, $(bandwidth)"
    done
done
