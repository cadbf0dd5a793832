# Sourced by the speech benches on the lent GPU machine (bench/device/speech.sh, diarization.sh):
#   whisper_store PARTS_DIR   puts the whisper-tiny.en store entry whose model.safetensors is split into
#                             model.safetensors.part-* (one call carries at most 64 MiB) into the store;
# and leaves $home (the mlxq cache) with models/ and downloads/ made.
home=${XDG_CACHE_HOME:-$HOME/.cache}/mlxq
mkdir -p "$home/models/whisper-tiny.en" "$home/downloads"

whisper_store() {
    local parts=$1 f
    for f in "$parts"/*; do
        case "$f" in *.part-*) ;; *) cp "$f" "$home/models/whisper-tiny.en/" ;; esac
    done
    cat "$parts"/model.safetensors.part-* > "$home/models/whisper-tiny.en/model.safetensors"
}
