"""Train the demo VLM so that an image of a coloured shape makes the frozen language model name it.

Two trained parts, both small enough for a few CPU minutes:
  1. Prompt tuning (language model in the loop, all 16 classes each step): for each class, the four
     image-token embeddings after which the model answers "A red circle.", starting from the
     embeddings of the words " a red circle."; noise is added on the way so that nearby inputs work
     too. Pairs of images in one prompt are taught too ("A red circle and a blue star."). The two
     special tokens that frame every image are learned here as well.
  2. The vision tower's classifier (vlm_tower: the layers below it are wired, see why there), on
     image-level area, perimeter and colour features of synthetic training images. The connector then
     maps each class to its tuned embeddings.
Then `verify` asks mlx-vlm itself (load + generate, weights as stored) about held-out pictures.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten

from . import shapes, vlm_tower

QUESTION = "What is in this image?"
TRAIN_SEED = 1  # shapes.samples seed of the training images; the checks and tests use other seeds
CHECK_SEED = 2
VERIFY_SEED = 3


@dataclass(frozen=True)
class Settings:
    """Training knobs, measured on 2 CPU cores."""

    seed: int = 0
    prompt_steps: int = 15
    prompt_lr: float = 0.02
    prompt_noise: float = 0.05  # per element; token embeddings have a per-element std of ~0.13
    train_images: int = 1280
    readout_steps: int = 1500
    readout_lr: float = 0.01
    check_images: int = 256


@dataclass(frozen=True)
class Layout:
    """Token ids of a chat prompt with images, where its image tokens are, and the special token ids."""

    ids: np.ndarray  # (L,) the prompt as the processor expands it
    image_starts: tuple[int, ...]  # first image token of each image (each image's tokens are contiguous)
    image_tokens: int  # per image
    special: dict[int, str]  # token id -> name of the learned embedding for it ("fake", "glob")


def prompt_layout(model, processor, images: int) -> Layout:
    """The exact prompt mlx-vlm builds for QUESTION about `images` images."""
    from mlx_vlm.prompt_utils import apply_chat_template

    prompt = apply_chat_template(processor, model.config, QUESTION, num_images=images)
    pictures = [sample.image for sample in shapes.samples(0, images)]
    ids = np.array(processor(text=[prompt], images=pictures)["input_ids"]).reshape(-1)
    where = np.flatnonzero(ids == model.config.image_token_id)
    per_image = len(where) // images
    tokenizer = processor.tokenizer
    special = {tokenizer.convert_tokens_to_ids(processor.fake_image_token): "fake",
               tokenizer.convert_tokens_to_ids(processor.global_image_tag): "glob"}
    return Layout(ids, tuple(int(i) for i in where[::per_image]), per_image, special)


def answer_ids(tokenizer, colour: str, shape: str) -> list[int]:
    """Token ids of the taught answer, end-of-turn included."""
    return list(tokenizer.encode(shapes.answer(colour, shape) + "<|im_end|>", add_special_tokens=False))


def pair_answer_ids(tokenizer, first: int, second: int) -> list[int]:
    """Token ids of the taught answer for two images of classes `first` and `second`."""
    text = shapes.pair_answer(shapes.CLASSES[first], shapes.CLASSES[second]) + "<|im_end|>"
    return list(tokenizer.encode(text, add_special_tokens=False))


def embed_prompt(lm, layout: Layout, extra_ids: mx.array, image_embeds: mx.array, learned: dict) -> mx.array:
    """Input embeddings of prompt + extra_ids per row, with image tokens (B, images, N, D) and learned
    special tokens filled in."""
    batch = extra_ids.shape[0]
    ids = mx.concatenate([mx.broadcast_to(mx.array(layout.ids), (batch, len(layout.ids))), extra_ids], axis=1)
    x = lm.embed_tokens(ids)
    for token, name in layout.special.items():
        x = mx.where((ids == token)[..., None], learned[name], x)
    parts, end = [], 0
    for i, start in enumerate(layout.image_starts):
        parts += [x[:, end:start], image_embeds[:, i].astype(x.dtype)]
        end = start + layout.image_tokens
    return mx.concatenate([*parts, x[:, end:]], axis=1)


def answer_loss(lm, x: mx.array, targets: mx.array) -> mx.array:
    """Cross-entropy of `targets` (the last targets.shape[1] tokens) given input embeddings x (B, L, D)."""
    h = x[:, :-1]  # the last answer token is only a target
    for layer in lm.layers:
        h = layer(h, "causal", None)
    logits = lm.lm_head(lm.norm(h[:, -targets.shape[1]:]))
    return nn.losses.cross_entropy(logits, targets).mean()


def tune_prompts(lm, tokenizer, layouts: tuple[Layout, Layout], settings: Settings,
                 log) -> tuple[mx.array, dict]:
    """Stage 1: per-class image-token embeddings (16, N, D) and the learned special-token embeddings.

    Each step sees all 16 classes alone, and 16 random pairs of different classes as two images in
    one prompt (taught to answer "A red circle and a blue star.")."""
    single, double = layouts
    table = lm.embed_tokens.weight
    words = [tokenizer.encode(f" a {c} {s}.", add_special_tokens=False) for c, s in shapes.CLASSES]
    init = [np.resize(np.array(w), single.image_tokens) for w in words]  # repeat/trim to N tokens
    params = {"prompts": table[mx.array(np.stack(init))],
              "fake": table[tokenizer.encode("\n", add_special_tokens=False)[0]],
              "glob": table.mean(axis=0)}
    answers = mx.array([answer_ids(tokenizer, *label) for label in shapes.CLASSES])
    rng = np.random.default_rng(settings.seed)

    def loss_fn(params, noise, pairs, pair_answers):
        prompts = params["prompts"] + noise
        alone = embed_prompt(lm, single, answers, prompts[:, None], params)
        two = embed_prompt(lm, double, pair_answers, prompts[pairs], params)
        return answer_loss(lm, alone, answers) + answer_loss(lm, two, pair_answers)

    optimizer = optim.Adam(learning_rate=settings.prompt_lr)
    grad_fn = mx.value_and_grad(loss_fn)
    for step in range(settings.prompt_steps):
        noise = mx.random.normal(params["prompts"].shape) * settings.prompt_noise
        first = rng.permutation(len(shapes.CLASSES))
        second = (first + rng.integers(1, len(shapes.CLASSES), len(first))) % len(shapes.CLASSES)
        pairs = np.stack([first, second], axis=1)
        pair_answers = mx.array([pair_answer_ids(tokenizer, a, b) for a, b in pairs])
        loss, grads = grad_fn(params, noise, mx.array(pairs), pair_answers)
        params = optimizer.apply_gradients(grads, params)
        mx.eval(params, loss)
        log(f"prompt tuning {step + 1}/{settings.prompt_steps}: loss {loss.item():.3f}")
    return params["prompts"], {"fake": params["fake"], "glob": params["glob"]}


def install_tower(model, readout: dict | None = None, prompts: np.ndarray | None = None) -> None:
    """Put the wired vision tower (and, once known, classifier and connector) into the model."""
    weights = vlm_tower.wire(readout, prompts)
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))


def pooled_features(model, images: list, batch: int = 64) -> np.ndarray:
    """The classifier's inputs (area, perimeter, 4 colour sums; image means) for each image: (N, 6)."""
    tower, out = model.vision_model, []
    for i in range(0, len(images), batch):
        h = tower.embeddings(mx.array(shapes.pixel_batch(images[i:i + batch])))
        for layer in tower.encoder.layers[:3]:
            h = layer(h)
        pool = tower.encoder.layers[3]
        h = h + pool.self_attn(pool.layer_norm1(h))
        out.append(np.array(h[:, 0, vlm_tower.POOLED_FEATURES]))
    return np.concatenate(out)


