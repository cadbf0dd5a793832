"""`mlxq embed TEXT... [--file F] [--model M] [--out vectors.npy]`: embeddings from a running mlxq.

Texts come as arguments and/or one per line of a file (`-`: standard input, blank lines skipped), sent in requests of
at most the API's 2,048 inputs. The vectors are printed as JSON lines (`{"index": i, "embedding": [...]}`, in the
order of the texts), or written with `--out` as one float32 `.npy` array of texts × dimensions.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import httpx

from mlxq.client import DEFAULT_URL, connect

MAX_INPUTS = 2048
"""Inputs per request (/v1/embeddings refuses more)."""


@click.command()
@click.argument("texts", nargs=-1)
@click.option("--file", "source", type=click.File("r"), default=None,
              help="Texts one per line ('-': standard input), after any TEXT arguments.")
@click.option("--model", default=None, help="An embedding model id (default: the first the server lists).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the vectors to this .npy file (float32, texts × dimensions) instead of printing them.")
@click.option("--url", default=DEFAULT_URL, show_default=True, envvar="MLXQ_URL")
@click.option("--api-key", envvar="MLXQ_API_KEY", default=None, help="Bearer key (env MLXQ_API_KEY).")
def embed(texts, source, model, out, url, api_key):
    """Embed TEXTS (and the lines of --file) with an embedding model; print or save the vectors."""
    items = list(texts) + ([line.rstrip("\n") for line in source if line.strip()] if source is not None else [])
    if not items:
        raise click.UsageError("give texts to embed: TEXT arguments or --file (one text a line)")
    vectors, tokens = [], 0
    with connect(url, api_key) as client:
        model = model or _first_embedding_model(client)
        for start in range(0, len(items), MAX_INPUTS):
            answer = client.post("/v1/embeddings", json={"model": model, "input": items[start:start + MAX_INPUTS],
                                                         "encoding_format": "float"}).json()
            vectors += [row["embedding"] for row in sorted(answer["data"], key=lambda row: row["index"])]
            tokens += answer.get("usage", {}).get("prompt_tokens", 0)
    if out is not None:
        import numpy as np

        np.save(out, np.asarray(vectors, dtype=np.float32))
        click.echo(f"{len(vectors)} vectors of {len(vectors[0])} dimensions ({model}, {tokens} tokens) in {out}",
                   err=True)
        return
    for index, vector in enumerate(vectors):
        click.echo(json.dumps({"index": index, "embedding": vector}))


def _first_embedding_model(client: httpx.Client) -> str:
    """The first model the server lists as an embedding model."""
    for entry in client.get("/v1/models").json()["data"]:
        if entry.get("kind") == "embedding":
            return entry["id"]
    raise click.ClickException("the server has no embedding model (run `mlxq models pull-demo`); pass --model")
