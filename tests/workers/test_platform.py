"""The BLAS choice: OpenBLAS libraries timed with each core type the CPU allows, the winner carried
in the environment of whatever runs MLX (worker re-exec, tests, demo build)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from workers import platform

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="BLAS preloading is Linux-only")

# Prints the core OpenBLAS runs as (its own report, "Core: ..." on stderr with OPENBLAS_VERBOSE=2).
_CORE_PROBE = "import mlx.core as mx; a = mx.ones((64, 64)); mx.eval(a @ a)"


def test_env_puts_the_library_first_and_sets_the_core_type():
    choice = platform.BlasChoice("/lib/a.so", "test", coretype="Haswell")
    env = choice.env({"LD_PRELOAD": "/lib/b.so", "PATH": "/bin"})
    assert env == {"LD_PRELOAD": "/lib/a.so:/lib/b.so", "PATH": "/bin", platform.CORETYPE_ENV: "Haswell"}
    assert platform.BlasChoice(None, "bundled").env({"PATH": "/bin"}) == {"PATH": "/bin"}


def test_an_operators_core_type_is_the_only_one_timed(monkeypatch):
    monkeypatch.setenv(platform.CORETYPE_ENV, "Zen")
    assert platform.coretypes() == ["Zen"]
    monkeypatch.delenv(platform.CORETYPE_ENV)
    cores = platform.coretypes()
    assert cores[0] is None  # OpenBLAS's own detection is always a contestant
    flags = platform._cpu_flags()
    assert ("Haswell" in cores) == ("avx2" in flags) and ("SkylakeX" in cores) == ("avx512f" in flags)


def test_the_cache_key_changes_with_the_core_types(monkeypatch):
    monkeypatch.setenv(platform.CORETYPE_ENV, "Haswell")
    haswell = platform.machine_key(["/lib/a.so"])
    monkeypatch.setenv(platform.CORETYPE_ENV, "SkylakeX")
    assert platform.machine_key(["/lib/a.so"]) != haswell


@pytest.fixture(scope="module")
def openblas() -> str:
    """An installed OpenBLAS (make test installs Debian's)."""
    found = platform.installed_candidates()
    if not found:
        pytest.skip("no OpenBLAS installed")
    return found[0]


def test_the_measured_choice_is_the_fastest_option_and_is_applied(openblas, monkeypatch):
    monkeypatch.delenv(platform.CORETYPE_ENV, raising=False)
    choice = platform.measure_blas([openblas], [None, "Haswell"])
    assert set(choice.timings_ms) == {"bundled", openblas, f"{openblas}@Haswell"}
    assert choice.path == openblas and choice.coretype in (None, "Haswell")
    picked = choice.timings_ms[f"{openblas}@{choice.coretype}" if choice.coretype else openblas]
    assert picked == min(choice.timings_ms.values())
    # The environment it hands on makes OpenBLAS run the chosen kernels.
    forced = platform.BlasChoice(openblas, "test", coretype="Haswell")
    env = {**forced.env({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}), "OPENBLAS_VERBOSE": "2"}
    out = subprocess.run([sys.executable, "-c", _CORE_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Core: Haswell" in out.stdout + out.stderr


def test_active_needs_the_library_and_the_core_type(openblas, monkeypatch):
    chosen = platform.choose_blas()  # what tests/blas_preload.py re-ran this process with
    assert chosen.path and chosen.active(), chosen.describe()
    openblas = chosen.path
    monkeypatch.setenv(platform.CORETYPE_ENV, "Haswell")
    assert platform.BlasChoice(openblas, "test", coretype="Haswell").active()
    assert not platform.BlasChoice(openblas, "test", coretype="SkylakeX").active()
    assert platform.BlasChoice(openblas, "test").active()
    assert platform.BlasChoice(None, "bundled").active()
