#!/usr/bin/env bash
# Quantized tidal against llama.cpp's quantized server, same client, same rows, one server at a time:
# llama.cpp Q8_0 vs tidal --quantization int8, llama.cpp Q4_0 vs int4, on the tiny and small anchor models. A scheme
# is NAME or NAME:DTYPE (adds --dtype DTYPE): int8 / int4 under --dtype auto run with int8 activations (as w8a8 /
# w4a8); the default rows add them with exact activations in the dtype auto gives the dense model on this host.
#   bash benchmarks/quantized_side_by_side.sh            # needs ../shared/anchors/llama_cpp_anchor.sh run once
#   MODELS="small" PAIRS="q8_0" bash benchmarks/quantized_side_by_side.sh
#   ROWS="1:24" WARM="1:8" SCHEMES="int8 int4" bash benchmarks/quantized_side_by_side.sh   # c=1 rows, auto only
#   ROUNDS=3 MODELS=tiny ROWS="1:24" WARM="1:8" SCHEMES="int8 int4" bash ...   # the pairs three times over, alternating
# Rows and warm-up as ../shared/anchors/side_by_side.sh and llama_cpp_anchor.sh (vllm bench serve, openai-chat,
# random 128 in / 128 out, --ignore-eos). Appends JSON lines to $OUT and prints a table. Needs a quiet machine.
#   ISA=avx2 bash benchmarks/quantized_side_by_side.sh   # a CPU with AVX2 and no AVX-512, emulated on this one
# ISA=avx2 runs both as such a CPU builds and runs them: llama.cpp built with AVX2, FMA, F16C and no AVX-512 (what
# its GGML_NATIVE build gives there; $LLAMA_AVX2, built by this script once); tidal held by TIDAL_CPU_ISA=avx2
# (its kernels built and run without AVX-512, no native bf16) with torch's oneDNN, MKL and ATen held to AVX2.
# The hardware is still this CPU's (its caches, its memory): an approximation of such a host, not a measurement on one.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ANCHOR_TOOLS=${ANCHOR_TOOLS:-$HERE/../../shared/anchors}
A=${ANCHORS:-/tmp/anchors}
PY=$A/vllm-venv/bin/python
TIDAL=${TIDAL:-tidal}
LLAMA_SRC=$A/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp
LLAMA=${LLAMA:-$LLAMA_SRC/build/bin/llama-server}
OUT=${OUT:-$PWD/quantized_side_by_side.jsonl}
exact=float32; grep -q -w -E 'avx512_bf16|amx_bf16' /proc/cpuinfo && exact=bfloat16  # what auto means for bf16 models
ISA_ENV=(); held=""
if [ "${ISA:-native}" = avx2 ]; then
  LLAMA=${LLAMA_AVX2:-$LLAMA_SRC/build-avx2/bin/llama-server}
  if [ ! -x "$LLAMA" ]; then
    (cd "$LLAMA_SRC" && cmake -B build-avx2 -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON \
       -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF \
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null \
     && cmake --build build-avx2 --target llama-server -j"$(nproc)" >/dev/null) || exit 2
  fi
  exact=float32; held=@avx2
  ISA_ENV=(--env TIDAL_CPU_ISA=avx2 --env ONEDNN_MAX_CPU_ISA=AVX2 --env MKL_ENABLE_INSTRUCTIONS=AVX2
           --env ATEN_CPU_CAPABILITY=avx2)
  echo "held to AVX2 (ISA=avx2): $LLAMA; tidal with ${ISA_ENV[*]}"
fi
echo "host: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, flags: $(grep -o -w -E 'avx2|avx512f|avx512_vnni|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for round in $(seq "${ROUNDS:-1}"); do  # on a noisy host a ratio means something only across alternating rounds
for m in ${MODELS:-tiny small}; do
  if [ "$m" = tiny ]; then rows="1:48,64:256"; warm="64:128"; np=64; ctx=32768; else rows="1:8,16:64"; warm="16:32"; np=16; ctx=8192; fi
  rows=${ROWS:-$rows}; warm=${WARM:-$warm}
  for pair in ${PAIRS:-q8_0 q4_0}; do
    if [ "$pair" = q8_0 ]; then schemes="int8 int8:$exact"; else schemes="int4 int4:$exact"; fi
    "$PY" "$ANCHOR_TOOLS/side_by_side.py" --name "llama.cpp-$pair$held" --model "$A/models/$m" --port 18500 --rows "$rows" \
      --warm "$warm" --out "$OUT" --bench-python "$PY" \
      --serve "$LLAMA -m $A/gguf/$m-$pair.gguf --host 127.0.0.1 --port 18500 -c $ctx -np $np -t 2 --jinja --alias $A/models/$m"
    for q in ${SCHEMES:-$schemes}; do
      case "$pair:$q" in q8_0:*8a8*|q8_0:int8*|q4_0:*4a8*|q4_0:int4*) ;; *) continue ;; esac  # the pair's bits
      dtype=""; [ "${q#*:}" = "$q" ] || dtype="--dtype ${q#*:}"
      "$PY" "$ANCHOR_TOOLS/side_by_side.py" --name "tidal-$q$held" --model "$A/models/$m" --port 18600 --rows "$rows" \
        --warm "$warm" --out "$OUT" --bench-python "$PY" "${ISA_ENV[@]}" \
        --serve "$TIDAL serve --model $A/models/$m --served-model-name $A/models/$m --host 127.0.0.1 --port 18600 --quantization ${q%%:*} $dtype"
    done
  done
done
done
"$PY" - "$OUT" <<'PY'
import json, sys
print("| server | model | concurrency | completed | tok/s | TPOT p50 ms | TTFT p50 ms |")
print("|---|---|---:|---:|---:|---:|---:|")
for r in map(json.loads, open(sys.argv[1])):
    print(f"| {r['name']} | {r['model']} | {r['conc']} | {r['completed']}/{r['prompts']} | {r['tok_s']:.0f} | "
          f"{r['tpot_p50']:.2f} | {r['ttft_p50']:.0f} |")
PY
