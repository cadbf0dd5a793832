"""Reading a model directory's small files: config.json facts and sizes (never the weights, never mlx).

Listing models and resolving a request's model read the same few files again and again; each is
memoized on its file's mtime and size (a directory's size on the directory's mtime), so a read is
a stat while nothing changed.
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".npz")

_json_memo: dict[Path, tuple[tuple[int, int], dict]] = {}
_size_memo: dict[Path, tuple[int, int]] = {}
_text_memo: dict[Path, tuple[tuple[int, int], str]] = {}


def _file_key(path) -> tuple[int, int] | None:
    """(mtime_ns, size) of a file, or None when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _dir_key(path) -> int | None:
    """mtime_ns of a directory (moves when an entry is added, removed or renamed), or None."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def read_json(path: Path) -> dict | None:
    """Return the JSON object in `path` (None if missing or invalid), memoized on mtime and size."""
    key = _file_key(path)
    if key is None:
        return None
    hit = _json_memo.get(path)
    if hit and hit[0] == key:
        return hit[1]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if len(_json_memo) > 4096:  # bound the memo; it only ever holds a few small files
        _json_memo.clear()
    _json_memo[path] = (key, data)
    return data


def dir_size(path: Path) -> int:
    """Sum of the sizes of the files under `path`, memoized on the directory's mtime.

    Every request resolves its model, and walking the directory each time was most of that cost.
    A model directory changes by files being added, removed or renamed (imports are atomic
    renames), which moves its mtime; a file rewritten in place would only leave the size stale.
    """
    key = _dir_key(path)
    if key is None:
        return 0
    hit = _size_memo.get(path)
    if hit and hit[0] == key:
        return hit[1]
    size = _walk_size(path)
    if len(_size_memo) > 4096:  # bound the memo, as for the JSON files
        _size_memo.clear()
    _size_memo[path] = (key, size)
    return size


def _walk_size(path: Path) -> int:
    """Sum of the sizes of the files under `path` (following symlinks, as HF snapshots use them)."""
    total = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.is_dir():
                total += _walk_size(Path(entry.path))
            else:
                total += entry.stat().st_size
        except OSError:
            continue
    return total


def detect_kind(config: dict) -> str:
    """Return "speech", "vision" or "text" for a model's config.json contents."""
    if config.get("model_type") == "whisper" or "n_mels" in config or "n_audio_ctx" in config:
        return "speech"
    if "vision_config" in config:
        return "vision"
    return "text"


def capabilities_of(config: dict, path: Path | None = None) -> tuple[str, ...]:
    """What a model takes besides text: ("vision",), plus "audio" for models that hear (omni models);
    "tools" for a text model whose chat template renders tool definitions in a format mlxq parses."""
    kind = detect_kind(config)
    if kind == "text":
        return ("tools",) if path is not None and tool_format_of(chat_template_of(path)) else ()
    if kind != "vision":
        return ()
    return ("vision", "audio") if "audio_config" in config else ("vision",)


TOOL_FORMATS = {"json_tools": ("<tool_call>", "tool_call.name")}
"""Tool-call formats by mlx-lm's parser name (mlx_lm.tool_parsers), with the strings of a chat template
that mark it (as mlx-lm infers a tokenizer's parser): calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5, Hermes and most small models).
Only these are served: the web tier compiles `tool_choice` into a grammar of that markup."""


def tool_format_of(template: str | None) -> str | None:
    """The tool-call format a chat template writes (a key of TOOL_FORMATS), None when it has no tools."""
    if not template or "tools" not in template:
        return None
    for name, markers in TOOL_FORMATS.items():
        if all(marker in template for marker in markers):
            return name
    return None


def chat_template_of(path: Path) -> str | None:
    """A model directory's chat template: chat_template.jinja, else tokenizer_config.json's (the default
    one when it lists several)."""
    jinja = path / "chat_template.jinja"
    key = _file_key(jinja)
    if key is not None:
        hit = _text_memo.get(jinja)
        if hit is None or hit[0] != key:
            hit = (key, jinja.read_text(encoding="utf-8", errors="replace"))
            _text_memo[jinja] = hit
        return hit[1]
    template = (read_json(path / "tokenizer_config.json") or {}).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("tool_use") or named.get("default")
    return template if isinstance(template, str) else None


def context_length_of(config: dict) -> int | None:
    """Return the context length a config.json declares, if any."""
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_text_ctx", "max_target_positions"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def vocab_size_of(config: dict) -> int | None:
    """Return the vocabulary size a config.json declares, if any."""
    for source in (config, config.get("text_config") or {}):
        for key in ("vocab_size", "n_vocab"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


WHISPER_MULTILINGUAL_VOCAB = 51865
"""Whisper's rule (OpenAI's and mlx-audio's): English-only vocabularies have 51864 tokens, multilingual ones more."""


def is_multilingual(vocab_size: int | None) -> bool | None:
    """Whether a Whisper model of this vocabulary size knows many languages (None: its config does not say)."""
    return None if vocab_size is None else vocab_size >= WHISPER_MULTILINGUAL_VOCAB


SAMPLING_DEFAULT_RANGES = {
    "temperature": (0.0, 2.0), "top_p": (1e-9, 1.0), "top_k": (0, None), "min_p": (0.0, 1.0),
    "repetition_penalty": (1e-9, None),
}
"""The sampling fields a model's generation_config.json may set for requests that leave them out (as vLLM reads
it), with the values the API itself accepts for each."""


def sampling_defaults_of(path: Path) -> tuple[tuple[str, float], ...]:
    """The model author's sampling defaults from `path`/generation_config.json: (field, value) pairs, only fields
    of SAMPLING_DEFAULT_RANGES within their range (an odd value there is left out, not passed on)."""
    config = read_json(Path(path) / "generation_config.json") or {}
    out = []
    for name, (low, high) in SAMPLING_DEFAULT_RANGES.items():
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if value < low or (high is not None and value > high) or (name == "top_k" and value != int(value)):
            continue
        out.append((name, int(value) if name == "top_k" else float(value)))
    return tuple(out)


def quantization_of(config: dict) -> str | None:
    """Describe MLX quantization recorded in config.json (e.g. "4bit-g64"), None when unquantized."""
    quant = config.get("quantization") or config.get("quantization_config")
    if not isinstance(quant, dict) or "bits" not in quant:
        return None
    group = quant.get("group_size")
    return f"{quant['bits']}bit" + (f"-g{group}" if group else "")


def has_weights(path: Path) -> bool:
    """True when `path` holds MLX-loadable weights (safetensors or npz) next to its config."""
    try:
        return any(name.endswith(WEIGHT_SUFFIXES) for name in os.listdir(path))
    except OSError:
        return False


def parse_time(value, fallback: float) -> int:
    """Turn mlxq.json's imported_at (ISO 8601 or unix seconds) into unix seconds."""
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return int(fallback)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return int(moment.timestamp())
    return int(fallback)
