#!/usr/bin/env bash
# The diarization benchmark on the lent GPU machine (no hub, no registry there).
#   bench/device/diarization.sh WHISPER_DIR DOWNLOADS_DIR OUT_DIR [bench_diarization.py options...]
# WHISPER_DIR holds the whisper-tiny.en store entry with model.safetensors split into model.safetensors.part-*
# (one call carries at most 64 MiB); DOWNLOADS_DIR the silero-vad wheel's downloads entry and
# resemblyzer-0.1.4-ge2e.safetensors (as `mlxq models pull-demo` leaves them in ~/.cache/mlxq/downloads).
set -euo pipefail
parts=$1; downloads=$2; out=$3; shift 3
trap 'cp /tmp/mlxq-bench-*.log "$out"/ 2>/dev/null || true' EXIT  # the servers' logs, for a failed run
source "$(dirname "$0")/whisper_store.sh"
whisper_store "$parts"
cp -r "$downloads"/* "$home/downloads/"
MLXQ_DEFAULT_MODEL=whisper-tiny.en "${PYTHON:-python3}" bench/bench_diarization.py --out "$out/diarization.json" "$@" \
    > "$out/diarization.log" 2>&1 || { tail -40 "$out/diarization.log"; exit 1; }
"${PYTHON:-python3}" - "$out/diarization.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("plain", r["plain"]["median_wall_s"], "diarized", r["diarized"]["median_wall_s"],
      "ratio", r["diarized_over_plain_wall"], "agreement", [x.get("agreement") for x in r["diarized"]["runs"]])
print("memory", r.get("memory"))
PY
