"""Loaded by every Python process started with this directory on PYTHONPATH (bench/trace_text.py)."""
import os

if os.environ.get("MLXQ_TRACE_ROLE") == "worker":
    import tracehook

    tracehook.patch_worker()
