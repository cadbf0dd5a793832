"""Pick the fastest way to run MLX on this machine, by measurement: BLAS library and model dtype.

On Linux CPUs the `mlx[cpu]` wheel links a reference BLAS that is ~30x slower than OpenBLAS for the
matmuls prompt processing is made of. We time a matmul in a subprocess without and with each
installed OpenBLAS preloaded, cache the winner per machine and MLX version, and the worker re-execs
itself with it in LD_PRELOAD (a BLAS cannot be swapped once libmlx is loaded).

An OpenBLAS older than the CPU falls back to its slowest kernels (Debian 12's 0.3.21 takes a Sapphire
Rapids Xeon for a Prescott: 26 ms for that matmul, 5-6 ms as a Cooperlake), so each one is also timed
with OPENBLAS_CORETYPE set to each kernel set the CPU's flags allow; the winner's travels with it.

On CPU, quantized matmuls never reach BLAS, so with a fast BLAS small models run faster dequantized
to float32 (see `float32_max_mb`). On Metal and CUDA models are kept exactly as stored.
"""

from __future__ import annotations

import json
import logging
import os
import platform as _platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

BLAS_ENV = "MLXQ_BLAS"
"""auto (default: measure, cached), none (never preload) or the path of a BLAS library to preload."""

FLOAT32_MAX_ENV = "MLXQ_CPU_FLOAT32_MAX_MB"
"""On CPU with a fast BLAS, models whose float32 weights are at most this many MiB run in float32."""

DEFAULT_FLOAT32_MAX_MB = 1024
"""Measured default (see the module docstring and docs): 1 GiB of float32 is a ~250M-parameter model."""

_REEXEC_MARK = "MLXQ_BLAS_REEXEC"
_SPEEDUP_NEEDED = 0.8  # a candidate must beat the bundled BLAS by 20% to be worth a re-exec

CORETYPE_ENV = "OPENBLAS_CORETYPE"
"""OpenBLAS's own override of its CPU detection; an operator's value is kept and timed alone."""

# x86 OpenBLAS kernel sets worth timing, by the CPU flag they need (newest first).
_CORETYPES_BY_FLAG = (("avx512_bf16", "Cooperlake"), ("avx512f", "SkylakeX"), ("avx2", "Haswell"))

_MULTIARCH = f"{_platform.machine()}-linux-gnu"
BLAS_CANDIDATES = (
    f"/usr/lib/{_MULTIARCH}/openblas-pthread/libblas.so.3",  # Debian/Ubuntu libopenblas0-pthread
    f"/usr/lib/{_MULTIARCH}/openblas-pthread/libopenblas.so.0",
    f"/usr/lib/{_MULTIARCH}/libopenblas.so.0",  # Debian/Ubuntu alternatives
    f"/usr/lib/{_MULTIARCH}/openblas-openmp/libblas.so.3",
    "/usr/lib64/libopenblasp.so.0",  # Fedora/RHEL openblas-threads
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",  # Arch, Alpine
)
"""Where distributions install OpenBLAS; the ones present are timed."""

# Runs in a fresh interpreter so that LD_PRELOAD takes effect; prints the best of 5 in ms.
_MATMUL_PROBE = """
import time, mlx.core as mx
a = mx.random.normal((1500, 384)); b = mx.random.normal((384, 1536)); mx.eval(a, b, a @ b)
best = 1e9
for _ in range(5):
    t = time.perf_counter(); mx.eval(a @ b); best = min(best, time.perf_counter() - t)
print(best * 1000)
"""


@dataclass(frozen=True)
class BlasChoice:
    """The BLAS library to preload (None: the one bundled with MLX) and why."""

    path: str | None
    reason: str
    timings_ms: dict[str, float] = field(default_factory=dict)
    coretype: str | None = None  # OPENBLAS_CORETYPE to run it with (None: its own detection)

    def describe(self) -> str:
        """One line for the log: the choice, the reason and the timings."""
        timings = ", ".join(f"{Path(k).name if k != 'bundled' else k}={v:.1f}ms" for k, v in self.timings_ms.items())
        state = "" if self.path is None or blas_loaded(self.path) else " NOT LOADED (LD_PRELOAD ignored?)"
        core = f" as {self.coretype}" if self.coretype else ""
        return f"{self.path or 'bundled'}{core}{state} ({self.reason}{'; ' + timings if timings else ''})"

    def env(self, base: dict) -> dict:
        """`base` with this BLAS preloaded (ahead of any other preload) and its core type set."""
        env = dict(base)
        if self.path:
            env["LD_PRELOAD"] = ":".join(p for p in (self.path, base.get("LD_PRELOAD", "")) if p)
        if self.coretype:
            env[CORETYPE_ENV] = self.coretype
        return env

    def active(self) -> bool:
        """Whether this process already runs with this BLAS (and core type)."""
        if self.path is None:
            return True
        core_set = self.coretype is None or os.environ.get(CORETYPE_ENV) == self.coretype
        return blas_loaded(self.path) and core_set


