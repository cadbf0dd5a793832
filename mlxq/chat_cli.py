"""`mlxq chat "question" [--image FILE] [--audio FILE]`: one streamed chat with a running mlxq.

Images and audio go in the message as data URLs / base64 `input_audio` parts, the way the OpenAI
API takes them; the answer is printed as it streams.
"""

from __future__ import annotations

import base64
import mimetypes
from pathlib import Path

import click
import httpx

from mlxq.client import DEFAULT_URL, connect, error_text, sse

FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


def image_part(path: Path) -> dict:
    """An image_url part holding the file as a data URL."""
    mime = mimetypes.guess_type(path.name)[0] or ""
    mime = mime if mime.startswith("image/") else "image/png"  # the server goes by the bytes, not the type
    data = base64.b64encode(path.read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}


def audio_part(path: Path) -> dict:
    """An input_audio part holding the file in base64, its format named by its extension."""
    data = base64.b64encode(path.read_bytes()).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": path.suffix.lstrip(".").lower()}}


def chat_body(question: str, images: tuple[Path, ...], audio: tuple[Path, ...], model: str | None,
              max_tokens: int, temperature: float | None = None) -> dict:
    """The streamed chat.completions body of one user message."""
    content = [image_part(p) for p in images] + [audio_part(p) for p in audio] + [{"type": "text", "text": question}]
    body = {"messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": max_tokens}
    if model:
        body["model"] = model
    if temperature is not None:
        body["temperature"] = temperature
    return body


@click.command()
@click.argument("question")
@click.option("--image", "images", multiple=True, type=FILE, help="An image to ask about (repeatable).")
@click.option("--audio", "audio", multiple=True, type=FILE, help="A recording to ask about (repeatable).")
@click.option("--model", default=None, help="Model id (default: a vision model when --image is given, else "
              "the server's default).")
@click.option("--max-tokens", default=256, show_default=True, type=int)
@click.option("--temperature", default=None, type=float, help="Sampling temperature (0 = greedy; default: the "
              "API's, 1).")
@click.option("--url", default=DEFAULT_URL, show_default=True, envvar="MLXQ_URL")
@click.option("--api-key", envvar="MLXQ_API_KEY", default=None, help="Bearer key (env MLXQ_API_KEY).")
def chat(question, images, audio, model, max_tokens, temperature, url, api_key):
    """Ask QUESTION (about --image / --audio files) and print the streamed answer."""
    with connect(url, api_key) as client:
        if images and not model:
            model = _first_vision_model(client)
        body = chat_body(question, images, audio, model, max_tokens, temperature)
        for _name, data in sse(client, "POST", "/v1/chat/completions", json=body):
            if "error" in data:  # the stream's error event: the server's message as it is
                raise click.ClickException(error_text(data))
            for choice in data.get("choices", []):
                click.echo((choice.get("delta") or {}).get("content") or "", nl=False)
    click.echo()


def _first_vision_model(client: httpx.Client) -> str:
    """The first model the server lists as able to see images."""
    for entry in client.get("/v1/models").json()["data"]:
        if "vision" in entry.get("capabilities", []):
            return entry["id"]
    raise click.ClickException("the server has no vision model (run `mlxq models pull-demo`); pass --model")
