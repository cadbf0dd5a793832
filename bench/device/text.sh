#!/usr/bin/env bash
# The text benchmark on the lent GPU machine (no hub there): random weights in two real shapes.
#   bench/device/text.sh CONFIG_DIR OUT_DIR [bench_text.py options...]
# CONFIG_DIR holds a SmolLM2 config.json and its tokenizer files (e.g. the demo model's store entry).
set -euo pipefail
cfg=$1; out=$2; shift 2
trap 'cp /tmp/mlxq-bench-*.log "$out"/ 2>/dev/null || true' EXIT  # the servers' logs, for a failed run
"${PYTHON:-python3}" bench/make_random_model.py --config-dir "$cfg" --out /tmp/m135 --dtype bfloat16 >/dev/null
"${PYTHON:-python3}" bench/make_random_model.py --config-dir "$cfg" --out /tmp/m1b --dtype bfloat16 \
    --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 >/dev/null
for m in m135 m1b; do
    "${PYTHON:-python3}" bench/bench_text.py --model /tmp/$m --out "$out/text-$m.json" "$@" > /dev/null
    "${PYTHON:-python3}" -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1], json.dumps(r['added_latency_ms']), json.dumps(r['decode_ratio_vs_direct']))" "$out/text-$m.json"
done