@dataclass(frozen=True)
class PlatformInfo:
    """What the worker runs on and the policy that follows from it."""

    backend: str  # "metal" | "cuda" | "cpu"
    blas: BlasChoice
    float32_max_bytes: int

    def use_float32(self, float32_bytes: int) -> bool:
        """Whether a model with this many bytes of float32 weights should be dequantized/upcast."""
        fast_blas = self.blas.path is not None and blas_loaded(self.blas.path)
        return self.backend == "cpu" and fast_blas and float32_bytes <= self.float32_max_bytes


def backend() -> str:
    """The device MLX computes on: "metal", "cuda" or "cpu"."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def cache_path() -> Path:
    """The JSON file caching BLAS measurements (under ~/.cache/mlxq, like the model store)."""
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return home / "mlxq" / "platform.json"


def installed_candidates() -> list[str]:
    """The BLAS candidates present here, one per distinct library file."""
    seen, found = set(), []
    for path in BLAS_CANDIDATES:
        real = os.path.realpath(path)
        if os.path.exists(real) and real not in seen:
            seen.add(real)
            found.append(path)
    return found


def machine_key(candidates: list[str], cores: list[str | None] | None = None) -> str:
    """Cache key: CPU model, core count, MLX version, the candidate libraries' real files and core types."""
    libs = ",".join(os.path.realpath(c) for c in candidates)
    cores = ",".join(c or "auto" for c in (coretypes() if cores is None else cores))
    return f"{_cpu_model()}|{os.cpu_count()}|{_platform.machine()}|mlx-{_mlx_version()}|{libs}|{cores}"


def coretypes() -> list[str | None]:
    """OPENBLAS_CORETYPE values to time: OpenBLAS's own detection, then what this CPU's flags allow."""
    if os.environ.get(CORETYPE_ENV):
        return [os.environ[CORETYPE_ENV]]
    return _detected_coretypes()


def _detected_coretypes() -> list[str | None]:
    """OpenBLAS's own detection, then the core types this CPU's flags allow (whatever the environment says)."""
    flags = _cpu_flags()
    return [None] + [core for flag, core in _CORETYPES_BY_FLAG if flag in flags]


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return set(_cpuinfo("flags").split())


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform.processor()."""
    return _cpuinfo("model name") or _platform.processor() or "unknown-cpu"


def _cpuinfo(name: str) -> str:
    """The first value of `name` in /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _mlx_version() -> str:
    """MLX's version, read without importing it."""
    try:
        return metadata.version("mlx")
    except metadata.PackageNotFoundError:
        return "unknown"


