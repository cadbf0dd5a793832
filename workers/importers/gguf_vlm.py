"""Convert a llama.cpp vision model (language GGUF + mmproj GGUF) into an mlx-vlm model directory.

Supported: the Idefics3 / SmolVLM family (llama.cpp projector type "idefics3"), whose language part
is a llama GGUF (converted by the text importer's logic, q/k rope rows un-permuted) and whose vision
tower and connector live in the mmproj (see gguf_mmproj.py). The directory loads with
`mlx_vlm.load(path)` offline: config.json, model.safetensors, tokenizer and processor files.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx

from .errors import ConversionError, UnsupportedModel
from .gguf import (
    GGUF_GROUP_SIZE,
    generation_config,
    load_gguf,
    model_config,
    quantization_config,
    quantization_label,
    rename_weights,
    validate,
)
from .gguf_header import read_header
from .gguf_mmproj import Mmproj, read_mmproj
from .gguf_tokenizer import write_tokenizer

# Tokens mlx-vlm's Idefics3Processor builds image prompts from; it adds any missing one as a new id,
# which would lie past the embedding matrix, so the language model's vocabulary must have them.
IMAGE_TOKENS = ("<image>", "<fake_token_around_image>", "<end_of_utterance>", "<global-img>")
_TEXT_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "num_hidden_layers", "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings")


def convert_gguf_vlm(model_gguf: Path, mmproj_gguf: Path, out_dir: Path) -> dict:
    """Convert a language GGUF and its mmproj GGUF into an mlx-vlm directory at out_dir (exists, empty)."""
    model_gguf, mmproj_gguf, out_dir = Path(model_gguf), Path(mmproj_gguf), Path(out_dir)
    header = read_header(model_gguf)
    if header.metadata.get("general.architecture") == "clip":
        raise ConversionError(f"{model_gguf.name} is an mmproj (vision projector) file: pass it as the mmproj "
                              "and the language model GGUF as the model")
    validate(header, model_gguf)
    mmproj = read_mmproj(mmproj_gguf)
    hidden = header.metadata.get("llama.embedding_length")
    if hidden is None:
        raise ConversionError(f"{model_gguf.name}: GGUF metadata lacks 'llama.embedding_length'")
    check_pair(int(hidden), mmproj, model_gguf, mmproj_gguf)  # before loading the (large) language weights
    weights, metadata = load_gguf(model_gguf, header)
    llm = model_config(metadata, weights)
    text_config = _text_config(llm, model_gguf)
    language, text_quantization = language_weights(rename_weights(weights, llm), quantization_config(header))
    quantization = merge_quantization(text_quantization, mmproj.quantized_modules)
    config = {
        "model_type": "idefics3",
        "architectures": ["Idefics3ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": mmproj.vision_config,
        "scale_factor": mmproj.scale_factor,
        "image_token_id": image_token_id(metadata, model_gguf),
        "vocab_size": text_config["vocab_size"],
        "tie_word_embeddings": False,
    }
    if quantization:
        config["quantization"] = config["quantization_config"] = quantization
    eos_ids = write_tokenizer(metadata, out_dir)
    config["eos_token_id"] = eos_ids
    _write_processor_files(out_dir, mmproj)
    _write_model(out_dir, config, {**language, **mmproj.weights})
    _write_json(out_dir / "generation_config.json", generation_config(metadata, eos_ids))
    return {
        "kind": "vision",
        "architecture": "idefics3",
        "quantization": f"{quantization_label(header)} (vision: {mmproj.quantization})",
        "context_length": text_config["max_position_embeddings"],
        "name_in_file": metadata.get("general.name") or None,
        "license": metadata.get("general.license") or None,
    }


def check_pair(hidden: int, mmproj: Mmproj, model_gguf: Path, mmproj_gguf: Path) -> None:
    """ConversionError unless the mmproj projects image features to the language model's width (hidden)."""
    fc_rows = mmproj.weights["connector.modality_projection.proj.weight"].shape[0]
    if mmproj.projection_dim != hidden or fc_rows != hidden:
        raise ConversionError(
            f"{mmproj_gguf.name} projects image features to {mmproj.projection_dim} dims but the language model "
            f"{model_gguf.name} has hidden size {hidden}: these files are not a pair (use the mmproj published "
            "with this model)")


