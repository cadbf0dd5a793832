"""`mlxq models ...`: import, pull, list and remove models in the local store.

Everything heavy (the importers load mlx) is imported inside the commands, so `mlxq --help`
stays fast and `list` / `rm` never load mlx at all.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import click

from jobs.settings import load_settings


def _clean_errors(command):
    """Turn any failure into one `error: ...` line on stderr and exit 1 (2 for bad arguments)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (click.exceptions.Exit, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        except Exception as exc:
            if os.environ.get("MLXQ_DEBUG"):
                raise
            click.echo(f"error: {_one_line(exc)}", err=True)
            sys.exit(_exit_code(exc))

    return wrapper


def _exit_code(exc: Exception) -> int:
    """2 for a bad argument (invalid name or repo id), 1 for everything else."""
    from workers.store_admin import InvalidName

    return 2 if isinstance(exc, InvalidName) else 1


def _one_line(exc: BaseException) -> str:
    """The first line of an exception's message (or its type when it has none)."""
    text = str(exc).strip()
    if isinstance(exc, KeyError) and exc.args:
        text = f"missing {exc.args[0]!r}"
    return text.splitlines()[0] if text else type(exc).__name__


def human_size(n: int) -> str:
    """Format a byte count as e.g. "98.4 MiB"."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _report(info, verb: str) -> None:
    """Print one line describing a model that was just imported or pulled."""
    quant = f", {info.quantization}" if info.quantization else ""
    click.echo(f"{verb} {info.id} ({info.kind}, {human_size(info.size_bytes)}{quant}) at {info.path}")


def _progress(message: str) -> None:
    click.echo(message, err=True)


@click.group("models")
def models():
    """Import, pull, list and remove models in the local store (MLXQ_MODELS_DIR)."""


def _import(src: Path, name: str | None, force: bool, importer: str, default_stem: str) -> None:
    """Shared body of import-gguf, import-ct2-whisper and import-sentence-transformers."""
    from workers.store_admin import converter_for, import_into_store, safe_name, validate_name

    settings = load_settings()
    name = validate_name(name or safe_name(default_stem))
    _progress(f"converting {src} into {settings.models_dir / name} ...")
    convert = converter_for(importer)
    info = import_into_store(settings, name, convert, src, {"source": f"{importer}:{src.resolve()}"}, force=force)
    _report(info, "imported")


@models.command("import-gguf")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--name", help="Store name (default: derived from the file name).")
@click.option("--force", is_flag=True, help="Replace an existing model of that name.")
@_clean_errors
def import_gguf(file: Path, name: str | None, force: bool):
    """Convert a GGUF LLM (llama architecture) into an MLX model in the store."""
    stem = file.name[:-5] if file.name.lower().endswith(".gguf") else file.name
    _import(file, name, force, "gguf", stem)


@models.command("import-gguf-vlm")
@click.option("--model", "model_file", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The language model GGUF (e.g. SmolVLM-256M-Instruct-Q8_0.gguf).")
@click.option("--mmproj", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Its vision projector GGUF (e.g. mmproj-SmolVLM-256M-Instruct-Q8_0.gguf).")
@click.option("--name", help="Store name (default: derived from the model file name).")
@click.option("--force", is_flag=True, help="Replace an existing model of that name.")
@_clean_errors
def import_gguf_vlm(model_file: Path, mmproj: Path, name: str | None, force: bool):
    """Convert a llama.cpp vision model (GGUF + mmproj GGUF, SmolVLM / Idefics3) into an MLX model in the store."""
    from workers.store_admin import converter_for, import_into_store, safe_name, source_sha256, validate_name

    settings = load_settings()
    stem = model_file.name[:-5] if model_file.name.lower().endswith(".gguf") else model_file.name
    name = validate_name(name or safe_name(stem))
    mmproj = mmproj.resolve()
    convert_vlm = converter_for("gguf-vlm")
    provenance = {"source": f"gguf-vlm:{model_file.resolve()}", "mmproj": str(mmproj),
                  "mmproj_sha256": source_sha256(mmproj)}
    _progress(f"converting {model_file} + {mmproj.name} into {settings.models_dir / name} ...")
    info = import_into_store(settings, name, lambda src, out_dir: convert_vlm(src, mmproj, out_dir), model_file,
                             provenance, force=force)
    _report(info, "imported")


@models.command("import-ct2-whisper")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--name", help="Store name (default: derived from the directory name).")
@click.option("--force", is_flag=True, help="Replace an existing model of that name.")
@_clean_errors
def import_ct2_whisper(directory: Path, name: str | None, force: bool):
    """Convert a CTranslate2 (faster-whisper) Whisper model directory into an MLX model in the store."""
    _import(directory, name, force, "ct2", directory.resolve().name)


@models.command("import-sentence-transformers")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--name", help="Store name (default: derived from the folder or zip name).")
@click.option("--force", is_flag=True, help="Replace an existing model of that name.")
@_clean_errors
def import_sentence_transformers(source: Path, name: str | None, force: bool):
    """Import a sentence-transformers embedding model (a folder, or a zip of one; BERT family) into the store."""
    stem = source.name[:-4] if source.name.lower().endswith(".zip") else source.resolve().name
    _import(source, name, force, "sentence-transformers", stem)


@models.command("pull")
@click.argument("repo")
@_clean_errors
def pull(repo: str):
    """Download an MLX model from the Hugging Face hub into the local HF cache (when reachable)."""
    from workers.store_admin import pull_from_hub

    _report(pull_from_hub(load_settings(), repo), "pulled")


@models.command("pull-demo")
@_clean_errors
def pull_demo():
    """Fetch and import the demo models (SmolLM2-135M-Instruct, Whisper tiny.en) and build the toy VLM."""
    from workers.demo.pull import pull_demo as run_pull_demo

    for info in run_pull_demo(load_settings(), log=_progress):
        _report(info, "ready:")


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array instead of a table.")
@_clean_errors
def list_(as_json: bool):
    """List the models clients can name: store entries, aliases and MLX models in the HF cache."""
    from jobs.store import list_models

    infos = list_models(load_settings())
    if as_json:
        click.echo(json.dumps([info.as_dict() for info in infos], indent=2))
        return
    rows = [("NAME", "KIND", "SIZE", "SOURCE", "QUANT")]
    rows += [(i.id, i.kind, human_size(i.size_bytes), i.source, i.quantization or "-") for i in infos]
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4])
    if not infos:
        click.echo("(no models: try `mlxq models pull-demo`)", err=True)


@models.command("rm")
@click.argument("name")
@_clean_errors
def rm(name: str):
    """Remove a model from the store (and the aliases that point at it)."""
    from workers.store_admin import remove_model

    dropped = [a for a in remove_model(load_settings(), name) if a != name]
    extra = f" (and alias{'es' if len(dropped) > 1 else ''} {', '.join(dropped)})" if dropped else ""
    click.echo(f"removed {name}{extra}")
