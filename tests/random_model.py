"""MLX model directories with random weights from a real config: another text model for tests, and the
bigger shapes of the GPU benchmarks (no hub there; random weights run at the speed of trained ones).
From the command line, with shape overrides: `python bench/make_random_model.py --help`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def build(config_dir: Path, out: Path, overrides: dict, dtype: str) -> Path:
    """Write config, tokenizer and random weights of the given shape to `out`."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    config = json.loads((config_dir / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config.update({k: v for k, v in overrides.items() if v is not None})
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    scale_down(model)
    return save(model, config, out, config_dir, TOKENIZER_FILES)


def scale_down(model) -> None:
    """Default init gives unit-scale logits; scale the matrices so sampling is not degenerate."""
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p * 0.02 if p.ndim > 1 else p, model.parameters()))


def save(model, config: dict, out: Path, source_dir: Path, files: tuple[str, ...]) -> Path:
    """Write the model's weights and config to `out`, with those of `files` that `source_dir` has."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in files:
        if (source_dir / name).exists():
            shutil.copy(source_dir / name, out / name)
    return out

