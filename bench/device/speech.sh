#!/usr/bin/env bash
# The speech benchmark on the lent GPU machine (no hub, no registry there).
#   bench/device/speech.sh MODEL_PARTS_DIR VAD_DIR OUT_DIR [bench_speech.py options...]
# MODEL_PARTS_DIR holds the whisper-tiny.en store entry with model.safetensors split into
# model.safetensors.part-* (one call carries at most 64 MiB); VAD_DIR the downloads entry of the
# silero-vad wheel (as `mlxq models pull-demo` / the first VAD run leaves it here).
set -euo pipefail
parts=$1; vad=$2; out=$3; shift 3
trap 'cp /tmp/mlxq-bench-*.log "$out"/ 2>/dev/null || true' EXIT  # the servers' logs, for a failed run
source "$(dirname "$0")/whisper_store.sh"
whisper_store "$parts"
cp -r "$vad" "$home/downloads/"
MLXQ_DEFAULT_MODEL=whisper-tiny.en "${PYTHON:-python3}" bench/bench_speech.py --chat-k 0 --out "$out/speech.json" "$@" \
    > "$out/speech.log" 2>&1 || { tail -40 "$out/speech.log"; exit 1; }
"${PYTHON:-python3}" - "$out/speech.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for name in ("batched", "sequential", "direct"):
    if r.get(name):
        print(name, "rtf", r[name]["rtf"], "runs", r[name].get("rtf_runs"), "wer", r[name]["wer"])
print("ratios", r["ratios"], "memory growth MiB", r["memory"]["peak_growth_mib"])
PY
