"""Build an MLX model directory with random weights from a real config (GPU benchmarks: no hub there).

Random weights run at the same speed as trained ones; shape overrides make bigger models from a
small model's config and tokenizer (the builder is tests/random_model.py):

    python bench/make_random_model.py --config-dir CFG --out /tmp/m1b --hidden 2048 --layers 16 \\
        --heads 32 --kv-heads 8 --intermediate 8192 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.random_model import build  # noqa: E402


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
