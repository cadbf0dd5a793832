#!/usr/bin/env bash
# The concurrency benchmark on the lent GPU machine: random bf16 weights in the Llama-1B shape.
#   bench/device/concurrency.sh CONFIG_DIR OUT_DIR [bench_concurrency.py options...]
# CONFIG_DIR holds a SmolLM2 config.json and its tokenizer files (e.g. the demo model's store entry).
set -euo pipefail
cfg=$1; out=$2; shift 2
trap 'cp /tmp/mlxq-bench-*.log "$out"/ 2>/dev/null || true' EXIT  # the servers' logs, for a failed run
"${PYTHON:-python3}" bench/make_random_model.py --config-dir "$cfg" --out /tmp/m1b --dtype bfloat16 \
    --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 >/dev/null
"${PYTHON:-python3}" bench/bench_concurrency.py --model /tmp/m1b --out "$out/concurrency-m1b.json" "$@" > /dev/null
"${PYTHON:-python3}" -c "import json, sys; from bench.bench_concurrency import summary; print(summary(json.load(open(sys.argv[1]))))" \
    "$out/concurrency-m1b.json"
