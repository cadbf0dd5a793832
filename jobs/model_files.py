"""Reading a model directory's small files: config.json facts and sizes (never the weights, never mlx).

Listing models and resolving a request's model read the same few files again and again; each is
memoized on its file's mtime and size (a directory's size on the directory's mtime), so a read is
a stat while nothing changed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".npz")

_json_memo: dict[Path, tuple[tuple[int, int], dict]] = {}
_size_memo: dict[Path, tuple[int, int]] = {}
_text_memo: dict[Path, tuple[tuple[int, int], str]] = {}
_vocab_memo: dict[Path, tuple[tuple[int, int], frozenset]] = {}


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


def _read_text(path: Path) -> str | None:
    """A small text file's contents (None if missing), memoized on mtime and size."""
    key = _file_key(path)
    if key is None:
        return None
    hit = _text_memo.get(path)
    if hit is None or hit[0] != key:
        hit = (key, path.read_text(encoding="utf-8", errors="replace"))
        _text_memo[path] = hit
    return hit[1]


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


ENCODER_MODEL_TYPES = frozenset({"bert", "xlm-roberta", "modernbert"})
"""Text encoders (no decoder: nothing to chat with) that mlx-embeddings runs: served as embedding models."""


def detect_kind(config: dict) -> str:
    """Return "speech", "vision", "embedding" or "text" for a model's config.json contents."""
    if config.get("model_type") == "whisper" or "n_mels" in config or "n_audio_ctx" in config:
        return "speech"
    if "vision_config" in config:
        return "vision"
    if config.get("model_type") in ENCODER_MODEL_TYPES:
        return "embedding"
    return "text"


@dataclass(frozen=True)
class EmbeddingFacts:
    """How an embedding model turns a text into one vector: sentence-transformers' files, where present
    (modules.json, 1_Pooling/config.json, sentence_bert_config.json), else its config.json's."""

    dimensions: int
    pooling: str  # "mean", "cls", "max" or "lasttoken"
    normalize: bool  # vectors of length 1 (modules.json has a Normalize module)
    max_tokens: int  # the most tokens of one input, [CLS] and [SEP] included


POOLING_MODES = (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                 ("pooling_mode_max_tokens", "max"), ("pooling_mode_lasttoken", "lasttoken"))


