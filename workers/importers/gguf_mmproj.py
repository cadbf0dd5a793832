"""Read a llama.cpp multimodal projector ("mmproj") GGUF of the Idefics3 / SmolVLM family for mlx-vlm.

llama.cpp's convert_hf_to_gguf.py (SmolVLMModel, an MmprojModel) writes the SigLIP-style vision tower
and the pixel-shuffle connector of an Idefics3 model into a separate GGUF of architecture "clip",
with hyper-parameters under `clip.vision.*` and tensor names from gguf-py's MODEL_TENSOR table
(v.patch_embd, v.blk.N.attn_q, ..., mm.model.fc). We map them back to mlx-vlm's idefics3 names.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .errors import ConversionError, UnsupportedModel
from .gguf import QUANT_BITS, check_tensor_types, load_gguf
from .gguf_header import GGUFHeader, check_complete, read_header

SUPPORTED_PROJECTORS = ("idefics3",)

_TOP_LEVEL = {
    "v.patch_embd": "vision_model.embeddings.patch_embedding",
    "v.position_embd": "vision_model.embeddings.position_embedding",
    "v.post_ln": "vision_model.post_layernorm",
    "mm.model.fc": "connector.modality_projection.proj",
}
# gguf-py maps SigLIP's mlp.fc1 to ffn_up and mlp.fc2 to ffn_down for SmolVLM (tensor_mapping.py).
_PER_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
}
# mx.load returns a quantized GGUF tensor X.weight as MLX's X.weight (packed), X.scales and X.biases.
_TENSOR_NAME = re.compile(r"^(?:v\.blk\.(\d+)\.(\w+)|([\w.]+?))\.(weight|bias|scales|biases)$")


@dataclass(frozen=True)
class Mmproj:
    """What the converter needs from an mmproj file: mlx-vlm config pieces and renamed weights."""

    vision_config: dict
    scale_factor: int
    projection_dim: int
    image_processor: dict  # Idefics3ImageProcessor settings (preprocessor_config.json)
    image_seq_len: int  # image tokens per image (or per tile) after the pixel shuffle
    weights: dict
    quantized_modules: dict[str, int]  # mlx-vlm module path -> bits, for Q4_0/Q4_1/Q8_0 matrices
    quantization: str


def read_mmproj(path: Path) -> Mmproj:
    """Validate and load an idefics3 mmproj GGUF; UnsupportedModel for other projector types."""
    path = Path(path)
    header = read_header(path)
    _validate(header, path)
    meta = header.metadata
    vision_config = _vision_config(meta, path)
    scale = _scale_factor(header, vision_config["hidden_size"], path)
    per_side = vision_config["image_size"] // vision_config["patch_size"]
    if vision_config["image_size"] % vision_config["patch_size"] or per_side % scale:
        raise ConversionError(f"{path.name}: image size {vision_config['image_size']} is not a multiple of "
                              f"patch size {vision_config['patch_size']} x scale factor {scale}")
    _check_shapes(header, vision_config, per_side, path)
    raw, arrays = load_gguf(path, header)
    quantized = {_mlx_name(name, path).rsplit(".", 1)[0]: QUANT_BITS[info.type_name]
                 for name, info in header.tensors.items() if info.type_name in QUANT_BITS}
    return Mmproj(
        vision_config=vision_config, scale_factor=scale,
        projection_dim=int(_get(meta, "clip.vision.projection_dim", path)),
        image_processor=_image_processor(meta, arrays, vision_config["image_size"], path),
        image_seq_len=(per_side // scale) ** 2, weights=rename_vision_weights(raw, path),
        quantized_modules=quantized, quantization=_label(header),
    )


def projector_type(metadata: dict) -> str | None:
    """The projector type of an mmproj (mixed-modality files name it per modality; old LLaVA files not at all)."""
    named = metadata.get("clip.projector_type") or metadata.get("clip.vision.projector_type")
    return named or ("mlp" if metadata.get("clip.has_llava_projector") else None)


def _validate(header: GGUFHeader, path: Path) -> None:
    check_complete(header, path)
    meta = header.metadata
    if meta.get("general.architecture") != "clip":
        raise ConversionError(f"{path.name} is not an mmproj file (architecture "
                              f"{meta.get('general.architecture')!r}, expected 'clip')")
    if not meta.get("clip.has_vision_encoder", False):
        raise UnsupportedModel(f"{path.name}: the mmproj has no vision encoder (audio-only projectors are "
                               "not supported)")
    kind = projector_type(meta)
    if kind not in SUPPORTED_PROJECTORS:
        raise UnsupportedModel(f"{path.name}: projector type {kind!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED_PROJECTORS)}, i.e. SmolVLM / Idefics3)")
    check_tensor_types(header, path)
    for name in header.tensors:
        _mlx_name(name, path)  # refuse tensors we would not know where to put, before loading any


def _get(metadata: dict, key: str, path: Path):
    value = metadata.get(key)
    if value is None:
        raise ConversionError(f"{path.name}: mmproj metadata lacks {key!r}")
    return value


def _vision_config(meta: dict, path: Path) -> dict:
    """mlx-vlm's idefics3 vision_config (SigLIP) from clip.vision.* keys."""
    hidden = int(_get(meta, "clip.vision.embedding_length", path))
    heads = int(_get(meta, "clip.vision.attention.head_count", path))
    if hidden % heads:
        raise ConversionError(f"{path.name}: vision width {hidden} is not divisible by {heads} heads")
    return {
        "model_type": "idefics3_vision",
        "hidden_size": hidden,
        "intermediate_size": int(_get(meta, "clip.vision.feed_forward_length", path)),
        "num_hidden_layers": int(_get(meta, "clip.vision.block_count", path)),
        "num_attention_heads": heads,
        "patch_size": int(_get(meta, "clip.vision.patch_size", path)),
        "image_size": int(_get(meta, "clip.vision.image_size", path)),
        "num_channels": 3,
        # Idefics3VisionConfig's default; llama.cpp writes the model's own value when it has one.
        "layer_norm_eps": float(f"{float(meta.get('clip.vision.attention.layer_norm_epsilon', 1e-6)):.7g}"),
    }


