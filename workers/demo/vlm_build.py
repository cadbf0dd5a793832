"""Build mlxq's demo vision-language model, "shapes-vlm-toy": a toy that names one coloured shape.

It is a real mlx-vlm `idefics3` (SmolVLM-family) model: the language model is the smollm2-135m demo
model, unchanged (same quantized weights) except for the rows of four new special tokens; the small
SigLIP-style vision tower (vlm_tower.py) and the pixel-shuffle connector are built and trained here
(vlm_train.py), in about two minutes on a CPU, on synthetic images (shapes.py). It knows 4 shapes in
4 colours and nothing else.

Building runs in a child process (`python -m workers.demo.vlm_build TEXT_DIR OUT_DIR FACTS`) so
that it can preload the fast BLAS that workers.platform picks: a process that has already loaded
mlx (the CLI has, to convert the text model) cannot swap it, and training would be ~25x slower.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from workers.importers.errors import ConversionError

from . import vlm_card, vlm_tower

STORE_NAME = "shapes-vlm-toy"
IMAGE_SIZE, SCALE_FACTOR = vlm_tower.IMAGE_SIZE, vlm_tower.SCALE_FACTOR
IMAGE_TOKENS = vlm_tower.GRID**2 // SCALE_FACTOR**2
"""Image tokens per image the language model sees: 8x8 patches, pixel-shuffled by 4x4 into 2x2."""
# The idefics3 processor's tokens (it adds the first three itself if missing: added here so their ids
# are fixed), then the global-image tag it writes before each image, as a single token.
FAKE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMG = (
    "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
NEW_TOKENS = (FAKE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMG)
# SmolLM2's own ChatML, without its default system prompt (20 tokens of prompt per request on a
# 135M model), and with image parts: the processor expands each <image> into the image tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
VERIFY_IMAGES = 8  # held-out pictures that mlx-vlm must name before the build succeeds
BUILD_TIMEOUT_S = 900  # the build takes ~2 minutes on 2 CPU cores; a hung child must not hang pull-demo
_LM_PREFIX = "language_model."


def build_demo_vlm(text_model_dir: Path, out_dir: Path, log: Callable[[str], None] | None = None) -> dict:
    """Build the toy VLM into out_dir from the smollm2-135m model directory; return the manifest facts."""
    log = log or (lambda message: None)
    from workers.platform import choose_blas

    env = choose_blas().env(os.environ)
    with tempfile.TemporaryDirectory(prefix="mlxq-demo-vlm-") as scratch:
        facts_path, errors_path = Path(scratch) / "facts.json", Path(scratch) / "stderr.txt"
        command = [sys.executable, "-m", "workers.demo.vlm_build", str(text_model_dir), str(out_dir),
                   str(facts_path)]
        with open(errors_path, "w+") as errors:
            code = _run_streaming(command, env, errors, log)
            errors.seek(0)
            tail = errors.read()[-2000:]
        if code != 0 or not facts_path.is_file():
            raise ConversionError(f"building {STORE_NAME} failed (exit {code}): {tail.strip()}")
        return json.loads(facts_path.read_text())


def _run_streaming(command: list[str], env: dict, errors, log: Callable[[str], None]) -> int:
    """Run `command`, passing each stdout line to `log`; kill it after BUILD_TIMEOUT_S."""
    root = Path(__file__).resolve().parents[2]  # the repository root, so `-m workers...` resolves
    process = subprocess.Popen(command, env=env, cwd=root, stdout=subprocess.PIPE, stderr=errors, text=True)
    timer = threading.Timer(BUILD_TIMEOUT_S, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            log(f"{STORE_NAME}: {line.rstrip()}")
        return process.wait()
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        timer.cancel()


def assemble(text_model_dir: Path, out_dir: Path) -> dict:
    """Write config, tokenizer, processor files and weights (vision tower not trained yet); return config."""
    text_config = json.loads((text_model_dir / "config.json").read_text())
    token_ids = write_tokenizer(text_model_dir, out_dir)
    config = model_config(text_config, token_ids)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "preprocessor_config.json", preprocessor_config())
    _write_json(out_dir / "processor_config.json", {"processor_class": "Idefics3Processor",
                                                    "image_seq_len": IMAGE_TOKENS})
    generation = json.loads((text_model_dir / "generation_config.json").read_text())
    _write_json(out_dir / "generation_config.json", generation)
    write_weights(text_model_dir, out_dir, config)
    return config


def write_tokenizer(text_model_dir: Path, out_dir: Path) -> dict[str, int]:
    """Save the text model's tokenizer with the idefics3 special tokens added; return their ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(text_model_dir))
    base_size = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(NEW_TOKENS)})
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in NEW_TOKENS}
    if sorted(ids.values()) != list(range(base_size, base_size + len(NEW_TOKENS))):
        raise ConversionError(f"the text model's tokenizer already has some of {NEW_TOKENS}: {ids}")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # what mlx-vlm's processor reads
    return ids


