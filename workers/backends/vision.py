"""Vision-language generation on mlx-vlm: load a model with its processor, build the prompt with the
model's own chat template, generate with the same sampling, stop strings and usage as text."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import mlx_vlm
from mlx_vlm.prompt_utils import apply_chat_template

from jobs.contract import Sampling
from workers.backends import textgen
from workers.backends.sampling import logits_processors, make_sampler


def load(path: Path, float32: bool = False):
    """Load an mlx-vlm model and its processor; dequantize/upcast to float32 when asked (CPU policy)."""
    model, processor = mlx_vlm.load(str(path), lazy=True)
    return textgen.materialize(model, float32), processor


def tokenizer_of(processor):
    """The text tokenizer inside a processor (or the processor itself when it is one)."""
    return getattr(processor, "tokenizer", processor)


def chat_prompt(model, processor, messages: Sequence[dict], images: int, audio: int) -> str:
    """The prompt text of a chat: mlxq's media references become the model's image/audio markers."""
    converted = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": part["type"]} if part["type"] in ("image", "input_audio") else part
                       for part in content]
        converted.append({"role": message["role"], "content": content})
    return apply_chat_template(processor, model.config, converted, num_images=images, num_audios=audio)


def generate(model, processor, messages: Sequence[dict], images: list[str], audio: list[str],
             sampling: Sampling, context_length: int | None = None) -> Iterator[textgen.Piece]:
    """Generate for a chat with images (and audio the model hears): one Piece per token, as text does."""
    prompt = chat_prompt(model, processor, messages, len(images), len(audio))
    vocab = textgen.output_size(model.language_model, tokenizer_of(processor))
    steps = _steps(model, processor, prompt, images, audio, sampling, vocab, context_length)
    return textgen.pieces(steps, textgen.StopBuffer(sampling.stop))


def _steps(model, processor, prompt: str, images: list[str], audio: list[str], sampling: Sampling, vocab: int,
           context_length: int | None) -> Iterator[textgen.Step]:
    """mlx-vlm's generation as Steps; the token budget is known once the prompt (images included) is."""
    # As mlx_vlm.stream_generate prepares them (special tokens included), but here, to know the prompt's length.
    inputs = mlx_vlm.utils.prepare_inputs(
        processor, images=images or None, audio=audio or None, prompts=prompt,
        image_token_index=getattr(model.config, "image_token_index", None),
        add_special_tokens=mlx_vlm.utils.should_add_special_tokens(model.config.model_type, processor))
    input_ids = inputs["input_ids"]
    prompt_tokens = int(input_ids.size)
    budget = textgen.token_budget(prompt_tokens, sampling.max_tokens, context_length)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    results = mlx_vlm.stream_generate(
        model, processor, prompt, input_ids=input_ids, pixel_values=inputs.get("pixel_values"),
        mask=inputs.get("attention_mask"), max_tokens=budget, sampler=make_sampler(sampling, vocab),
        logits_processors=logits_processors(sampling, tokenizer_of(processor), vocab), **extra)
    tokenizer = tokenizer_of(processor)
    for result in results:
        yield textgen.Step(result.text, result.generation_tokens, prompt_tokens, result.finish_reason,
                           textgen.logprob_of(sampling, tokenizer, result.token, result.logprobs, result.finish_reason))