def time_matmul(preload: str | None, timeout_s: float = 120, coretype: str | None = None) -> float | None:
    """Milliseconds for a 1500x384 @ 384x1536 float32 matmul with `preload` in LD_PRELOAD (None if it fails)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", CORETYPE_ENV)}
    env = BlasChoice(preload, "probe", coretype=coretype).env(env)
    try:
        out = subprocess.run([sys.executable, "-c", _MATMUL_PROBE], env=env, capture_output=True, text=True,
                             timeout=timeout_s, check=True)
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None  # a library that crashes or cannot load MLX simply loses


def measure_blas(candidates: list[str], cores: list[str | None] | None = None) -> BlasChoice:
    """Time the bundled BLAS and each candidate under each core type; pick the fastest if it clearly wins."""
    cores = coretypes() if cores is None else cores
    options = {(c, core): f"{c}@{core}" if core else c for c in candidates for core in cores}
    timings = {"bundled": time_matmul(None)}
    timings.update({name: time_matmul(c, coretype=core) for (c, core), name in options.items()})
    timings = {k: round(v, 2) for k, v in timings.items() if v is not None}
    bundled = timings.get("bundled", float("inf"))
    best = min((option for option, name in options.items() if name in timings),
               key=lambda option: timings[options[option]], default=None)
    if best is None or timings[options[best]] > bundled * _SPEEDUP_NEEDED:
        return BlasChoice(None, "measured: no faster BLAS", timings)
    return BlasChoice(best[0], "measured", timings, coretype=best[1])


def cached_or_measured_blas(cache: Path) -> BlasChoice:
    """The cached decision for this machine, measuring (and caching) it the first time."""
    candidates = installed_candidates()
    if not candidates:
        return BlasChoice(None, "no OpenBLAS installed")
    key = machine_key(candidates)
    entries = _read_cache(cache)
    forced = os.environ.get(CORETYPE_ENV)
    own = entries.get(machine_key(candidates, _detected_coretypes())) if forced else None
    if own and own.get("coretype") == forced:
        # A process re-run with a choice's core type (the worker, the tests) keeps that choice: timed
        # again under the forced type, two libraries of one OpenBLAS tie, and the other one may win.
        return BlasChoice(own["path"], "cached measurement", own.get("timings_ms", {}), forced)
    if key in entries:
        hit = entries[key]
        return BlasChoice(hit["path"], "cached measurement", hit.get("timings_ms", {}), hit.get("coretype"))
    log.info("timing a matmul with the bundled BLAS and with %s (once per machine)", ", ".join(candidates))
    choice = measure_blas(candidates)
    entries[key] = {"path": choice.path, "coretype": choice.coretype, "timings_ms": choice.timings_ms,
                    "measured_at": int(time.time())}
    _write_cache(cache, entries)
    return choice


def _read_cache(cache: Path) -> dict:
    """The cache file's entries (empty when missing or unreadable)."""
    try:
        data = json.loads(cache.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(cache: Path, entries: dict) -> None:
    """Write the cache atomically (a concurrent reader never sees half a file)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    os.replace(tmp, cache)


def choose_blas(environ=None, device: str | None = None) -> BlasChoice:
    """Decide which BLAS to preload, honoring MLXQ_BLAS=auto|none|<path>."""
    environ = os.environ if environ is None else environ
    wanted = environ.get(BLAS_ENV, "auto").strip() or "auto"
    if sys.platform != "linux" or (device or backend()) != "cpu":
        return BlasChoice(None, "not a Linux CPU: MLX's own kernels are used")
    if wanted == "none":
        return BlasChoice(None, f"{BLAS_ENV}=none")
    if wanted != "auto":
        if not os.path.exists(wanted):
            raise FileNotFoundError(f"{BLAS_ENV}={wanted}: no such file")
        return BlasChoice(wanted, f"{BLAS_ENV} names it")
    return cached_or_measured_blas(cache_path())


def blas_loaded(path: str) -> bool:
    """Whether the library at `path` is mapped into this process (so the preload took effect)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return os.path.realpath(path) in maps or path in maps


def reexec_with_blas(choice: BlasChoice, argv: list[str]) -> None:
    """Replace this process with `python -m workers.main argv` with the chosen BLAS preloaded.

    Returns when no preload is wanted, it is active, or a re-exec already happened (no loop)."""
    if choice.active() or os.environ.get(_REEXEC_MARK):
        return
    env = {**choice.env(os.environ), _REEXEC_MARK: "1"}
    log.info("re-executing with LD_PRELOAD=%s %s=%s", env["LD_PRELOAD"], CORETYPE_ENV, env.get(CORETYPE_ENV))
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "workers.main", *argv], env)


def float32_max_bytes(environ=None) -> int:
    """The float32 size limit for upcasting on CPU (MLXQ_CPU_FLOAT32_MAX_MB, default measured)."""
    environ = os.environ if environ is None else environ
    return int(float(environ.get(FLOAT32_MAX_ENV, DEFAULT_FLOAT32_MAX_MB)) * 2**20)


def detect(environ=None) -> PlatformInfo:
    """The platform as this process runs it (BLAS from the environment, cached measurement)."""
    device = backend()
    return PlatformInfo(device, choose_blas(environ, device), float32_max_bytes(environ))
