#!/bin/bash
# QLLM layer preemption's start-up cost: seconds from process start to /health 200 for
# `jaxmoe serve --model demo`, the default (layer preemption on) vs --no-layer-preemption,
# alternating, each with an empty compilation cache; after ready one best-effort request runs
# (layer by layer where preemption is on) and /metrics' jaxmoe_compiles_after_warmup is printed.
# Usage: bench/qllm_startup.sh [ROUNDS]   (run from the repository root; default 2 rounds)
rounds=${1:-2}
jaxmoe=${JAXMOE:-.venv/bin/jaxmoe}
for ((r = 1; r <= rounds; r++)); do
  for flags in "" "--no-layer-preemption"; do
    d=$(mktemp -d); port=$((18000 + RANDOM % 1000))
    start=$(date +%s.%N)
    JAX_COMPILATION_CACHE_DIR=$d JAXMOE_COMPILATION_CACHE=$d $jaxmoe serve --model demo --port $port --grpc-port 0 $flags > $d/log 2>&1 &
    pid=$!
    until curl -sf localhost:$port/health >/dev/null; do
      kill -0 $pid 2>/dev/null || { echo "serve exited:"; tail -5 $d/log; exit 1; }
      sleep 0.2
    done
    end=$(date +%s.%N)
    curl -sf localhost:$port/v1/completions -H 'Content-Type: application/json' \
      -d '{"prompt": "Hello there", "max_tokens": 8, "priority": "be"}' >/dev/null
    late=$(curl -sf localhost:$port/metrics | awk '/^jaxmoe_compiles_after_warmup/ {print $2}')
    echo "round=$r flags='$flags' ready_s=$(echo "$end - $start" | bc) compiles_after_ready=$late load=$(cut -d' ' -f1-3 /proc/loadavg)"
    kill -TERM $pid; wait $pid 2>/dev/null; rm -rf $d
  done
done
