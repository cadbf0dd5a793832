"""Convert a CTranslate2 (faster-whisper) Whisper directory into an mlx-audio Whisper directory.

Input: model.bin (CTranslate2 `WhisperSpec`), tokenizer.json, optionally config.json and
vocabulary.txt/.json. Output, in the layout `mlx_audio.stt.load` expects:

* config.json            MLX-style dimensions (n_mels, n_audio_ctx, ...) and model_type "whisper"
* model.safetensors      weights under mlx-audio's names, source float dtype kept
* tokenizer.json, tokenizer_config.json, preprocessor_config.json
                         so mlx-audio's post-load hook can build a transformers WhisperProcessor
* generation_config.json alignment heads for word timestamps
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from workers.importers.ct2_reader import Ct2Model, read_ct2_model
from workers.importers.ct2_tokenizer import (
    generation_config,
    is_multilingual,
    write_json,
    write_tokenizer_files,
)
from workers.importers.errors import ConversionError, UnsupportedModel

SPEC_NAME = "WhisperSpec"
KNOWN_REVISIONS = (1, 2, 3)  # WhisperSpec revisions up to ctranslate2 4.x
_GELU = 3  # ctranslate2 common_spec.Activation.GELU
_QUANT_LABELS = {"float16": "F16", "float32": "F32", "bfloat16": "BF16"}


def convert_ct2_whisper(src: Path, out_dir: Path) -> dict:
    """Convert a CTranslate2 Whisper directory into an mlx-audio Whisper directory at out_dir (exists, empty)."""
    src, out_dir = Path(src), Path(out_dir)
    model_bin, tokenizer_path = _require_files(src)
    model = read_ct2_model(model_bin)
    _check_spec(model)
    dims = _dimensions(model)
    dtype = _weight_dtype(model)
    _check_encoder_positions(model, dims)
    _save_weights(_mlx_weights(model, dims), out_dir / "model.safetensors")
    write_json(out_dir / "config.json", {"model_type": "whisper", **dims})
    write_tokenizer_files(src, tokenizer_path, out_dir, dims)
    write_json(out_dir / "generation_config.json", generation_config(src, dims))
    return {"kind": "speech", "architecture": "whisper", "quantization": _QUANT_LABELS[dtype],
            "context_length": dims["n_text_ctx"], "n_mels": dims["n_mels"],
            "multilingual": is_multilingual(dims["n_vocab"])}


def _require_files(src: Path) -> tuple[Path, Path]:
    if not src.is_dir():
        raise ConversionError(f"{src} is not a directory")
    missing = [name for name in ("model.bin", "tokenizer.json") if not (src / name).is_file()]
    if missing:
        raise ConversionError(f"{src} is not a complete CTranslate2 Whisper model: missing {', '.join(missing)}")
    return src / "model.bin", src / "tokenizer.json"


def _check_spec(model: Ct2Model) -> None:
    if model.spec_name != SPEC_NAME:
        shown = model.spec_name or "(none: binary version 1)"
        raise UnsupportedModel(f"model.bin holds a CTranslate2 '{shown}' model, not a {SPEC_NAME}")
    if model.spec_revision not in KNOWN_REVISIONS:
        raise UnsupportedModel(f"{SPEC_NAME} revision {model.spec_revision} is not one this importer knows"
                               f" (revisions {KNOWN_REVISIONS[0]}-{KNOWN_REVISIONS[-1]})")
    activation = model.variables.get("decoder/activation")
    if activation is not None and int(activation) != _GELU:
        raise UnsupportedModel(f"decoder activation id {int(activation)} is not GELU")


def _count_layers(model: Ct2Model, stack: str) -> int:
    pattern = re.compile(rf"^{stack}/layer_(\d+)/")
    indices = {int(m.group(1)) for name in model.variables if (m := pattern.match(name))}
    if not indices or indices != set(range(len(indices))):
        raise ConversionError(f"model.bin has no contiguous {stack} layers (found {sorted(indices)})")
    return len(indices)


def _dimensions(model: Ct2Model) -> dict:
    conv1 = model.get("encoder/conv1/weight")  # (n_audio_state, n_mels, 3)
    embed = model.get("decoder/embeddings/weight")  # (n_vocab, n_text_state)
    return {
        "n_mels": int(conv1.shape[1]),
        "n_audio_ctx": int(model.get("encoder/position_encodings/encodings").shape[0]),
        "n_audio_state": int(conv1.shape[0]),
        "n_audio_head": int(model.get("encoder/num_heads")),
        "n_audio_layer": _count_layers(model, "encoder"),
        "n_vocab": int(embed.shape[0]),
        "n_text_ctx": int(model.get("decoder/position_encodings/encodings").shape[0]),
        "n_text_state": int(embed.shape[1]),
        "n_text_head": int(model.get("decoder/num_heads")),
        "n_text_layer": _count_layers(model, "decoder"),
    }


def _weight_dtype(model: Ct2Model) -> str:
    tensors = {name: model.dtypes[name] for name, value in model.variables.items() if value.ndim > 0}
    quantized = sorted(name for name, dtype in tensors.items() if dtype not in _QUANT_LABELS)
    if quantized:
        raise UnsupportedModel(f"quantized CTranslate2 weights are not supported ('{quantized[0]}' is"
                               f" {tensors[quantized[0]]}); convert the model with --quantization float16")
    return model.dtype_of("decoder/embeddings/weight")


def _sinusoids(length: int, channels: int) -> np.ndarray:
    """Whisper's sinusoidal encoder positions, as mlx-audio recomputes them at load time."""
    increment = np.log(10000) / (channels // 2 - 1)
    scaled = np.arange(length)[:, None] * np.exp(-increment * np.arange(channels // 2))[None, :]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1)


def _check_encoder_positions(model: Ct2Model, dims: dict) -> None:
    # mlx-audio never loads encoder positions (it recomputes sinusoids), so a model with
    # different stored positions would silently run with the wrong ones.
    stored = _as_float32(model, "encoder/position_encodings/encodings")
    expected = _sinusoids(dims["n_audio_ctx"], dims["n_audio_state"])
    if stored.shape != expected.shape or np.abs(stored - expected).max() > 1e-2:
        raise UnsupportedModel("encoder position encodings are not Whisper's sinusoids; mlx-audio cannot load them")


def _as_float32(model: Ct2Model, name: str) -> np.ndarray:
    array = model.get(name)
    if model.dtype_of(name) == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def _linear(model: Ct2Model, ct2: str, mlx: str) -> dict:
    out = {f"{mlx}.weight": model.get(f"{ct2}/weight")}
    if model.has(f"{ct2}/bias"):
        out[f"{mlx}.bias"] = model.get(f"{ct2}/bias")
    return out


def _layer_norm(model: Ct2Model, ct2: str, mlx: str) -> dict:
    return {f"{mlx}.weight": model.get(f"{ct2}/gamma"), f"{mlx}.bias": model.get(f"{ct2}/beta")}


def _split_fused(model: Ct2Model, ct2: str, mlx_names: list[str], state: int) -> dict:
    """Split a fused q/k/v (or k/v) projection, stacked along the output rows, into mlx-audio's linears."""
    weight = model.get(f"{ct2}/weight")
    bias = model.get(f"{ct2}/bias") if model.has(f"{ct2}/bias") else None
    if weight.shape != (state * len(mlx_names), state):
        raise ConversionError(f"'{ct2}/weight' has shape {weight.shape}, expected {(state * len(mlx_names), state)}")
    out = {}
    for index, name in enumerate(mlx_names):
        rows = slice(index * state, (index + 1) * state)
        out[f"{name}.weight"] = weight[rows]
        # Whisper's key projection has no bias (CTranslate2 stores zeros there); dropping any
        # key bias is exact anyway, since q.(k+b) shifts every score of a query equally.
        if bias is not None and not name.endswith(".key"):
            out[f"{name}.bias"] = bias[rows]
    return out


def _block(model: Ct2Model, ct2: str, mlx: str, state: int, cross: bool) -> dict:
    out = _layer_norm(model, f"{ct2}/self_attention/layer_norm", f"{mlx}.attn_ln")
    out |= _split_fused(model, f"{ct2}/self_attention/linear_0",
                        [f"{mlx}.attn.query", f"{mlx}.attn.key", f"{mlx}.attn.value"], state)
    out |= _linear(model, f"{ct2}/self_attention/linear_1", f"{mlx}.attn.out")
    if cross:
        out |= _layer_norm(model, f"{ct2}/attention/layer_norm", f"{mlx}.cross_attn_ln")
        out |= _linear(model, f"{ct2}/attention/linear_0", f"{mlx}.cross_attn.query")
        out |= _split_fused(model, f"{ct2}/attention/linear_1",
                            [f"{mlx}.cross_attn.key", f"{mlx}.cross_attn.value"], state)
        out |= _linear(model, f"{ct2}/attention/linear_2", f"{mlx}.cross_attn.out")
    out |= _layer_norm(model, f"{ct2}/ffn/layer_norm", f"{mlx}.mlp_ln")
    out |= _linear(model, f"{ct2}/ffn/linear_0", f"{mlx}.mlp1")
    out |= _linear(model, f"{ct2}/ffn/linear_1", f"{mlx}.mlp2")
    return out


def _mlx_weights(model: Ct2Model, dims: dict) -> dict[str, np.ndarray]:
    """All weights under mlx-audio's Whisper names (encoder positions are recomputed by mlx-audio)."""
    out = {}
    for conv in ("conv1", "conv2"):
        # CTranslate2 keeps PyTorch's (out, in, kernel); MLX's Conv1d wants (out, kernel, in).
        out[f"encoder.{conv}.weight"] = model.get(f"encoder/{conv}/weight").transpose(0, 2, 1)
        out[f"encoder.{conv}.bias"] = model.get(f"encoder/{conv}/bias")
    for i in range(dims["n_audio_layer"]):
        out |= _block(model, f"encoder/layer_{i}", f"encoder.blocks.{i}", dims["n_audio_state"], cross=False)
    out |= _layer_norm(model, "encoder/layer_norm", "encoder.ln_post")
    out["decoder.token_embedding.weight"] = model.get("decoder/embeddings/weight")
    out["decoder.positional_embedding"] = model.get("decoder/position_encodings/encodings")
    for i in range(dims["n_text_layer"]):
        out |= _block(model, f"decoder/layer_{i}", f"decoder.blocks.{i}", dims["n_text_state"], cross=True)
    out |= _layer_norm(model, "decoder/layer_norm", "decoder.ln")
    _check_tied_projection(model)
    return out


def _check_tied_projection(model: Ct2Model) -> None:
    # mlx-audio computes logits with the token embedding (as_linear): the output projection must be tied.
    if model.resolve("decoder/projection/weight") == model.resolve("decoder/embeddings/weight"):
        return
    if not np.array_equal(model.get("decoder/projection/weight"), model.get("decoder/embeddings/weight")):
        raise UnsupportedModel("the decoder output projection is not tied to the token embedding")


def _save_weights(weights: dict[str, np.ndarray], path: Path) -> None:
    arrays = {}
    for name, array in weights.items():
        array = mx.array(np.ascontiguousarray(array))
        # numpy has no bfloat16: the reader keeps its raw bits as uint16 (no other CTranslate2
        # dtype maps to uint16), and MLX reinterprets them.
        arrays[name] = array.view(mx.bfloat16) if array.dtype == mx.uint16 else array
    mx.save_safetensors(str(path), arrays, metadata={"format": "mlx"})
