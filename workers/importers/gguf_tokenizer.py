"""Rebuild a Hugging Face tokenizer (tokenizer.json and its configs) from the vocabulary in a GGUF file.

A GGUF stores the tokenizer as llama.cpp sees it: tokens, merges (BPE) or scores (SentencePiece),
per-token types and special token ids. We rebuild the equivalent `tokenizers` pipeline so that
mlx_lm / transformers encode text to the same ids llama.cpp would.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .errors import ConversionError, UnsupportedModel

# llama.cpp token types (llama_token_type / gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_split():
    return [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]


def _digits_then_gpt2_split():
    # llama.cpp splits every digit off first (regex \p{N}), then applies the GPT-2 regex.
    return [pre_tokenizers.Digits(individual_digits=True), *_gpt2_split()]


def _llama3_split():
    return [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]


# tokenizer.ggml.pre -> pre-tokenizer, following llama.cpp's llama-vocab.cpp regex table.
BPE_PRE_TOKENIZERS = {
    "gpt2": _gpt2_split, "mpt": _gpt2_split, "olmo": _gpt2_split,
    "smollm": _digits_then_gpt2_split, "starcoder": _digits_then_gpt2_split, "refact": _digits_then_gpt2_split,
    "llama-bpe": _llama3_split, "llama3": _llama3_split, "llama-v3": _llama3_split, "smaug-bpe": _llama3_split,
}


def check_tokenizer_supported(metadata: dict) -> None:
    """Raise UnsupportedModel unless the GGUF's tokenizer.ggml.model/pre is one we can rebuild."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "llama":
        return
    if model != "gpt2":
        raise UnsupportedModel(f"tokenizer model {model!r} is not supported (supported: gpt2 BPE, llama SentencePiece)")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in BPE_PRE_TOKENIZERS:
        raise UnsupportedModel(f"BPE pre-tokenizer {pre!r} is not supported (supported: {', '.join(BPE_PRE_TOKENIZERS)})")


def _scalar(metadata: dict, key: str, default=None):
    value = metadata.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def build_tokenizer(metadata: dict) -> Tokenizer:
    """Build the `tokenizers.Tokenizer` described by the GGUF's tokenizer.* metadata."""
    check_tokenizer_supported(metadata)
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ConversionError("GGUF has no tokenizer.ggml.tokens vocabulary")
    types = _token_types(metadata, len(tokens))
    if metadata["tokenizer.ggml.model"] == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens)
    else:
        tokenizer = _sentencepiece_bpe(metadata, tokens, types)
    _add_special_tokens(tokenizer, tokens, types)
    tokenizer.post_processor = _post_processor(metadata, tokens)
    return tokenizer


def _token_types(metadata: dict, count: int) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        return [NORMAL] * count
    if types.size != count:
        raise ConversionError(f"GGUF tokenizer has {count} tokens but {types.size} token types")
    return types.tolist()


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # a few files repeat a token; llama.cpp resolves text to the first
    return vocab


def _byte_level_bpe(metadata: dict, tokens: list[str]) -> Tokenizer:
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise ConversionError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=pairs, fuse_unk=False))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(BPE_PRE_TOKENIZERS[pre]())
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(metadata: dict, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        raise ConversionError("GGUF llama tokenizer has no tokenizer.ggml.scores")
    unk = tokens[int(_scalar(metadata, "tokenizer.ggml.unknown_token_id", 0))]
    model = models.BPE(vocab=_vocab(tokens), merges=merges_from_scores(tokens, scores.tolist(), types),
                       unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    space_prefix = bool(_scalar(metadata, "tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", "\u2581")]
    tokenizer.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if space_prefix else []) + steps)
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(decode + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return tokenizer


def merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges as an ordered list: every (left, right) split of a normal token, best score first."""
    # SentencePiece merges the adjacent pair whose concatenation has the highest score; an HF BPE
    # merge list ranked by that score reproduces it.
    normal = {token: i for i, token in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    ranked = []
    for token, index in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[index], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    # llama.cpp matches CONTROL and USER_DEFINED tokens whole in raw text before BPE; added tokens
    # with normalized=False do the same. Only CONTROL/UNKNOWN ones are "special" (skipped on decode).
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True)
               if k in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def _post_processor(metadata: dict, tokens: list[str]):
    add_bos = bool(_scalar(metadata, "tokenizer.ggml.add_bos_token", metadata["tokenizer.ggml.model"] == "llama"))
    add_eos = bool(_scalar(metadata, "tokenizer.ggml.add_eos_token", False))
    bos_id, eos_id = _scalar(metadata, "tokenizer.ggml.bos_token_id"), _scalar(metadata, "tokenizer.ggml.eos_token_id")
    single, specials = "$A", []
    if add_bos and bos_id is not None:
        single, specials = f"{tokens[bos_id]} {single}", [(tokens[bos_id], int(bos_id))]
    if add_eos and eos_id is not None:
        single, specials = f"{single} {tokens[eos_id]}", specials + [(tokens[eos_id], int(eos_id))]
    if not specials:
        return processors.ByteLevel(trim_offsets=False) if metadata["tokenizer.ggml.model"] == "gpt2" else None
    return processors.TemplateProcessing(single=single, pair=f"{single} $B:1", special_tokens=list(dict(specials).items()))


def _special_token_names(metadata: dict, tokens: list[str]) -> dict[str, str]:
    names = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = _scalar(metadata, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            names[name] = tokens[token_id]
    return names


def eos_token_ids(metadata: dict) -> list[int]:
    """End-of-generation ids: eos, plus end-of-turn / end-of-message when the file names distinct ones."""
    ids = []
    for key in ("eos", "eot", "eom"):
        token_id = _scalar(metadata, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return ids


def write_tokenizer(metadata: dict, out_dir: Path) -> list[int]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the eos ids."""
    tokenizer = build_tokenizer(metadata)
    tokens = metadata["tokenizer.ggml.tokens"]
    tokenizer.save(str(out_dir / "tokenizer.json"))
    names = _special_token_names(metadata, tokens)
    arch = metadata.get("general.architecture", "llama")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "add_bos_token": bool(_scalar(metadata, "tokenizer.ggml.add_bos_token", metadata["tokenizer.ggml.model"] == "llama")),
        "add_eos_token": bool(_scalar(metadata, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(metadata, f"{arch}.context_length", 2048)),
    }
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", names)
    return eos_token_ids(metadata)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
