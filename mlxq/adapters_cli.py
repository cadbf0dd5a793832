"""`mlxq adapters ...`: import, list and remove LoRA adapters in the local adapter store (MLXQ_ADAPTERS_DIR).

None of them loads mlx: an import checks the adapter against its base model from safetensors headers.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from jobs.settings import load_settings
from mlxq.models_cli import _clean_errors, human_size


@click.group("adapters")
def adapters():
    """Import, list and remove LoRA adapters (mlx_lm.lora outputs) that requests can decode with."""


@adapters.command("import")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--name", help="Store name (default: derived from the directory name).")
@click.option("--base", help="The model it adapts, in the model store (default: the one its adapter_config.json "
              "names).")
@click.option("--force", is_flag=True, help="Replace an existing adapter of that name.")
@_clean_errors
def import_(path: Path, name: str | None, base: str | None, force: bool):
    """Check an mlx_lm.lora output directory (adapters.safetensors + adapter_config.json) against its base model's
    shapes and copy it into the adapter store."""
    from workers.adapter_store import import_adapter

    info = import_adapter(load_settings(), path, name=name, base=base, force=force)
    click.echo(f"imported {info.name} (LoRA rank {info.rank} on {info.num_layers} layers of {info.base}, "
               f"{human_size(info.size_bytes)}) at {info.path}")


@adapters.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array instead of a table.")
@_clean_errors
def list_(as_json: bool):
    """List the adapters in the store and the model each was made for."""
    from jobs.adapters import list_adapters

    infos = list_adapters(load_settings())
    if as_json:
        click.echo(json.dumps([info.public() for info in infos], indent=2))
        return
    rows = [("NAME", "BASE", "TYPE", "RANK", "LAYERS", "SIZE")]
    rows += [(i.name, i.base, i.fine_tune_type, str(i.rank), str(i.num_layers), human_size(i.size_bytes))
             for i in infos]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if not infos:
        click.echo("(no adapters: `mlxq adapters import PATH`, or `mlxq models pull-demo` for the demo's)", err=True)


@adapters.command("rm")
@click.argument("name")
@_clean_errors
def rm(name: str):
    """Remove an adapter from the store (a worker that has it mounted keeps it until unmounted or restarted)."""
    from workers.adapter_store import remove_adapter

    remove_adapter(load_settings(), name)
    click.echo(f"removed {name}")
