"""The text side of a CTranslate2 Whisper import: tokenizer files mlx-audio can load, and the generation config."""

from __future__ import annotations

import json
import re
from pathlib import Path

from jobs.model_files import WHISPER_MULTILINGUAL_VOCAB
from workers.importers.errors import ConversionError

# Whisper's audio front end is fixed: 16 kHz, 25 ms window, 10 ms hop, 30 s chunks.
_SAMPLE_RATE, _N_FFT, _HOP, _CHUNK_S = 16000, 400, 160, 30


def write_json(path: Path, data: dict) -> None:
    """Write `data` as indented UTF-8 JSON."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def is_multilingual(n_vocab: int) -> bool:
    """Whether a Whisper vocabulary of this size is the multilingual one."""
    return n_vocab >= WHISPER_MULTILINGUAL_VOCAB


def _read_vocabulary(src: Path) -> list[str] | None:
    """CTranslate2's own id -> token list (vocabulary.json in newer versions, .txt in older), if shipped."""
    if (src / "vocabulary.json").is_file():
        try:
            tokens = json.loads((src / "vocabulary.json").read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ConversionError(f"vocabulary.json is not valid JSON: {exc}") from exc
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ConversionError("vocabulary.json is not a list of tokens")
        return tokens
    if (src / "vocabulary.txt").is_file():
        # One token per line; split on "\n" only, as str.splitlines would also split on U+2028 etc.
        lines = (src / "vocabulary.txt").read_text(encoding="utf-8").split("\n")
        return lines[:-1] if lines and lines[-1] == "" else lines
    return None


_TIMESTAMP = re.compile(r"<\|\d+\.\d\d\|>")


def _timestamp_token(index: int) -> str:
    return "<|%.2f|>" % (index * 0.02)


def _complete_tokenizer(tokenizer: dict, vocabulary: list[str] | None, n_vocab: int) -> dict:
    """Add the tokens the model has but tokenizer.json lacks (Whisper's <|0.00|>...<|30.00|>)."""
    known = {i: t for t, i in tokenizer["model"]["vocab"].items()}
    known |= {t["id"]: t["content"] for t in tokenizer.get("added_tokens", [])}
    if max(known) >= n_vocab:
        raise ConversionError(f"tokenizer.json has token id {max(known)} but the model has only {n_vocab} tokens")
    if vocabulary is not None and len(vocabulary) != n_vocab:
        raise ConversionError(f"the vocabulary lists {len(vocabulary)} tokens but the model has {n_vocab}")
    first_missing = len(known)  # tokenizer.json is complete up to here; the rest are timestamps
    added = list(tokenizer.get("added_tokens", []))
    for token_id in range(n_vocab):
        expected = vocabulary[token_id] if vocabulary is not None else None
        if token_id in known:
            if expected is not None and expected != known[token_id]:
                raise ConversionError(f"tokenizer.json and the vocabulary disagree at id {token_id}:"
                                      f" {known[token_id]!r} vs {expected!r}")
            continue
        content = expected if expected is not None else _timestamp_token(token_id - first_missing)
        # Timestamps are not "special" in Hugging Face's Whisper tokenizers: skip_special_tokens keeps them.
        added.append({"id": token_id, "content": content, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": not _TIMESTAMP.fullmatch(content)})
    return {**tokenizer, "added_tokens": added}


def write_tokenizer_files(src: Path, tokenizer_path: Path, out_dir: Path, dims: dict) -> None:
    """tokenizer.json completed with the timestamp tokens, tokenizer_config.json and preprocessor_config.json."""
    try:
        tokenizer = json.loads(tokenizer_path.read_text(encoding="utf-8"))
        tokenizer["model"]["vocab"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConversionError(f"tokenizer.json is not a Hugging Face tokenizer file: {exc}") from exc
    complete = _complete_tokenizer(tokenizer, _read_vocabulary(src), dims["n_vocab"])
    write_json(out_dir / "tokenizer.json", complete)
    special = "<|endoftext|>"
    write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "WhisperTokenizer", "processor_class": "WhisperProcessor",
        "bos_token": special, "eos_token": special, "unk_token": special, "pad_token": special,
        "model_max_length": dims["n_text_ctx"], "add_prefix_space": False, "errors": "replace",
    })
    write_json(out_dir / "preprocessor_config.json", {
        "feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "WhisperProcessor",
        "feature_size": dims["n_mels"], "sampling_rate": _SAMPLE_RATE, "n_fft": _N_FFT,
        "hop_length": _HOP, "chunk_length": _CHUNK_S, "n_samples": _SAMPLE_RATE * _CHUNK_S,
        "nb_max_frames": _SAMPLE_RATE * _CHUNK_S // _HOP, "padding_side": "right",
        "padding_value": 0.0, "return_attention_mask": False,
    })


def generation_config(src: Path, dims: dict) -> dict:
    """Alignment heads (and suppression lists) from CTranslate2's config.json, when valid."""
    config = {}
    if (src / "config.json").is_file():
        try:
            config = json.loads((src / "config.json").read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ConversionError(f"config.json is not valid JSON: {exc}") from exc
    heads = [list(map(int, h)) for h in config.get("alignment_heads") or []
             if len(h) == 2 and 0 <= h[0] < dims["n_text_layer"] and 0 <= h[1] < dims["n_text_head"]]
    out = {"is_multilingual": is_multilingual(dims["n_vocab"]), "max_length": dims["n_text_ctx"]}
    if heads:
        out["alignment_heads"] = heads
    for ours, theirs in (("suppress_tokens", "suppress_ids"), ("begin_suppress_tokens", "suppress_ids_begin")):
        if isinstance(config.get(theirs), list):
            out[ours] = config[theirs]
    return out
