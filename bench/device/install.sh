#!/usr/bin/env bash
# On the lent GPU machine, in the repository's copy: install what bench/device/stage.sh staged (calls 1 and 2
# copied their halves to /root/stage, this call carries .device/c) into /tmp/site, check the imports, build the
# Llama-1B-shaped random model at /tmp/m1b. Then: export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
set -euo pipefail
repo=$PWD
mkdir -p /root/stage && cp .device/c/*.whl /root/stage/
cd /root/stage
if ls ./*.part-aa >/dev/null 2>&1; then cat ./*.part-aa ./*.part-ab > "$(ls ./*.part-aa | sed 's/.part-aa$//')" && rm ./*.part-*; fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/stage/*.whl 2>&1 | tail -3
python3 -m zipfile -e /root/stage/mlx-0*.whl /tmp/site/  # over the mlx/ that mlx-cuda made (pip will not merge it)
cd "$repo"
export PYTHONPATH=/tmp/site:$repo PATH=/tmp/site/bin:$PATH
python3 -c "import mlx.core as mx, workers.main, web.app, mlx_lm, av, llguidance; print('imports ok', mx.default_device())"
[ -d /tmp/m1b ] || python3 bench/make_random_model.py --config-dir .device/c/cfg --out /tmp/m1b --dtype bfloat16 \
    --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 >/dev/null
