"""Build an idefics3 (SmolVLM-family) model directory with random weights in a real shape (GPU benchmarks).

The lent GPU machine reaches no hub; random weights run at the speed of trained ones. The template is
the toy VLM that `mlxq models pull-demo` builds (its tokenizer, chat template and processor files);
the shape defaults to SmolVLM-500M-Instruct's (text 960 wide x 32 layers, SigLIP 768 x 12 at 512
pixels, pixel shuffle 4: 64 image tokens per image, no image splitting):

    python bench/make_random_vlm.py --template ~/.cache/mlxq/models/shapes-vlm-toy --out /tmp/smolvlm500m
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.random_model import save, scale_down  # noqa: E402

SMOLVLM_500M = {
    "text": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
             "num_key_value_heads": 5, "head_dim": 64, "rope_theta": 100000.0, "max_position_embeddings": 8192},
    "vision": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
               "patch_size": 16, "image_size": 512},
    "scale_factor": 4,
}
_PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "chat_template.json", "generation_config.json", "added_tokens.json")


def build(template: Path, out: Path, shape: dict, dtype: str, tiles: bool = False) -> Path:
    """Write config, processor files and random weights of `shape` to `out`; with `tiles`, a processor that splits
    a picture into tiles of the tower's size plus the whole picture at that size, up to 4 tiles a side (SmolVLM's
    processors split pictures so; without, a picture is one image of the tower's size)."""
    import mlx.core as mx
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = json.loads((template / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config["text_config"].update(shape["text"])
    config["vision_config"].update(shape["vision"])
    config["scale_factor"] = shape["scale_factor"]
    vision = shape["vision"]
    image_tokens = (vision["image_size"] // vision["patch_size"]) ** 2 // shape["scale_factor"] ** 2

    model_class, _ = get_model_and_args(config=config)
    model_config = update_module_configs(model_class.ModelConfig.from_dict(config), model_class, config,
                                         ["text", "vision"])
    model = model_class.Model(model_config)
    model.set_dtype(getattr(mx, dtype))
    scale_down(model)
    _never_special(model, template)
    save(model, config, out, template, _PROCESSOR_FILES)
    preprocessor = json.loads((template / "preprocessor_config.json").read_text())
    preprocessor["size"] = preprocessor["max_image_size"] = {"longest_edge": vision["image_size"]}
    if tiles:
        preprocessor["size"], preprocessor["do_image_splitting"] = {"longest_edge": 4 * vision["image_size"]}, True
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    processor = json.loads((template / "processor_config.json").read_text())
    processor["image_seq_len"] = image_tokens
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return out


def _never_special(model, template: Path) -> None:
    """Give the output layer its default scale (logits far from bf16's rounding, so argmax has no ties)
    and zero the rows of the special tokens (end of turn, end of text...): with random weights the
    greedy answer could otherwise end after a token or two, and decode speed needs long answers."""
    import mlx.core as mx

    added = json.loads((template / "tokenizer.json").read_text()).get("added_tokens", [])
    ids = mx.array(sorted({token["id"] for token in added}))
    head = model.language_model.lm_head
    head.weight = (head.weight * 50).at[ids].multiply(0)


def main() -> None:
    """Parse arguments and build the model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", type=Path, required=True, help="an idefics3 model directory (the toy VLM)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiles", action="store_true", help="split pictures into tiles (a 1536x1024 one: 12 + 1, 832 image tokens)")
    args = parser.parse_args()
    print(build(args.template, args.out, SMOLVLM_500M, args.dtype, args.tiles))


if __name__ == "__main__":
    main()
