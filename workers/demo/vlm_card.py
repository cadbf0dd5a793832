"""What the demo VLM says about itself: its store manifest facts and the README.md in its directory."""

from __future__ import annotations

import json
from pathlib import Path

from . import shapes, vlm_tower

DESCRIPTION = ("A toy vision-language model: it names ONE coloured shape in a picture (circle, square, "
               "triangle or star; red, green, blue or yellow, on a plain neutral background) and knows "
               "nothing else about images. Text-only chat is SmolLM2-135M-Instruct's.")
LICENSE = "Apache-2.0"  # SmolLM2's; the vision side is built by mlxq, from nothing but generated pictures


def manifest_facts(text_model_dir: Path, check_accuracy: float, verified: int, verify_images: int,
                   seconds: float) -> dict:
    """Facts for the store manifest (mlxq.json), in the shape the other demo models use."""
    text_manifest = text_model_dir / "mlxq.json"
    text_facts = json.loads(text_manifest.read_text()) if text_manifest.is_file() else {}
    text_config = json.loads((text_model_dir / "config.json").read_text())
    text_quantization = text_facts.get("quantization") or ("quantized" if "quantization" in text_config
                                                            else "none")
    image_tokens = vlm_tower.GRID**2 // vlm_tower.SCALE_FACTOR**2
    return {
        "kind": "vision",
        "architecture": "idefics3",
        "quantization": f"{text_quantization} (language model), F32 (vision)",
        "context_length": text_config.get("max_position_embeddings"),
        "license": LICENSE,
        "description": DESCRIPTION,
        "toy": True,
        "knows": {"shapes": list(shapes.SHAPES), "colours": list(shapes.COLOURS)},
        "language_model": text_facts.get("name") or text_model_dir.name,
        "image_size": vlm_tower.IMAGE_SIZE,
        "image_tokens_per_image": image_tokens,
        "check_accuracy": round(check_accuracy, 4),
        "verified": f"{verified}/{verify_images} held-out images named correctly by mlx_vlm.generate",
        "build_seconds": round(seconds, 1),
    }


def readme(facts: dict) -> str:
    """README.md for the model directory: what it is, how it was made, what it cannot do."""
    shapes_list = ", ".join(facts["knows"]["shapes"])
    colours_list = ", ".join(facts["knows"]["colours"])
    return f"""# shapes-vlm-toy

{facts["description"]}

It exists so that mlxq's vision path (mlx-vlm) can be tested and demonstrated offline, without
downloading a real vision-language model. Do not use it for anything else.

- Shapes: {shapes_list}. Colours: {colours_list}. Ask "What is in this image?"; it answers like
  "A red circle.". Two images in one prompt: "A red circle and a blue star.". Other questions about
  a picture mostly get that same answer; text-only chat is the language model's own.
- Architecture: mlx-vlm `idefics3` (the SmolVLM family). Language model: {facts["language_model"]}
  (SmolLM2-135M-Instruct), weights unchanged except the rows of the four idefics3 special tokens
  (`<fake_token_around_image>` and `<global-img>` learned, `<image>` and `<end_of_utterance>` set to the
  mean embedding; their output rows are the mean embedding, so the model never writes them).
- Images: one {facts["image_size"]}x{facts["image_size"]} tile (no splitting), \
{facts["image_tokens_per_image"]} image tokens per image.
- Vision tower: a small SigLIP-style encoder whose lower layers are wired by hand (colour-free
  silhouette, its area and perimeter, colour evidence) and whose classifier layer is trained; the
  connector maps each of the 16 classes to four image-token embeddings learned through the frozen
  language model (prompt tuning). See workers/demo/vlm_tower.py and vlm_train.py in mlxq.
- Training data: synthetic pictures from workers/demo/shapes.py (deterministic seeds).
- Check at build time: {facts["verified"]}; image tokens of the right class on
  {facts["check_accuracy"]:.1%} of check images. Built in {facts["build_seconds"]} s.
- Quantization: {facts["quantization"]}.
- License: {facts["license"]} (SmolLM2-135M-Instruct by Hugging Face).

Out of distribution (expect wrong or odd answers): photographs, several shapes in one picture,
other shapes or colours, busy or coloured backgrounds, anything that is not a single flat shape.
"""
