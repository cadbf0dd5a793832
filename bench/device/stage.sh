#!/usr/bin/env bash
# Stage everything a whole-service benchmark needs on the lent GPU machine, here, into .device/ (ignored):
#   bash bench/device/stage.sh [CONFIG_DIR]
# Then, while the machine stays warm (it is given back ~30 s after a call), three calls back to back:
#   1. carry [.device/a]: mkdir -p /root/stage && cp .device/a/* /root/stage/
#   2. carry [.device/b]: cp .device/b/* /root/stage/
#   3. carry [.device/c]: bash bench/device/install.sh && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
#      && <the benchmark>, e.g. bench/device/fairness.sh .device/c/cfg $OUT --rounds 5 --short-tokens 1
# A call carries at most 64 MiB: the CUDA wheel is split across a and b, PyAV and py-spy go in c.
# CONFIG_DIR (default: the demo text model's store entry) gives the SmolLM2 config and tokenizer the random
# models are built from (.device/c/cfg).
set -euo pipefail
cfg=${1:-$HOME/.cache/mlxq/models/smollm2-135m}
MLX_VERSION=${MLX_VERSION:-0.32.4} bash /work/shared/device/stage-mlx-cuda.sh $(grep -v '^#' bench/device/wheels.txt)
mkdir -p .device/c/cfg
mv .device/a/av-* .device/a/py_spy-* .device/c/
mv .device/a/mlx_vlm-* .device/a/llguidance-* .device/a/swagger_ui_bundle-* .device/a/mlx_audio-* .device/a/gevent-* .device/b/
cp "$cfg"/{config.json,tokenizer.json,tokenizer_config.json,special_tokens_map.json} .device/c/cfg/
du -sh .device/a .device/b .device/c
