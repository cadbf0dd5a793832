"""The language model of a vision model as its mlx-lm twin: the same weights, the same logits, or no twin."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.idefics3.config import TextConfig
from mlx_vlm.models.idefics3.language import LanguageModel

from workers.backends import vision_batch


def _language_model(**overrides) -> LanguageModel:
    config = TextConfig(**{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
                           "vocab_size": 97, "num_hidden_layers": 2, "rope_theta": 10000.0, **overrides})
    model = LanguageModel(config)
    mx.eval(model.parameters())
    return model


def test_the_twin_holds_the_same_weights_and_computes_the_same_logits_from_embeddings():
    theirs = _language_model()
    twin = vision_batch.twin(theirs)
    assert twin is not None
    assert twin.model.layers[1].self_attn.q_proj is theirs.layers[1].self_attn.q_proj  # shared, not copied
    assert twin.lm_head is theirs.lm_head
    ids = mx.array([[5, 9, 2, 40, 7]])
    embeds = theirs.embed_tokens(ids) * 0.5  # as a vision tower's features would be: not the ids' own
    expected = theirs(ids, inputs_embeds=embeds).logits
    assert mx.allclose(twin(ids, input_embeddings=embeds), expected, atol=1e-5).item()
    assert vision_batch._same_logits(theirs, twin)


def test_no_twin_for_an_architecture_mlx_lm_lacks_or_one_laid_out_differently():
    assert vision_batch.twin(_language_model(model_type="no_such_architecture")) is None
    odd = _language_model()
    odd.layers[0].extra = nn.Linear(4, 4)  # a part the mlx-lm architecture does not have
    assert vision_batch.twin(odd) is None


def test_the_digest_names_the_image_bytes(tmp_path):
    a, b, c = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.jpg"
    a.write_bytes(b"one picture")
    b.write_bytes(b"another picture")
    c.write_bytes(b"one picture")
    assert vision_batch.digest([str(a)]) == vision_batch.digest([str(c)])  # the same bytes, whatever the name
    assert vision_batch.digest([str(a)]) != vision_batch.digest([str(b)])
    assert vision_batch.digest([str(a), str(b)]) != vision_batch.digest([str(b), str(a)])  # in order


def test_a_repeat_whose_images_are_cached_is_prepared_without_reading_them(models_dir, tmp_path):
    from types import SimpleNamespace

    from workers.backends import vision
    from workers.demo import shapes

    vlm, processor = vision.load(models_dir / "shapes-vlm-toy", float32=True)
    model = vision_batch._vision_model(vlm, processor)
    picture = tmp_path / "picture.png"
    shapes.samples(7, 1)[0].image.save(picture)
    request = SimpleNamespace(
        messages=[{"role": "user", "content": [{"type": "image", "image": 0}, {"type": "text", "text": "What?"}]}],
        images=[str(picture)], tools=None, n=1, sampling=SimpleNamespace(max_tokens=8, grammar=None),
        model=SimpleNamespace(context_length=2048))

    def prepare(cached: int):
        return vision_batch.prepare(request, model, 100, 1, lambda: 2**30, lambda media, ids: cached)

    first = prepare(0)
    ((ids, _),), (media,) = first.prompts, first.media
    assert media.pixel_values is not None and model.image_token in ids
    again = prepare(len(ids) - 1)  # the prompt cache holds all but its last token: the images are not read
    assert again.prompts[0][0] == ids and again.media[0].pixel_values is None
    embeds = model.embeddings(ids, again.media[0])  # read after all (the entry went meanwhile): the same embeddings
    assert mx.allclose(embeds, model.embeddings(ids, media)).item()
    partly = prepare(ids.index(model.image_token))  # cached up to its first image token only: read now
    assert partly.media[0].pixel_values is not None


def test_several_prompts_images_go_through_the_tower_in_one_call_as_they_would_alone(models_dir, tmp_path):
    from types import SimpleNamespace

    from workers.backends import vision
    from workers.demo import shapes

    vlm, processor = vision.load(models_dir / "shapes-vlm-toy", float32=True)
    model = vision_batch._vision_model(vlm, processor)
    paths = []
    for i, sample in enumerate(shapes.samples(11, 3)):
        paths.append(tmp_path / f"{i}.png")
        sample.image.save(paths[-1])

    def prepared(images: list, text: str):
        parts = [{"type": "image", "image": i} for i in range(len(images))] + [{"type": "text", "text": text}]
        request = SimpleNamespace(messages=[{"role": "user", "content": parts}], images=[str(p) for p in images],
                                  tools=None, n=1, sampling=SimpleNamespace(max_tokens=8, grammar=None),
                                  model=SimpleNamespace(context_length=2048))
        done = vision_batch.prepare(request, model, 100, 1, lambda: 2**30)
        return done.prompts[0][0], done.media[0]

    # Prompts of different lengths with different numbers of images (one is padded with an all-zero image).
    prompts = [prepared(paths[:1], "What is in this image? Say it in a few words."), prepared(paths[1:], "And here?")]
    together = model.embeddings_many(prompts)
    for (ids, media), mine in zip(prompts, together, strict=True):
        assert mine.shape[:2] == (1, len(ids))
        assert mx.allclose(mine, model.embeddings(ids, media), atol=1e-5).item()
