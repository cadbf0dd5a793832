"""The worker's process-wide settings: MLX's environment before MLX loads, glibc's fixed mmap threshold on a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from workers import process_setup


def test_mlx_settings_are_defaults_the_operator_can_override():
    environ = {}
    process_setup.apply(environ)
    assert environ == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0", "MLX_CUDA_USE_CUDNN_SDPA": "0"}
    environ = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
    process_setup.apply(environ)
    assert environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "1"


def test_the_worker_module_does_not_load_mlx_before_its_settings():
    # MLX reads its environment as it loads: workers.main must get to process_setup.apply() first.
    probe = "import sys, workers.main; print('mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


_MMAPPED_BLOCKS = """
import ctypes, sys
from workers import process_setup

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes, libc.mallinfo2.restype = ctypes.c_void_p, [ctypes.c_void_p], MallInfo2
if sys.argv[1] == "fixed":
    assert process_setup.fix_mmap_threshold("cuda", {})
libc.free(libc.malloc(8 << 20))  # a large block freed: glibc's own threshold rises to 8 MiB
before = libc.mallinfo2().hblks
block = libc.malloc(1 << 20)
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("mode, mmapped", [("glibc's own", 0), ("fixed", 1)])
def test_a_fixed_threshold_keeps_megabyte_blocks_out_of_the_heap(mode, mmapped):
    out = subprocess.run([sys.executable, "-c", _MMAPPED_BLOCKS, mode], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == mmapped  # the 1 MiB block: from the heap with glibc's rising threshold, else mmap'd


def test_an_operator_s_malloc_setting_is_left_alone():
    assert process_setup.fix_mmap_threshold("cuda", {"MALLOC_MMAP_THRESHOLD_": "65536"}) is False


def test_a_cpu_worker_keeps_glibc_s_own_threshold():
    # On a CPU MLX's arrays come from malloc: fixed at 128 KiB, each would get fresh pages (1.6x the time).
    assert process_setup.fix_mmap_threshold("cpu", {}) is False
