"""Convert a llama-architecture GGUF file (llama.cpp format) into an MLX model directory for mlx_lm."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import ConversionError, UnsupportedModel
from .gguf_header import BLOCK_LAYOUT, GGUFHeader, check_complete, read_header
from .gguf_tokenizer import check_tokenizer_supported, write_tokenizer

SUPPORTED_ARCHITECTURES = ("llama",)
# ggml types MLX loads natively: float types as is, legacy block quants as MLX affine quantization
# (group size 32; mx.load turns Q4_0/Q8_0's implicit zero point into an explicit bias).
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
GGUF_GROUP_SIZE = 32

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|scales|biases)$")


def convert_gguf(src: Path, out_dir: Path) -> dict:
    """Convert a GGUF file into an MLX model directory at out_dir (which exists and is empty)."""
    src, out_dir = Path(src), Path(out_dir)
    header = read_header(src)
    validate(header, src)
    weights, metadata = load_gguf(src, header)
    config = model_config(metadata, weights)
    mlx_weights = rename_weights(weights, config)
    quantization = quantization_config(header)
    if quantization:
        config["quantization"] = config["quantization_config"] = quantization
    eos_ids = write_tokenizer(metadata, out_dir)
    _write_model(out_dir, config, mlx_weights)
    _write_json(out_dir / "generation_config.json", generation_config(metadata, eos_ids))
    return {
        "kind": "text",
        "architecture": header.metadata["general.architecture"],
        "quantization": quantization_label(header),
        "context_length": config["max_position_embeddings"],
        "name_in_file": metadata.get("general.name") or None,
        "license": metadata.get("general.license") or None,
    }


def validate(header: GGUFHeader, src: Path) -> None:
    """Refuse, before loading any tensor, files that are cut short or that we cannot convert faithfully."""
    check_complete(header, src)
    architecture = header.metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(f"{src.name}: architecture {architecture!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    check_tensor_types(header, src)
    _check_llama_variant(header, src)
    check_tokenizer_supported(header.metadata)


def check_tensor_types(header: GGUFHeader, src: Path) -> None:
    bad = Counter(t.type_name for t in header.tensors.values() if t.type_name not in BLOCK_LAYOUT)
    if bad:
        kinds = ", ".join(f"{kind} ({n} tensors)" for kind, n in bad.most_common())
        raise UnsupportedModel(
            f"{src.name}: tensor type {kinds} is not supported; MLX converts only "
            f"{', '.join(BLOCK_LAYOUT)} (re-quantize the model as Q4_0, Q4_1, Q8_0 or F16)")


def _check_llama_variant(header: GGUFHeader, src: Path) -> None:
    meta = header.metadata
    # Mixtral is stored as architecture "llama" with experts; mlx_lm's llama model has no MoE.
    if int(meta.get("llama.expert_count", 0) or 0) > 0:
        raise UnsupportedModel(f"{src.name}: mixture-of-experts llama (llama.expert_count="
                               f"{meta['llama.expert_count']}) is not supported")
    # Llama 3.1+ stores its rope scaling only as a rope_freqs tensor, which mlx_lm's config cannot express.
    if "rope_freqs.weight" in header.tensors:
        raise UnsupportedModel(f"{src.name}: llama-3.1-style rope scaling (rope_freqs tensor) is not supported")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedModel(f"{src.name}: rope scaling {scaling!r} is not supported")


def load_gguf(src: Path, header: GGUFHeader) -> tuple[dict, dict]:
    try:
        weights, metadata = mx.load(str(src), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise ConversionError(f"{src.name}: MLX could not read the GGUF file: {exc}") from exc
    for info in header.tensors.values():
        # mx.load narrows BF16 to float16 (overflow beyond 65504); read those bytes ourselves.
        if info.type_name == "BF16":
            raw = np.fromfile(src, dtype=np.uint16, count=info.nbytes // 2, offset=info.start)
            weights[info.name] = mx.array(raw).view(mx.bfloat16).reshape(info.shape)
    return weights, metadata


def _meta(metadata: dict, key: str, default=None):
    value = metadata.get(key, default)
    if value is None:
        raise ConversionError(f"GGUF metadata lacks {key!r}, needed to build config.json")
    return value.item() if isinstance(value, mx.array) else value


def model_config(metadata: dict, weights: dict) -> dict:
    """Build mlx_lm's llama config.json content from the GGUF hyper-parameters."""
    heads = int(_meta(metadata, "llama.attention.head_count"))
    hidden = int(_meta(metadata, "llama.embedding_length"))
    # Older files lack llama.vocab_size; the embedding's row count is the same number.
    embedding = weights.get("token_embd.weight")
    vocab = _meta(metadata, "llama.vocab_size", embedding.shape[0] if embedding is not None else None)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(metadata, "llama.block_count")),
        "intermediate_size": int(_meta(metadata, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(metadata, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_meta(metadata, "llama.attention.key_length", hidden // heads)),
        # GGUF stores these as float32: print them as the decimal they were written from (1e-05, not 9.99e-06).
        "rms_norm_eps": _short_float(_meta(metadata, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _short_float(_meta(metadata, "llama.rope.freq_base", 10000.0)),
        # q/k rows are un-permuted in rename_weights, so the HF-style (non-interleaved) rope applies.
        "rope_traditional": False,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(_meta(metadata, "llama.context_length")),
        "tie_word_embeddings": "output.weight" not in weights,
    }
    if _meta(metadata, "llama.rope.scaling.type", "none") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(_meta(metadata, "llama.rope.scaling.factor"))}
    return config


def _short_float(value) -> float:
    return float(f"{float(value):.7g}")


def rename_weights(weights: dict, config: dict) -> dict:
    """Map GGUF tensor names to mlx-lm names, undoing llama.cpp's q/k rope row permutation."""
    renamed, unknown = {}, []
    for name, array in weights.items():
        match = _TENSOR_NAME.match(name)
        layer, base, suffix = match.groups() if match else (None, None, None)
        table = _PER_LAYER if layer is not None else _TOP_LEVEL
        if base not in table:
            unknown.append(name)
            continue
        prefix = f"model.layers.{layer}." if layer is not None else ""
        if base in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if base == "attn_q" else config["num_key_value_heads"]
            array = unpermute_rope_rows(array, heads)
        renamed[f"{prefix}{table[base]}.{suffix}"] = array
    if unknown:
        raise UnsupportedModel(f"unexpected tensors for a llama model: {', '.join(sorted(unknown)[:8])}")
    _check_all_present(renamed, config)
    return renamed


def _check_all_present(renamed: dict, config: dict) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    needed += [f"model.layers.{i}.{module}.weight" for i in range(config["num_hidden_layers"])
               for module in _PER_LAYER.values()]
    if not config["tie_word_embeddings"]:
        needed.append("lm_head.weight")
    missing = [name for name in needed if name not in renamed]
    if missing:
        raise ConversionError(f"GGUF lacks {len(missing)} tensors of a llama model, e.g. {', '.join(missing[:4])}")


def unpermute_rope_rows(array: mx.array, n_heads: int) -> mx.array:
    """Invert llama.cpp's convert permute: rows (i, d/2+i) of each head were interleaved as (2i, 2i+1).

    llama.cpp's "normal" rope rotates adjacent pairs, HF/mlx-lm's (traditional=False) rotates the two
    halves of each head, so llama.cpp reorders q/k output rows when converting. Rows are output
    features, so the same row shuffle applies to packed quantized weights, scales and biases alike.
    """
    rows = array.shape[0]
    head_rows = rows // n_heads
    rest = array.shape[1:]
    shuffled = array.reshape(n_heads, head_rows // 2, 2, *rest).swapaxes(1, 2)
    return shuffled.reshape(rows, *rest)


def _module_quantization(header: GGUFHeader) -> dict[str, str]:
    """Map each quantized GGUF tensor's module name (without .weight) to its ggml type."""
    return {name[: -len(".weight")]: info.type_name for name, info in header.tensors.items()
            if info.type_name in QUANT_BITS and name.endswith(".weight")}


def quantization_config(header: GGUFHeader) -> dict | None:
    """mlx_lm's "quantization" config: the commonest bits as default, per-module overrides for the rest."""
    modules = _module_quantization(header)
    if not modules:
        return None
    default_type = Counter(modules.values()).most_common(1)[0][0]
    config = {"group_size": GGUF_GROUP_SIZE, "bits": QUANT_BITS[default_type]}
    for module, kind in sorted(modules.items()):
        if QUANT_BITS[kind] != config["bits"]:
            config[_mlx_module_name(module)] = {"group_size": GGUF_GROUP_SIZE, "bits": QUANT_BITS[kind]}
    return config


def _mlx_module_name(gguf_module: str) -> str:
    match = _TENSOR_NAME.match(f"{gguf_module}.weight")
    layer, base, _ = match.groups()
    if layer is None:
        return _TOP_LEVEL[base]
    return f"model.layers.{layer}.{_PER_LAYER[base]}"


def quantization_label(header: GGUFHeader) -> str:
    """The exact storage type of the model's matrices: "Q4_0", "F16", or "mixed: Q4_1+Q8_0" (commonest first)."""
    # 1-D tensors (norms) are always F32 in GGUF and say nothing about the quantization.
    kinds = Counter(t.type_name for t in header.tensors.values() if len(t.shape) >= 2)
    ordered = [kind for kind, _ in kinds.most_common()]
    if len(ordered) == 1:
        return ordered[0]
    return "mixed: " + "+".join(ordered)


def _write_model(out_dir: Path, config: dict, weights: dict) -> None:
    try:
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    except (RuntimeError, ValueError) as exc:  # e.g. tensor data mx.load could not materialize
        raise ConversionError(f"could not write MLX weights: {exc}") from exc
    _write_json(out_dir / "config.json", config)


def generation_config(metadata: dict, eos_ids: list[int]) -> dict:
    config = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos.item())
    pad = metadata.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = int(pad.item())
    return config


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