def embedding_facts(path: Path, config: dict | None = None) -> EmbeddingFacts | None:
    """The facts of an embedding model's directory (None when config.json declares no hidden size)."""
    path = Path(path)
    config = read_json(path / "config.json") if config is None else config
    hidden = (config or {}).get("hidden_size")
    if not isinstance(hidden, int) or hidden <= 0:
        return None
    modules = _modules_of(path)
    pooling_dir = next((m.get("path") for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    pooling_config = read_json(path / (pooling_dir or "1_Pooling") / "config.json") or {}
    pooling = next((mode for key, mode in POOLING_MODES if pooling_config.get(key)), "mean")
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules) if modules else True
    dimensions = pooling_config.get("word_embedding_dimension")
    max_tokens = (read_json(path / "sentence_bert_config.json") or {}).get("max_seq_length")
    positions = context_length_of(config)
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        max_tokens = positions or 512
    return EmbeddingFacts(dimensions=dimensions if isinstance(dimensions, int) and dimensions > 0 else hidden,
                          pooling=pooling, normalize=normalize,
                          max_tokens=min(max_tokens, positions) if positions else max_tokens)


def _modules_of(path: Path) -> list[dict]:
    """sentence-transformers' modules.json (a list, which read_json does not take), memoized like it."""
    text = _read_text(path / "modules.json")
    if text is None:
        return []
    try:
        modules = json.loads(text)
    except ValueError:
        return []
    return [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []


def capabilities_of(config: dict, path: Path | None = None) -> tuple[str, ...]:
    """What a model takes besides text: ("vision",), plus "audio" for models that hear (omni models);
    "tools" for a text or vision model whose chat template renders tool definitions in a format mlxq parses;
    "reasoning" for a text model whose template has think markers (it reasons before it answers)."""
    kind = detect_kind(config)
    tools = ("tools",) if kind in ("text", "vision") and tool_format_in(path, config) else ()
    if kind == "text":
        template = chat_template_of(path) if path is not None else None
        return tools + (("reasoning",) if think_markers_of(template) else ())
    if kind != "vision":
        return ()
    return ("vision", "audio", *tools) if "audio_config" in config else ("vision", *tools)


THINK_MARKERS = (
    # (start, end, strings a chat template holds when it writes or strips that block)
    ("<think>", "</think>", ("<think>", "</think>")),
    ("<longcat_think>", "</longcat_think>", ("<longcat_think>", "</longcat_think>")),
    ("<|think:start|>", "<|think:end|>", ("<|think:start|>", "<|think:end|>")),
    ("<|channel>thought", "<channel|>", ("<|channel>", "<channel|>")),
    ("<|open|>think<|sep|>", "<|close|>think<|sep|>", ("<|open|>", "<|close|>", "think")),
)
"""The think markers mlx-lm knows (`_infer_thinking` in mlx_lm/tokenizer_utils.py, 0.32.2), in its order. mlx-lm
finds them in the vocabulary (as single tokens, mostly); mlxq asks the chat template, which is what says whether
a model reasons, and also finds markers written as plain text (several tokens: the think demo's)."""


def think_markers_of(template: str | None) -> tuple[str, str] | None:
    """The (start, end) markers of the reasoning a chat template's model writes, None when it has none."""
    if not template:
        return None
    for start, end, evidence in THINK_MARKERS:
        if all(text in template for text in evidence):
            return start, end
    return None


TOOL_PARSERS = frozenset({
    "function_gemma", "gemma4", "glm47", "json_tools", "kimi_k2", "kimi_k3", "laguna", "longcat", "minicpm5",
    "minimax_m2", "mistral", "muse_spark", "pythonic", "qwen3_coder"})
"""mlx-lm's tool-call parsers (the modules of mlx_lm/tool_parsers/, 0.32.2): a model whose tokenizer gets one
of them has the "tools" capability; the worker cuts its calls out with it (workers/backends/toolcalls.py)."""

TOOL_TEMPLATE_RULES = (
    # (parser, alternatives: the chat template holds every string of one of them), first match wins
    ("minimax_m2", (("<minimax:tool_call>",),)),
    ("gemma4", (("<|tool_call>", "<tool_call|>"),)),
    ("function_gemma", (("<start_function_call>",),)),
    ("longcat", (("<longcat_tool_call>",),)),
    ("glm47", (("<arg_key>",),)),
    ("pythonic", (("<|tool_list_start|>",), ("<|tool_call_start|>",))),
    ("qwen3_coder", (("<tool_call>\\n<function=",), ("<tool_call>\n<function=",))),
    ("kimi_k2", (("<|tool_calls_section_begin|>",),)),
    ("minicpm5", (('<function name="', '<param name="'),)),
    ("mistral", (("[TOOL_CALLS]",),)),
    ("muse_spark", (("<atem:function_calls>",),)),
    ("json_tools", (("<tool_call>", "tool_call.name"),)),
)
"""How mlx-lm infers a tokenizer's tool parser from its chat template: `_infer_tool_parser` in
mlx_lm/tokenizer_utils.py (mlx-lm 0.32.2), rule for rule, in its order, with its strings (jobs/ never imports
mlx-lm; tests/workers/test_tool_formats.py checks this table against that function). mlx-lm reads the template
only when the tokenizer's is one string: named templates (a list in tokenizer_config.json, or
additional_chat_templates/) reach it as a dict and skip these rules."""

TOOL_VOCAB_RULES = (
    ("kimi_k3", ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")),
    ("pythonic", ("<|tool_call_start|>", "<|tool_call_end|>")),
)
"""`_infer_tool_parser`'s fallback when no template rule matched: tokens the vocabulary holds (every one of them).
mlxq looks for them as whole JSON strings in tokenizer.json (its vocabulary and added tokens) and in
tokenizer_config.json's added_tokens_decoder, without loading the tokenizer."""

MODEL_TOOL_PARSERS = {"muse_spark": "muse_spark"}
"""The parser a model type's module names for checkpoints whose tokenizer_config.json does not
(`TOKENIZER_DEFAULTS["tool_parser_type"]` in mlx_lm/models/<type>.py, 0.32.2)."""


def tool_format_in(path: Path | None, config: dict | None = None) -> str | None:
    """The tool-call format (mlx-lm's parser name, one of TOOL_PARSERS) the worker's tokenizer for the model
    at `path` gets, None when it gets none: as mlx-lm's tokenizer loader decides it, tokenizer_config.json's
    `tool_parser_type`, else the model type's default, else the chat template's markers, else the vocabulary's."""
    if path is None:
        return None
    tokenizer_config = read_json(path / "tokenizer_config.json") or {}
    if "tool_parser_type" in tokenizer_config:  # even null: mlx-lm then infers, passing over the model's default
        named = tokenizer_config["tool_parser_type"]
    else:
        model_type = (config if config is not None else read_json(path / "config.json") or {}).get("model_type")
        named = MODEL_TOOL_PARSERS.get(model_type)
    if named is not None:
        return named if named in TOOL_PARSERS else None
    return tool_format_of(_loaded_template(path)) or _vocab_format(path)


def tool_format_of(template: str | None) -> str | None:
    """The tool-call format TOOL_TEMPLATE_RULES give a chat template, None when no rule matches."""
    if not isinstance(template, str):
        return None
    for name, alternatives in TOOL_TEMPLATE_RULES:
        if any(all(marker in template for marker in markers) for markers in alternatives):
            return name
    return None


def _loaded_template(path: Path) -> str | None:
    """The chat template as the tokenizer holds it, when it is one string (None for named templates)."""
    extra = path / "additional_chat_templates"
    try:
        if any(name.endswith(".jinja") for name in os.listdir(extra)):
            return None
    except OSError:
        pass
    if _file_key(path / "chat_template.jinja") is not None:
        return chat_template_of(path)
    template = (read_json(path / "tokenizer_config.json") or {}).get("chat_template")
    return template if isinstance(template, str) else None


def _vocab_format(path: Path) -> str | None:
    """The format TOOL_VOCAB_RULES give the tokens a model's tokenizer files hold, None when none matches."""
    found = _vocab_markers(path / "tokenizer.json")
    added = (read_json(path / "tokenizer_config.json") or {}).get("added_tokens_decoder")
    if isinstance(added, dict):
        found |= {t.get("content") for t in added.values() if isinstance(t, dict)}
    for name, tokens in TOOL_VOCAB_RULES:
        if all(token in found for token in tokens):
            return name
    return None


_VOCAB_MARKERS = frozenset(token for _, tokens in TOOL_VOCAB_RULES for token in tokens)


def _vocab_markers(path: Path) -> set[str]:
    """Which tokens of TOOL_VOCAB_RULES a tokenizer.json holds (as whole JSON strings), memoized on its mtime and
    size: the file is megabytes, searched as bytes, never parsed."""
    key = _file_key(path)
    if key is None:
        return set()
    hit = _vocab_memo.get(path)
    if hit is None or hit[0] != key:
        try:
            data = path.read_bytes()
        except OSError:
            return set()
        hit = (key, frozenset(t for t in _VOCAB_MARKERS if json.dumps(t).encode() in data))
        if len(_vocab_memo) > 4096:
            _vocab_memo.clear()
        _vocab_memo[path] = hit
    return set(hit[1])


def chat_template_of(path: Path) -> str | None:
    """A model directory's chat template: chat_template.jinja, else tokenizer_config.json's (the default
    one when it lists several)."""
    jinja = _read_text(path / "chat_template.jinja")
    if jinja is not None:
        return jinja
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
