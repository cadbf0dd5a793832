"""Chats on a vision model in its text batch: mlx-vlm reads the images, mlx-lm's decoding does the rest.

A chat on a vision model decodes in that model's text batch (workers/backends/textbatch.py) beside
the others. Its prompt is rendered and its images read by the model's processor on a preparing
thread (`prepare`); on the MLX thread, the prompt-processing turn that first reaches an image runs
the vision tower and merges its output into the prompt's embeddings (mlx-vlm's own
`get_input_embeddings`), which the turns feed in place of token ids; from its first token on it is
a sequence like any other. The language model runs as its mlx-lm twin (`twin`): mlx-lm's
implementation of the same architecture holding the VLM's own weights (the same arrays, no copy),
so the batch's caches, padding, prompt cache and quantized KV caches work as they do for text.

Only models whose language part is a plain causal LM over the merged embeddings are twinned
(TWINNED; idefics3/SmolVLM). One whose positions depend on the image (Qwen2-VL's multimodal RoPE),
or whose twin would not compute what mlx-vlm computes (checked once, on a few tokens), is not:
its chats run alone, as before (workers/backends/multimodal.py).

A prompt with images is cached under its images' digest (`Media.namespace`): a later chat with the
same images and the same leading text resumes from it, vision tower included (`cached_tokens`); the
same text with other images never does.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tokenizer_utils import TokenizerWrapper  # noqa: TC002 (a dataclass field's type)
from mlx_lm.utils import _get_classes

from workers.backends import prepare as preparing
from workers.backends import textgen, vision

TWINNED = frozenset({"idefics3", "smolvlm"})
"""The VLM architectures whose language model decodes as its mlx-lm twin: image features merged into the
embeddings, then a plain causal LM with positions 0, 1, 2... (the tests compare the twin with mlx-vlm)."""

ASKED = 256
"""Prompts with images whose token ids a vision model's batch remembers (ids only: a few KB each)."""

CHECK_TOLERANCE = 1e-2
"""How far the twin's logits may be from mlx-vlm's language model on the check's few tokens (float16 and
bfloat16 weights round differently in two implementations of the same sums)."""


@dataclass(eq=False)
class VisionModel:
    """A resident vision model as its text batch uses it."""

    vlm: nn.Module  # mlx-vlm's model: the vision tower, the connector, the language model
    processor: object
    model: nn.Module  # the language model's mlx-lm twin (shares the VLM's weights)
    tokenizer: TokenizerWrapper
    image_token: int | None
    asked: OrderedDict = field(default_factory=OrderedDict)  # (images' digest, prompt) -> ids, the latest ASKED

    def remember(self, key: tuple, ids: list[int]) -> None:
        """Keep a prompt's ids, for a repeat to be prepared without reading its images (the preparing threads add
        and drop whole entries: each a single operation of the dict's, under Python's lock)."""
        self.asked[key] = ids
        while len(self.asked) > ASKED:
            self.asked.popitem(last=False)

    def embeddings(self, ids: list[int], media: Media) -> mx.array:
        """The prompt's input embeddings (1, L, D), its images' features merged in (runs the vision tower)."""
        return self.embeddings_many([(ids, media)])[0]

    def embeddings_many(self, prompts: list[tuple[list[int], Media]]) -> list[mx.array]:
        """Several prompts' input embeddings (each 1, L, D) from one call of the vision tower for all their images:
        called prompt by prompt, mlx-vlm's idefics3 evaluates each prompt's images on its own (it reads a mask of
        them back), and a pass of 15 image prompts took 323 ms on an H200. The prompts' ids are padded with a
        token that is not an image's, their images with all-zero ones, which idefics3 leaves out."""
        for _, media in prompts:
            if media.pixel_values is None:  # read again: its cached prefix was gone by the time it joined
                inputs = media.read()
                media.pixel_values, media.extra = inputs["pixel_values"], vision.extra_inputs(inputs)
        dtype = self.model.model.embed_tokens(mx.array([0])).dtype
        if len(prompts) == 1 or any({*m.extra} != {"pixel_attention_mask"} for _, m in prompts):
            return [self._embeddings(mx.array(ids)[None], media.pixel_values, media.extra).astype(dtype)
                    for ids, media in prompts]  # one, or inputs it cannot stack: each on its own
        width = max(len(ids) for ids, _ in prompts)
        count = max(media.pixel_values.shape[1] for _, media in prompts)
        pad = 0 if self.image_token != 0 else 1
        ids = mx.array([ids + [pad] * (width - len(ids)) for ids, _ in prompts])
        pixels = mx.concatenate([_padded(media.pixel_values, count) for _, media in prompts])
        extra = {key: mx.concatenate([_padded(media.extra[key], count) for _, media in prompts])
                 for key in prompts[0][1].extra}
        embeds = self._embeddings(ids, pixels, extra).astype(dtype)
        return [embeds[i:i + 1, :len(row)] for i, (row, _) in enumerate(prompts)]

    def _embeddings(self, ids: mx.array, pixels: mx.array, extra: dict) -> mx.array:
        """mlx-vlm's merged input embeddings (B, L, D) of these ids and pictures."""
        out = self.vlm.get_input_embeddings(ids, pixels, **extra)
        return getattr(out, "inputs_embeds", out)


