#!/usr/bin/env bash
# bench_gpus.py on the lent two-GPU machine (kind nvidia-h100-x2), one worker per GPU: 64 chats on one worker against
# two (the Llama-1B shape, random bf16 weights), 30-minute transcriptions on both, and a worker killed mid-load.
#   bench/device/gpus.sh CONFIG_DIR MODEL_PARTS_DIR VAD_DIR OUT_DIR [bench_gpus.py options...]
# CONFIG_DIR holds a SmolLM2 config.json and its tokenizer files (.device/c/cfg, from bench/device/stage.sh);
# MODEL_PARTS_DIR the whisper-tiny.en store entry with model.safetensors split into model.safetensors.part-* and
# VAD_DIR the silero-vad downloads entry, as for speech.sh. Stage as stage.sh says, adding onnxruntime (the VAD's),
# and run bench/device/install.sh first (in the same call, or in an earlier one while the machine stays warm: a call
# stops at 10 minutes). Sizes are picked to end within ~9 minutes there (estimated, not yet run: 2 rounds per setup
# and workload, 8 jobs of 30 minutes, 2 in the kill, one per worker, the survivor then finishing both; no wait for a
# job or call longer than 420 s); options after OUT_DIR come later on the command line and win. The report is
# OUT_DIR/gpus.json (gpus.partial.json holds the parts done so far, should the call run out of time), the servers'
# logs are copied beside it.
set -euo pipefail
cfg=$1; parts=$2; vad=$3; out=$4; shift 4
trap 'cp /tmp/mlxq-bench-*.log "$out"/ 2>/dev/null || true' EXIT  # the servers' logs, for a failed run
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
py=${PYTHON:-python3}
nvidia-smi -L || true
source "$(dirname "$0")/whisper_store.sh"
whisper_store "$parts"
cp -r "$vad" "$home/downloads/"
SECONDS=0
[ -d /tmp/m1b ] || "$py" bench/make_random_model.py --config-dir "$cfg" --out /tmp/m1b --dtype bfloat16 \
    --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 >/dev/null
echo "the 1B-shape model: ${SECONDS}s"
# Progress lines (stderr) come here as the parts run; the JSON report and its summary go to gpus.stdout.
rc=0
"$py" bench/bench_gpus.py --model /tmp/m1b --speech-model whisper-tiny.en --gpus "${GPUS:-0,1}" --rounds 2 \
    --chats 64 --audio-minutes 30 --jobs 8 --kill-jobs 2 --wait-s 420 --out "$out/gpus.json" "$@" \
    > "$out/gpus.stdout" || rc=$?
report=$out/gpus.json
[ -f "$report" ] || report=$out/gpus.partial.json
if [ -f "$report" ]; then
    "$py" -c "import json, sys; from bench.bench_gpus import summary; print(summary(json.load(open(sys.argv[1]))))" \
        "$report"
fi
echo "gpus.sh: ${SECONDS}s in all, bench exit code $rc"
exit $rc