def _scale_factor(header: GGUFHeader, hidden: int, path: Path) -> int:
    """The pixel-shuffle factor: the connector's input is hidden * scale**2 wide (checked against metadata)."""
    fc = header.tensors.get("mm.model.fc.weight")
    if fc is None or len(fc.shape) != 2:
        raise ConversionError(f"{path.name}: mmproj lacks mm.model.fc.weight (the idefics3 connector)")
    scale = math.isqrt(fc.shape[1] // hidden)
    if scale < 1 or scale * scale * hidden != fc.shape[1]:
        raise ConversionError(f"{path.name}: connector input width {fc.shape[1]} is not vision width {hidden} "
                              "times a square scale factor")
    declared = header.metadata.get("clip.vision.projector.scale_factor")
    if declared is not None and int(declared) != scale:
        raise ConversionError(f"{path.name}: clip.vision.projector.scale_factor is {declared} but the connector "
                              f"weight implies {scale}")
    return scale


def _image_processor(meta: dict, arrays: dict, image_size: int, path: Path) -> dict:
    """Idefics3ImageProcessor settings: mean/std from the file; tiles of image_size up to the preproc edge."""
    stats = {}
    for key in ("image_mean", "image_std"):
        value = arrays.get(f"clip.vision.{key}")
        if value is None or value.size != 3:
            raise ConversionError(f"{path.name}: mmproj metadata lacks a 3-value clip.vision.{key}")
        stats[key] = [float(f"{v:.7g}") for v in value.tolist()]
    # llama.cpp slices images into image_size tiles only when the file names a longest edge to resize to.
    longest = int(meta.get("clip.vision.preproc_image_size") or image_size)
    return {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "do_normalize": True, "do_pad": True,
        "do_image_splitting": longest > image_size,
        "size": {"longest_edge": longest},
        "max_image_size": {"longest_edge": image_size},
        "resample": 1,  # PIL LANCZOS, as transformers' Idefics3 processor and llama.cpp's both use
        "rescale_factor": 1 / 255,
        **stats,
    }


def _mlx_name(name: str, path: Path) -> str:
    """mlx-vlm's name for one llama.cpp mmproj tensor (or one part of it); UnsupportedModel if unknown."""
    match = _TENSOR_NAME.match(name)
    layer, base, top, suffix = match.groups() if match else (None, None, None, None)
    if layer is not None and base in _PER_LAYER:
        return f"vision_model.encoder.layers.{layer}.{_PER_LAYER[base]}.{suffix}"
    if top in _TOP_LEVEL:
        return f"{_TOP_LEVEL[top]}.{suffix}"
    raise UnsupportedModel(f"{path.name}: unexpected tensor {name!r} for an idefics3 mmproj")


def rename_vision_weights(weights: dict, path: Path) -> dict:
    """Map llama.cpp mmproj tensor names to mlx-vlm idefics3 names (patch conv to MLX's channels-last)."""
    renamed = {}
    for name, array in weights.items():
        if name == "v.patch_embd.weight":
            array = array.transpose(0, 2, 3, 1)  # stored (out, in, kh, kw) as in PyTorch; MLX wants (out, kh, kw, in)
        renamed[_mlx_name(name, path)] = array
    return renamed


def _check_shapes(header: GGUFHeader, config: dict, per_side: int, path: Path) -> None:
    """ConversionError when a tensor is missing or disagrees with the clip.vision.* hyper-parameters."""
    hidden, ffn, patch = config["hidden_size"], config["intermediate_size"], config["patch_size"]
    expected = {
        "v.patch_embd.weight": (hidden, config["num_channels"], patch, patch),
        "v.position_embd.weight": (per_side * per_side, hidden),
        "v.post_ln.weight": (hidden,),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"v.blk.{layer}."
        for module in ("attn_q", "attn_k", "attn_v", "attn_out"):
            expected[f"{prefix}{module}.weight"] = (hidden, hidden)
        expected[f"{prefix}ffn_up.weight"] = (ffn, hidden)
        expected[f"{prefix}ffn_down.weight"] = (hidden, ffn)
        expected[f"{prefix}ln1.weight"] = expected[f"{prefix}ln2.weight"] = (hidden,)
    for name, shape in expected.items():
        info = header.tensors.get(name)
        if info is None:
            raise ConversionError(f"{path.name}: mmproj lacks tensor {name}")
        if info.shape != shape:
            raise ConversionError(f"{path.name}: {name} has shape {info.shape}, expected {shape} "
                                  "from the clip.vision.* metadata")


def _label(header: GGUFHeader) -> str:
    """Storage type of the mmproj's matrices, commonest first (llama.cpp always keeps the embeddings F32)."""
    kinds = Counter(t.type_name for t in header.tensors.values()
                    if len(t.shape) >= 2 and not t.name.startswith(("v.patch_embd.", "v.position_embd.")))
    return "+".join(kind for kind, _ in kinds.most_common())
