#!/usr/bin/env bash
# Served c=1 A/B of one engine environment switch: one streamed completion at a time, servers alternating.
#
#   SWITCH=TIDAL_CPU_HUGE_PAGES=0 MODEL=/tmp/anchors/models/small ROUNDS=2 bash benchmarks/stream_ab.sh
#
# Each round starts `tidal serve --model MODEL` twice, once as is and once with SWITCH in its environment;
# each server gets a 100-token warm-up, then STREAMS (2) `curl -N` streams of TOKENS (1000) tokens on
# /v1/completions with "ignore_eos": true, one after another. Prints each stream's TPOT (wall time over
# tokens) and the frontend process's CPU per token. docs/performance-history.md quotes it for the huge pages and
# the decoder stack (TIDAL_CPU_STACK=0).
set -u
SWITCH=${SWITCH:?SWITCH=NAME=VALUE, the environment of the B servers}
MODEL=${MODEL:?MODEL=a model directory}
PORT=${PORT:-18300}
body() { echo "{\"model\":\"$MODEL\",\"prompt\":\"hello there\",\"max_tokens\":$1,\"ignore_eos\":true,\"stream\":true}"; }
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
echo "host flags: $(grep -o -w -E 'avx2|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for round in $(seq "${ROUNDS:-2}"); do
    for side in A B; do
        log=$(mktemp)
        if [ $side = A ]; then tidal serve --model "$MODEL" --port "$PORT" > "$log" 2>&1 &
        else env "$SWITCH" tidal serve --model "$MODEL" --port "$PORT" > "$log" 2>&1 & fi
        server=$!
        for _ in $(seq 240); do grep -q "tidal ready" "$log" && break; sleep 0.5; done
        curl -sN "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' -d "$(body 100)" > /dev/null
        for _ in $(seq "${STREAMS:-2}"); do
            c0=$(cpu $server); t0=$(date +%s.%N)
            curl -sN "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
                -d "$(body "${TOKENS:-1000}")" > /dev/null
            t1=$(date +%s.%N); c1=$(cpu $server)
            python3 -c "n=${TOKENS:-1000}; print(f'round $round $side: TPOT {($t1-$t0)/n*1e3:.2f} ms, frontend {($c1-$c0)/$(getconf CLK_TCK)/n*1e6:.0f} us/token')"
        done
        kill $server; wait $server 2>/dev/null; rm -f "$log"; sleep 2
    done
done