class Readout(nn.Module):
    """The classifier as trained here: standardized features -> GELU -> 4 colour + 4 shape logits."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(vlm_tower.READOUT_FEATURES, vlm_tower.READOUT_HIDDEN)
        self.out = nn.Linear(vlm_tower.READOUT_HIDDEN, vlm_tower.READOUT_OUTPUTS)

    def __call__(self, x):
        return self.out(nn.gelu(self.hidden(x)))


def fit_readout(features: np.ndarray, labels: np.ndarray, settings: Settings, log) -> dict[str, np.ndarray]:
    """Stage 2: train the classifier (cross-entropy for colour, and for shape); return weights and scaling."""
    mean, std = features.mean(axis=0), features.std(axis=0) + 1e-6
    x = mx.array((features - mean) / std)
    colour, shape = (mx.array(part) for part in np.divmod(labels, len(shapes.SHAPES)))

    def loss_fn(model):
        logits = model(x)
        colour_loss = nn.losses.cross_entropy(logits[:, :4], colour)
        return (colour_loss + nn.losses.cross_entropy(logits[:, 4:], shape)).mean()

    readout = Readout()
    optimizer = optim.Adam(learning_rate=settings.readout_lr)
    grad_fn = nn.value_and_grad(readout, loss_fn)
    for step in range(settings.readout_steps):
        loss, grads = grad_fn(readout)
        optimizer.update(readout, grads)
        mx.eval(readout.parameters(), optimizer.state, loss)
        if (step + 1) % 500 == 0:
            log(f"classifier step {step + 1}/{settings.readout_steps}: loss {loss.item():.4f}")
    params = {"w1": readout.hidden.weight, "b1": readout.hidden.bias, "w2": readout.out.weight,
              "b2": readout.out.bias}
    return {**{k: np.array(v) for k, v in params.items()}, "mean": mean, "std": std}


def image_embeds(model, images: list) -> mx.array:
    """Connector output (B, N, D) for PIL images, as the model computes it."""
    hidden, *_ = model.vision_model(mx.array(shapes.pixel_batch(images)))
    return model.connector(hidden)


def nearest_accuracy(model, prompts: mx.array, check: list[shapes.Sample]) -> float:
    """Share of images whose image tokens are nearest to their own class's tuned embeddings."""
    embeds = mx.concatenate([image_embeds(model, [s.image for s in check[i:i + 64]])
                             for i in range(0, len(check), 64)])
    distance = ((embeds[:, None] - prompts[None]) ** 2).sum(axis=(2, 3))  # (images, classes)
    predicted = np.array(mx.argmin(distance, axis=1))
    return float(np.mean(predicted == np.array([s.label for s in check])))