def _text_config(llm: dict, src: Path) -> dict:
    """mlx-vlm's idefics3 text_config from the text importer's llama config."""
    # mlx-vlm's idefics3 language model derives head_dim from the width and has no rope scaling.
    if llm["head_dim"] * llm["num_attention_heads"] != llm["hidden_size"]:
        raise UnsupportedModel(f"{src.name}: head size {llm['head_dim']} x {llm['num_attention_heads']} heads "
                               f"!= width {llm['hidden_size']}, which mlx-vlm's idefics3 cannot express")
    if "rope_scaling" in llm:
        raise UnsupportedModel(f"{src.name}: rope scaling is not supported by mlx-vlm's idefics3")
    # q/k rows are un-permuted by rename_weights, so the half-split (non-traditional) rope applies.
    return {"model_type": "llama", **{key: llm[key] for key in _TEXT_KEYS},
            "rope_traditional": False, "tie_word_embeddings": False}


def language_weights(mlx_lm_weights: dict, quantization: dict | None) -> tuple[dict, dict | None]:
    """Move mlx-lm names under mlx-vlm's `language_model.`; give a tied model its own lm_head."""
    renamed = {_vlm_name(name): array for name, array in mlx_lm_weights.items()}
    quantization = dict(quantization) if quantization else None
    if "language_model.lm_head.weight" not in renamed:
        # mlx-vlm's idefics3 always projects through lm_head: a tied GGUF reuses the embedding (same rows,
        # same quantization) as the output matrix.
        for part in ("weight", "scales", "biases"):
            if f"language_model.embed_tokens.{part}" in renamed:
                renamed[f"language_model.lm_head.{part}"] = renamed[f"language_model.embed_tokens.{part}"]
        if quantization and "model.embed_tokens" in quantization:
            quantization["lm_head"] = quantization["model.embed_tokens"]
    if quantization:
        quantization = {_vlm_name(key): value for key, value in quantization.items()}
    return renamed, quantization


def merge_quantization(text: dict | None, vision: dict[str, int]) -> dict | None:
    """One mlx-vlm "quantization" config: the language model's, plus entries for quantized vision layers."""
    if not text and not vision:
        return None
    config = dict(text) if text else {"group_size": GGUF_GROUP_SIZE,
                                      "bits": Counter(vision.values()).most_common(1)[0][0]}
    for module, bits in sorted(vision.items()):
        if bits != config["bits"]:
            config[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
    return config


def _vlm_name(name: str) -> str:
    if name.startswith("model."):
        return "language_model." + name[len("model."):]
    if name == "lm_head" or name.startswith("lm_head."):
        return "language_model." + name
    return name  # group_size, bits


def image_token_id(metadata: dict, src: Path) -> int:
    """The id of "<image>"; ConversionError when the vocabulary lacks the idefics3 image tokens."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    index = {token: i for i, token in reversed(list(enumerate(tokens)))}
    missing = [token for token in IMAGE_TOKENS if token not in index]
    if missing:
        raise ConversionError(f"{src.name}: the vocabulary lacks {', '.join(missing)}; this is not the language "
                              "model of a SmolVLM / Idefics3 pair")
    return index["<image>"]


def _write_processor_files(out_dir: Path, mmproj: Mmproj) -> None:
    """preprocessor_config.json (image processor) and processor_config.json (image tokens per image)."""
    _write_json(out_dir / "preprocessor_config.json", mmproj.image_processor)
    _write_json(out_dir / "processor_config.json",
                {"processor_class": "Idefics3Processor", "image_seq_len": mmproj.image_seq_len})


def _write_model(out_dir: Path, config: dict, weights: dict) -> None:
    try:
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    except (RuntimeError, ValueError) as exc:
        raise ConversionError(f"could not write MLX weights: {exc}") from exc
    _write_json(out_dir / "config.json", config)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
