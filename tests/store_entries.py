"""Store entries made for a test from a demo model: the same weights (linked), the other files copied, so a test
can change a template or a generation_config.json without touching the real store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def linked_entry(source: Path, store: Path, name: str) -> Path:
    """A copy of the store entry `source` in `store` under `name` (its weights linked, its manifest renamed)."""
    entry = store / name
    entry.mkdir()
    for file in source.iterdir():
        if file.suffix == ".safetensors":
            (entry / file.name).symlink_to(file)
        else:
            shutil.copy(file, entry / file.name)
    manifest = json.loads((entry / "mlxq.json").read_text())
    (entry / "mlxq.json").write_text(json.dumps({**manifest, "name": name}))
    return entry
