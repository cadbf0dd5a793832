"""The demo vision-language model shapes-vlm-toy (built by `mlxq models pull-demo`), through mlx-vlm."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from workers.demo import shapes
from workers.demo.pull import DEMO_VLM

HELD_OUT_SEED = 1000  # training pictures come from seed 1 and the build's own checks from seeds 2 and 3
QUESTION = "What is in this image?"


@pytest.fixture(scope="module")
def vlm_dir(models_dir) -> Path:
    """The store entry, as pull-demo builds it."""
    path = Path(models_dir) / DEMO_VLM
    if not (path / "mlxq.json").is_file():
        pytest.fail(f"{DEMO_VLM} missing in {models_dir}: run `mlxq models pull-demo` first")
    return path


@pytest.fixture(scope="module")
def stored_model(vlm_dir):
    """(model, processor) from mlx_vlm.load, as stored (quantized)."""
    import mlx_vlm

    return mlx_vlm.load(str(vlm_dir))


@pytest.fixture(scope="module")
def float32_model(vlm_dir, stored_model):
    """The weights loaded again, upcast to float32 as the worker runs them on CPU, with the same processor
    (building a processor is most of a load; the weights alone take a fraction of a second)."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model
    from mlx_vlm.utils import load_model

    model = load_model(vlm_dir)
    dequantize_model(model)  # what the worker does on a CPU with a fast BLAS (and ~4x faster here)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, stored_model[1]


def _ask(model, processor, text: str, images: list[Path]) -> str:
    """mlx-vlm's own prompt building and greedy generation."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    prompt = apply_chat_template(processor, model.config, text, num_images=len(images))
    result = mlx_vlm.generate(model, processor, prompt, image=[str(p) for p in images] or None, max_tokens=16,
                              temperature=0.0, verbose=False)
    return result.text


def _ask_each(model, processor, text: str, images: list[Path]) -> list[str]:
    """One question about each picture, answered in one batch by mlx-vlm's batch_generate (its own prompt
    building; greedy, its default): one decoding pass for all of them, not one per picture."""
    import mlx_vlm

    result = mlx_vlm.batch_generate(model, processor, images=[str(p) for p in images],
                                    prompts=[text] * len(images), max_tokens=16, verbose=False)
    return result.texts


def _save(samples: list[shapes.Sample], directory: Path) -> list[Path]:
    paths = []
    for i, sample in enumerate(samples):
        paths.append(directory / f"{i}-{sample.colour}-{sample.shape}.png")
        sample.image.save(paths[-1])
    return paths


def test_names_the_colour_and_shape_of_held_out_pictures(float32_model, tmp_path):
    samples = shapes.samples(HELD_OUT_SEED, 16)  # every class once
    answers = _ask_each(*float32_model, QUESTION, _save(samples, tmp_path))
    wrong = [(s.colour, s.shape, a) for s, a in zip(samples, answers, strict=True)
             if not shapes.names_correctly(a, s.colour, s.shape)]
    assert len(wrong) <= 16 * 0.15, f"{len(wrong)}/16 wrong: {wrong}"


def test_the_stored_quantized_model_names_shapes_too(stored_model, tmp_path):
    samples = shapes.samples(HELD_OUT_SEED + 1, 2)
    answers = _ask_each(*stored_model, QUESTION, _save(samples, tmp_path))
    for sample, answer in zip(samples, answers, strict=True):
        assert shapes.names_correctly(answer, sample.colour, sample.shape), (sample, answer)


def test_answers_a_text_only_question(float32_model):
    answer = _ask(*float32_model, "What is the capital of France?", [])
    assert answer.strip(), "empty answer to a text-only question"
    assert "paris" in answer.lower(), answer


def test_two_pictures_in_one_prompt_are_both_named(float32_model, tmp_path):
    first, second = shapes.samples(HELD_OUT_SEED + 2, 2)
    answer = _ask(*float32_model, QUESTION, _save([first, second], tmp_path)).lower()
    for word in (first.colour, first.shape, second.colour, second.shape):
        assert word in answer, (first, second, answer)


def test_the_picture_generator_is_deterministic():
    def png_bytes(seed: int) -> list[bytes]:
        out = []
        for sample in shapes.samples(seed, 8):
            buffer = io.BytesIO()
            sample.image.save(buffer, format="PNG")
            out.append(buffer.getvalue())
        return out

    assert png_bytes(7) == png_bytes(7)
    assert png_bytes(7) != png_bytes(8)
    labels = [(s.colour, s.shape) for s in shapes.samples(7, 32)]
    assert sorted(labels) == sorted(shapes.CLASSES * 2)  # every class equally often


def test_the_manifest_and_readme_say_it_is_a_toy(vlm_dir):
    manifest = json.loads((vlm_dir / "mlxq.json").read_text())
    assert manifest["kind"] == "vision" and manifest["architecture"] == "idefics3"
    assert manifest["license"] == "Apache-2.0" and manifest["toy"] is True
    assert "toy" in manifest["description"].lower()
    readme = (vlm_dir / "README.md").read_text()
    assert "toy" in readme.lower() and all(word in readme for word in (*shapes.SHAPES, *shapes.COLOURS))