def train(model, processor, settings: Settings, log: Callable[[str], None]) -> dict:
    """Run both stages on a loaded model (language model float32); return the new weights and a report."""
    from mlx_lm.utils import dequantize_model

    mx.random.seed(settings.seed)
    dequantize_model(model.language_model)  # gradients through the LM; the stored LM stays quantized
    model.language_model.set_dtype(mx.float32)
    model.freeze()
    layouts = (prompt_layout(model, processor, 1), prompt_layout(model, processor, 2))
    prompts, specials = tune_prompts(model.language_model, processor.tokenizer, layouts, settings, log)
    install_tower(model)
    train_set = shapes.samples(TRAIN_SEED, settings.train_images)
    features = pooled_features(model, [s.image for s in train_set])
    readout = fit_readout(features, np.array([s.label for s in train_set]), settings, log)
    install_tower(model, readout, np.array(prompts))
    accuracy = nearest_accuracy(model, prompts, shapes.samples(CHECK_SEED, settings.check_images))
    log(f"image tokens nearest to the right class on {settings.check_images} check images: {accuracy:.1%}")
    specials = {token: np.array(specials[name]) for token, name in layouts[0].special.items()}
    return {"tower": vlm_tower.wire(readout, np.array(prompts)), "token_rows": specials,
            "check_accuracy": accuracy}


def verify(out_dir: Path, count: int, log: Callable[[str], None]) -> int:
    """How many of `count` held-out images mlx-vlm's own load and generate name correctly (as stored)."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = mlx_vlm.load(str(out_dir))
    prompt = apply_chat_template(processor, model.config, QUESTION, num_images=1)
    right = 0
    with tempfile.TemporaryDirectory(prefix="mlxq-vlm-check-") as scratch:
        for i, sample in enumerate(shapes.samples(VERIFY_SEED, count)):
            path = Path(scratch) / f"{i}.png"
            sample.image.save(path)
            text = mlx_vlm.generate(model, processor, prompt, image=[str(path)], max_tokens=16,
                                    temperature=0.0, verbose=False).text
            right += shapes.names_correctly(text, sample.colour, sample.shape)
            log(f"check {i + 1}/{count}: {sample.colour} {sample.shape} -> {text.strip()!r}")
    return right
