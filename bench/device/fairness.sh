#!/usr/bin/env bash
# The fairness benchmark on the lent GPU machine: random bf16 weights in the Llama-1B shape.
#   bench/device/fairness.sh CONFIG_DIR OUT_DIR [bench_fairness.py options...]
# CONFIG_DIR holds a SmolLM2 config.json and its tokenizer files (e.g. the demo model's store entry).
set -euo pipefail
cfg=$1; out=$2; shift 2
name=${FAIRNESS_NAME:-fairness-m1b}  # the report's file name in OUT_DIR (several runs in one call)
trap 'cp /tmp/mlxq-bench-*.log "$out"/ 2>/dev/null || true' EXIT  # the servers' logs, for a failed run
[ -d /tmp/m1b ] || "${PYTHON:-python3}" bench/make_random_model.py --config-dir "$cfg" --out /tmp/m1b --dtype bfloat16 \
    --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 >/dev/null
"${PYTHON:-python3}" bench/bench_fairness.py --model /tmp/m1b --out "$out/$name.json" "$@" > /dev/null
"${PYTHON:-python3}" -c "
import json, sys
r = json.load(open(sys.argv[1]))
print('chunk', {k: round(v, 4) for k, v in r['chunk'].items()})
print('idle', [{k: round(v, 3) for k, v in b.items()} for b in r['idle']['blocks']], 'spread', {k: round(v, 2) for k, v in r['idle']['spread'].items()})
for name in ('two_long_prompts', 'completions_32x2'):
    print(name, {k: {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()} for k, v in r[name]['verdict'].items()})
    for run in r[name]['runs']:
        print('   ', {k: (round(v, 3) if isinstance(v, float) else v) for k, v in run.items() if k != 'ended_at'})
print('big request alone', {k: v for k, v in r.items() if k.startswith('big_request')})" "$out/$name.json"
