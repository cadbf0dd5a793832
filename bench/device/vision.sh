#!/usr/bin/env bash
# The vision benchmark on the lent GPU machine: random bf16 weights in SmolVLM-500M's shape.
#   [TILES=1] bench/device/vision.sh TEMPLATE_DIR OUT_DIR [bench_vision.py options...]   (e.g. --concurrency 1,8,32)
# TEMPLATE_DIR holds the toy VLM's config, tokenizer and processor files (its weights are not needed).
set -euo pipefail
tpl=$1; out=$2; shift 2
trap 'cp /tmp/mlxq-bench-*.log "$out"/ 2>/dev/null || true' EXIT  # the servers' logs, for a failed run
py=${PYTHON:-python3}
if [ "${TILES:-0}" = 1 ]; then  # a photo-sized picture, split as SmolVLM's processors do: 12 tiles + the whole, 832 image tokens
    "$py" bench/make_random_vlm.py --template "$tpl" --out /tmp/smolvlm500m --tiles >/dev/null
    size=1536,1024
else  # a held-out shapes picture at the model's own resolution: one 512x512 image, 64 image tokens
    "$py" bench/make_random_vlm.py --template "$tpl" --out /tmp/smolvlm500m >/dev/null
    size=512,512
fi
"$py" -c "from workers.demo import shapes; shapes.samples(4242, 1)[0].image.resize(($size)).save('/tmp/picture.png')"
"$py" bench/bench_vision.py --model /tmp/smolvlm500m --image /tmp/picture.png --out "$out/vision-smolvlm500m.json" \
    "$@" > /dev/null
"$py" -c "
import json, sys
r = json.load(open(sys.argv[1]))
if 'concurrency' in r or 'request_speed_vs_direct' not in r:
    sys.exit()  # --concurrency or --requests 0: bench_vision.py printed its tables (on stderr)
for name in [n for n in ('direct', 'direct_other_process', 'mlxq', 'mlx_vlm_server') if n in r]:
    print(name, 'request_s', {k: round(v, 4) for k, v in r[name]['request_s'].items()},
          'decode_tps', {k: round(v, 1) for k, v in r[name]['decode_tps'].items()})
print('request speed vs direct', r['request_speed_vs_direct'])
print('decode vs direct', r['decode_vs_direct'])" "$out/vision-smolvlm500m.json"
