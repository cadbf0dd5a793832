"""Build an MLX model directory with random weights from a real config (GPU benchmarks: no hub there).

Random weights run at the same speed as trained ones; shape overrides make bigger models from a
small model's config and tokenizer:

    python bench/make_random_model.py --config-dir CFG --out /tmp/m1b --hidden 2048 --layers 16 \
        --heads 32 --kv-heads 8 --intermediate 8192 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def build(config_dir: Path, out: Path, overrides: dict, dtype: str) -> Path:
    """Write config, tokenizer and random weights of the given shape to `out`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes

    config = json.loads((config_dir / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config.update({k: v for k, v in overrides.items() if v is not None})
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    # Default init gives unit-scale logits; scale the weights so sampling is not degenerate.
    model.update(tree_map(lambda p: p * 0.02 if p.ndim > 1 else p, model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (config_dir / name).exists():
            shutil.copy(config_dir / name, out / name)
    return out


def main() -> None:
    """Parse arguments and build the model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, dest="hidden_size")
    parser.add_argument("--layers", type=int, dest="num_hidden_layers")
    parser.add_argument("--heads", type=int, dest="num_attention_heads")
    parser.add_argument("--kv-heads", type=int, dest="num_key_value_heads")
    parser.add_argument("--intermediate", type=int, dest="intermediate_size")
    parser.add_argument("--dtype", default="bfloat16")
    args = vars(parser.parse_args())
    config_dir, out, dtype = args.pop("config_dir"), args.pop("out"), args.pop("dtype")
    print(build(config_dir, out, args, dtype))


if __name__ == "__main__":
    main()
