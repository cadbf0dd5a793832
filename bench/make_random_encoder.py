"""Make an embedding model with random weights in a real encoder's shape, for the lent GPU machine (no hub, no
registry): a sentence-transformers folder's small files (config, tokenizer, pooling) copied from CONFIG_DIR, and
model.safetensors written from mlx-embeddings' module of that architecture, randomly initialized. Random weights
encode at the speed of trained ones; their vectors mean nothing.

    python bench/make_random_encoder.py --config-dir ~/.cache/mlxq/models/minilm-l6 --out /tmp/minilm
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "modules.json",
               "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-dir", type=Path, required=True, help="a sentence-transformers folder (its small files)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.utils import _get_classes

    args.out.mkdir(parents=True, exist_ok=True)
    for name in SMALL_FILES:
        if (args.config_dir / name).is_file():
            (args.out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(args.config_dir / name, args.out / name)
    config = json.loads((args.out / "config.json").read_text())
    model_class, args_class, _, _ = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(args.out / "model.safetensors"), weights, metadata={"format": "pt"})
    print(f"{args.out}: {sum(v.size for v in weights.values()) / 1e6:.1f} M random parameters")


if __name__ == "__main__":
    main()