@dataclass(eq=False)
class Media:
    """A prompt's images as the model takes them, and the digest that keys its cached prefix."""

    pixel_values: mx.array | None  # None: not read (its prompt's images are in the prompt cache); `read` reads them
    extra: dict  # the model's other image inputs (a pixel mask, image sizes...)
    digest: str  # of the image files' bytes: the same pictures, whatever URL or format they came from
    read: Callable[[], dict] | None = None  # the processor's inputs for the prompt, images read

    def namespace(self, key: str) -> str:
        """The prompt cache's key for this prompt's entries, under the batch's `key`."""
        return f"{key}#images:{self.digest}"


def _padded(images: mx.array, count: int) -> mx.array:
    """A prompt's images (1, N, ...) padded with all-zero ones to `count`."""
    missing = count - images.shape[1]
    return images if not missing else mx.concatenate([images, mx.zeros((1, missing, *images.shape[2:]), images.dtype)],
                                                     axis=1)


@dataclass(eq=False)
class Pending:
    """An image prompt's input embeddings, not computed yet: computed at the turn that needs them, with those of the
    other image prompts of its pass (`many`)."""

    model: VisionModel
    ids: list[int]
    media: Media

    def __call__(self) -> mx.array:
        return self.model.embeddings(self.ids, self.media)

    @staticmethod
    def many(pending: list[Pending]) -> list[mx.array]:
        """The embeddings of several pending prompts of one model, from one call of its vision tower."""
        return pending[0].model.embeddings_many([(p.ids, p.media) for p in pending])


def for_resident(resident) -> VisionModel | None:
    """The vision model of a resident as a batch uses it (made once per resident); None when its chats must
    run alone."""
    if not hasattr(resident, "vision_batch"):
        resident.vision_batch = _vision_model(resident.model, resident.processor)
    return resident.vision_batch


def _vision_model(vlm, processor) -> VisionModel | None:
    if getattr(vlm.config, "model_type", None) not in TWINNED or not hasattr(vlm, "get_input_embeddings"):
        return None
    model = twin(vlm.language_model)
    if model is None or not _same_logits(vlm.language_model, model):
        return None
    return VisionModel(vlm, processor, model, vision.text_tokenizer(processor),
                       getattr(vlm.config, "image_token_index", None))