def model_config(text_config: dict, token_ids: dict[str, int]) -> dict:
    """config.json of the idefics3 model around the text model's llama config."""
    vocab_size = text_config["vocab_size"] + len(NEW_TOKENS)
    text_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "num_hidden_layers", "rms_norm_eps", "rope_theta", "rope_traditional",
                 "max_position_embeddings")
    lm = {"model_type": "llama", **{k: text_config[k] for k in text_keys if k in text_config},
          "vocab_size": vocab_size, "tie_word_embeddings": False}  # lm_head is written out (mlx-vlm needs it)
    tied = text_config.get("tie_word_embeddings", True)
    quantization = _quantization(text_config.get("quantization"), tied)
    config = {"architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3",
              "image_token_id": token_ids[IMAGE_TOKEN], "scale_factor": SCALE_FACTOR,
              "vocab_size": vocab_size,
              "eos_token_id": [text_config.get("eos_token_id", 2)], "text_config": lm,
              "vision_config": vlm_tower.vision_config()}
    if quantization:
        config["quantization"] = quantization
    return config


def _quantization(text_quantization: dict | None, tied: bool) -> dict | None:
    """The text model's quantization with its per-module entries renamed into the language model."""
    if not text_quantization:
        return None
    renamed = {}
    for key, value in text_quantization.items():
        if isinstance(value, dict):
            renamed[_LM_PREFIX + key.removeprefix("model.")] = value
        else:
            renamed[key] = value
    # The tied output layer becomes a copy of the embedding table, quantized as the table is.
    if tied and f"{_LM_PREFIX}embed_tokens" in renamed:
        renamed[f"{_LM_PREFIX}lm_head"] = dict(renamed[f"{_LM_PREFIX}embed_tokens"])
    return renamed


def preprocessor_config() -> dict:
    """The idefics3 image processor settings: one 64x64 image, no splitting, normalized to [-1, 1]."""
    return {"image_processor_type": "Idefics3ImageProcessor", "do_convert_rgb": True, "do_resize": True,
            "size": {"longest_edge": IMAGE_SIZE}, "max_image_size": {"longest_edge": IMAGE_SIZE},
            "resample": 1, "do_image_splitting": False, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True}


def write_weights(text_model_dir: Path, out_dir: Path, config: dict) -> None:
    """model.safetensors: the text model's tensors renamed, new token rows, the wired vision tower."""
    import mlx.core as mx

    text = mx.load(str(text_model_dir / "model.safetensors"))
    weights = {_LM_PREFIX + k.removeprefix("model."): v for k, v in text.items()}
    quantization = config.get("quantization") or {}
    embed = f"{_LM_PREFIX}embed_tokens"
    table = _rows(weights, embed, quantization)
    new_rows = mx.broadcast_to(table.mean(axis=0), (len(NEW_TOKENS), table.shape[1]))
    if f"{_LM_PREFIX}lm_head.weight" not in weights:  # tied: the output layer is the table itself
        for suffix in ("weight", "scales", "biases"):
            if f"{embed}.{suffix}" in weights:
                weights[f"{_LM_PREFIX}lm_head.{suffix}"] = weights[f"{embed}.{suffix}"]
    # New rows get the mean embedding: a neutral input until training sets the two it uses, and an
    # output logit no higher than average, so the model never writes these tokens.
    for name in (embed, f"{_LM_PREFIX}lm_head"):
        append_rows(weights, name, new_rows, quantization.get(name, quantization))
    # The wired tower without its trained parts (vlm_train fills them in).
    weights.update({k: mx.array(v) for k, v in vlm_tower.wire().items()})
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})


