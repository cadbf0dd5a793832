#!/usr/bin/env bash
# On the lent GPU machine (after install.sh): a MiniLM-shaped embedding model with random weights (no hub there),
# imported into a store of its own, then bench_embeddings from outside the repository.
#   bench/device/embeddings.sh CONFIG_DIR OUT_DIR [bench_embeddings options...]
# CONFIG_DIR: the small files of a sentence-transformers folder (stage.sh's caller copies minilm-l6's).
set -euo pipefail
cfg=$1 out=$2
shift 2
repo=$PWD
[ -f /tmp/minilm/model.safetensors ] || python3 bench/make_random_encoder.py --config-dir "$cfg" --out /tmp/minilm
[ -f /tmp/emb-store/minilm-l6/mlxq.json ] || MLXQ_MODELS_DIR=/tmp/emb-store python3 -m mlxq.cli models \
    import-sentence-transformers /tmp/minilm --name minilm-l6
cd /tmp && python3 "$repo/bench/bench_embeddings.py" --store /tmp/emb-store --out "$out/embeddings.json" "$@"