def twin(language_model: nn.Module) -> nn.Module | None:
    """mlx-lm's model of `language_model`'s architecture, holding its modules (weights shared, quantized or
    not); None when mlx-lm has no such architecture or the two do not hold the same parts."""
    config = language_model.config
    args = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    theirs = {path: module for path, module in
              tree_flatten(language_model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module))
              if tree_flatten(module.parameters())}
    args["tie_word_embeddings"] = "lm_head" not in theirs  # its own head, if it has one (the same values if tied)
    try:
        model_class, args_class = _get_classes({"model_type": args.get("model_type")})
        model = model_class(args_class.from_dict(args))
    except (ValueError, ImportError, TypeError, KeyError):
        return None
    mine = [path for path, module in tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module))
            if tree_flatten(module.parameters())]
    found = {path: theirs.get(path, theirs.get(path.removeprefix("model."))) for path in mine}
    if any(module is None for module in found.values()) or len(found) != len(theirs):
        return None
    model.update_modules(tree_unflatten(list(found.items())))
    model.eval()
    return model


def _same_logits(language_model: nn.Module, model: nn.Module) -> bool:
    """Whether the twin computes what mlx-vlm's language model does from the same embeddings."""
    ids = mx.array([[1, 2, 3, 4]])
    embeds = model.model.embed_tokens(ids)
    theirs = language_model(ids, inputs_embeds=embeds)
    theirs = getattr(theirs, "logits", theirs)
    mine = model(ids, input_embeddings=embeds).astype(mx.float32)
    theirs = theirs.astype(mx.float32)
    return bool((mx.max(mx.abs(theirs - mine)) <= CHECK_TOLERANCE * (1 + mx.max(mx.abs(theirs)))).item())


def digest(paths: list[str]) -> str:
    """A digest of image files' bytes, in order."""
    sha = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            sha.update(hashlib.sha256(f.read()).digest())
    return sha.hexdigest()[:32]


def prepare(request, model: VisionModel, vocab: int, kv_per_token: int, kv_memory: Callable[[], int],
            cached: Callable[[Media, list[int]], int] = lambda media, ids: 0) -> preparing.Prepared:
    """A chat on a vision model prepared for its batch (on a preparing thread): the prompt rendered by the
    model's processor with its images read, checked against the context and counted against KV memory.
    `cached(media, ids)`: how many of the prompt's tokens the prompt cache holds for these images (Media). A
    prompt asked before whose images the prompt cache holds is not read again: its ids are remembered."""
    prompt = vision.chat_prompt(model.vlm, model.processor, request.messages, len(request.images), 0, request.tools)

    def read() -> dict:
        return vision.model_inputs(model.vlm, model.processor, prompt, request.images, [])

    media = Media(None, {}, digest(request.images), read) if request.images else None
    key = (media.digest, prompt) if media else None
    ids = model.asked.get(key) if key else None
    if ids is None or cached(media, ids) <= last_image_token(ids, model.image_token):
        inputs = read()  # (the processor: decoding, resizing, tiling; ~40 ms for a 512-pixel picture on a GPU host)
        ids = inputs["input_ids"].reshape(-1).tolist()
        if media is not None and inputs.get("pixel_values") is not None:
            media.pixel_values, media.extra = inputs["pixel_values"], vision.extra_inputs(inputs)
            model.remember(key, ids)
        elif media is not None:  # a processor that took no pixels (none of its images is a picture it reads)
            media = None
    budget = textgen.token_budget(len(ids), request.sampling.max_tokens, request.model.context_length)
    prepared = preparing.checked([(ids, budget)], request, kv_per_token, kv_memory, model.tokenizer, vocab)
    prepared.media = [media]
    return prepared


def last_image_token(ids: list[int], image_token: int | None) -> int:
    """The position of the prompt's last image token (-1: none)."""
    if image_token is None:
        return -1
    return max((i for i in range(len(ids) - 1, -1, -1) if ids[i] == image_token), default=-1)


def has_images(ids: list[int], image_token: int | None) -> bool:
    """Whether these prompt tokens include an image's (then their embeddings come from the vision tower)."""
    return image_token is not None and image_token in ids