def _rows(weights: dict, name: str, quantization: dict):
    """The float rows of a (possibly quantized) weight matrix."""
    import mlx.core as mx

    if f"{name}.scales" not in weights:
        return weights[f"{name}.weight"].astype(mx.float32)
    q = quantization.get(name, quantization)
    return mx.dequantize(weights[f"{name}.weight"], weights[f"{name}.scales"], weights.get(f"{name}.biases"),
                         q["group_size"], q["bits"]).astype(mx.float32)


def append_rows(weights: dict, name: str, rows, quantization: dict) -> None:
    """Append float `rows` to weight matrix `name`, quantizing them as the matrix is (old rows untouched)."""
    import mlx.core as mx

    if f"{name}.scales" not in weights:
        old = weights[f"{name}.weight"]
        weights[f"{name}.weight"] = mx.concatenate([old, rows.astype(old.dtype)])
        return
    packed = mx.quantize(rows, quantization["group_size"], quantization["bits"])
    for suffix, part in zip(("weight", "scales", "biases"), packed, strict=True):
        old = weights[f"{name}.{suffix}"]
        weights[f"{name}.{suffix}"] = mx.concatenate([old, part.astype(old.dtype)])


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def replace_rows(weights: dict, name: str, rows: dict[int, np.ndarray], quantization: dict) -> None:
    """Overwrite rows `rows` ({row: float vector}) of weight matrix `name`, quantized as the matrix is."""
    import mlx.core as mx

    index = mx.array(sorted(rows))
    vectors = mx.array(np.stack([rows[i] for i in sorted(rows)]))
    if f"{name}.scales" not in weights:
        weights[f"{name}.weight"][index] = vectors.astype(weights[f"{name}.weight"].dtype)
        return
    packed = mx.quantize(vectors, quantization["group_size"], quantization["bits"])
    for suffix, part in zip(("weight", "scales", "biases"), packed, strict=True):
        weights[f"{name}.{suffix}"][index] = part.astype(weights[f"{name}.{suffix}"].dtype)


def save_trained(out_dir: Path, config: dict, result: dict) -> None:
    """Write the trained tower, connector and learned token rows into model.safetensors (atomically)."""
    import mlx.core as mx

    path = out_dir / "model.safetensors"
    weights = dict(mx.load(str(path)))
    weights.update({k: mx.array(v) for k, v in result["tower"].items()})
    embed = f"{_LM_PREFIX}embed_tokens"
    quantization = config.get("quantization") or {}
    replace_rows(weights, embed, result["token_rows"], quantization.get(embed, quantization))
    tmp = path.with_name(".model-partial.safetensors")  # hidden from mlx-vlm's *.safetensors glob
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    os.replace(tmp, path)


def _main(argv: list[str]) -> int:
    """Child process: assemble, train, save, verify; write the manifest facts to argv[2]."""
    from . import vlm_train

    text_dir, out_dir, facts_path = (Path(arg) for arg in argv)
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {message}", flush=True)

    log("assembling config, tokenizer, processor and weights from the text model")
    config = assemble(text_dir, out_dir)
    import mlx_vlm

    model, processor = mlx_vlm.load(str(out_dir))
    result = vlm_train.train(model, processor, vlm_train.Settings(), log)
    del model
    save_trained(out_dir, config, result)
    right = vlm_train.verify(out_dir, VERIFY_IMAGES, log)
    if right < VERIFY_IMAGES - 1:
        raise ConversionError(f"the trained model named only {right}/{VERIFY_IMAGES} check images correctly")
    facts = vlm_card.manifest_facts(text_dir, result["check_accuracy"], right, VERIFY_IMAGES,
                                   time.monotonic() - started)
    (out_dir / "README.md").write_text(vlm_card.readme(facts), encoding="utf-8")
    facts_path.write_text(json.dumps(facts))
    log(f"done: {right}/{VERIFY_IMAGES} check images named correctly")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
