"""Vision-language generation on mlx-vlm: load a model with its processor, build the prompt with the
model's own chat template, generate with the same sampling, stop strings and usage as text."""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import mlx_vlm
from mlx_lm.tokenizer_utils import TokenizerWrapper, _infer_tool_parser
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


def chat_prompt(model, processor, messages: Sequence[dict], images: int, audio: int,
                tools: list[dict] | None = None) -> str:
    """The prompt text of a chat (with its tools, when the template renders them): mlxq's media references become
    the model's image/audio markers."""
    converted = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": part["type"]} if part["type"] in ("image", "input_audio") else part
                       for part in content]
        converted.append({**message, "content": content})  # (an assistant's tool calls, a tool result's id)
    extra = {"tools": tools} if tools else {}
    return apply_chat_template(processor, model.config, converted, num_images=images, num_audios=audio, **extra)


_TEXT_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def text_tokenizer(processor) -> TokenizerWrapper:
    """The processor's tokenizer as mlx-lm wraps one (made once per processor): its ends of sequence as mlx-vlm
    stops on them, its streaming detokenizer, and its tool-call parser as mlx-lm infers it from the chat template."""
    wrapped = _TEXT_TOKENIZERS.get(processor)
    if wrapped is None:
        tokenizer = tokenizer_of(processor)
        criteria = getattr(tokenizer, "stopping_criteria", None) or getattr(processor, "stopping_criteria", None)
        eos = list(getattr(criteria, "eos_token_ids", None) or [tokenizer.eos_token_id])
        detokenizer = getattr(processor, "detokenizer", None)
        parser = {}
        kind = _infer_tool_parser(tokenizer)  # (mlx-lm's own inference, as its tokenizer loader runs it)
        if kind is not None:
            module = importlib.import_module(f"mlx_lm.tool_parsers.{kind}")
            parser = {"tool_parser": module.parse_tool_call, "tool_call_start": module.tool_call_start,
                      "tool_call_end": module.tool_call_end}
        wrapped = TokenizerWrapper(tokenizer, type(detokenizer) if detokenizer is not None else None,
                                   eos_token_ids=eos, **parser)
        _TEXT_TOKENIZERS[processor] = wrapped
    return wrapped


def generate(model, processor, messages: Sequence[dict], images: list[str], audio: list[str],
             sampling: Sampling, context_length: int | None = None,
             tools: list[dict] | None = None) -> Iterator[textgen.Piece]:
    """Generate for a chat with images (and audio the model hears): one Piece per token, as text does."""
    prompt = chat_prompt(model, processor, messages, len(images), len(audio), tools)
    vocab = textgen.output_size(model.language_model, tokenizer_of(processor))
    steps = _steps(model, processor, prompt, images, audio, sampling, vocab, context_length)
    return textgen.pieces(steps, textgen.StopBuffer(sampling.stop))


def model_inputs(model, processor, prompt: str, images: list[str], audio: list[str]) -> dict:
    """The model's inputs for a prompt and its media (input_ids, pixel_values, attention_mask and what else the
    model takes), as mlx_vlm.stream_generate prepares them (special tokens included), but here, to know the
    prompt's length first."""
    return mlx_vlm.utils.prepare_inputs(
        processor, images=images or None, audio=audio or None, prompts=prompt,
        image_token_index=getattr(model.config, "image_token_index", None),
        add_special_tokens=mlx_vlm.utils.should_add_special_tokens(model.config.model_type, processor))


def extra_inputs(inputs: dict) -> dict:
    """The model's inputs beside the ids, pixels and attention mask (image sizes, a pixel mask...)."""
    return {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}


def _steps(model, processor, prompt: str, images: list[str], audio: list[str], sampling: Sampling, vocab: int,
           context_length: int | None) -> Iterator[textgen.Step]:
    """mlx-vlm's generation as Steps; the token budget is known once the prompt (images included) is."""
    inputs = model_inputs(model, processor, prompt, images, audio)
    input_ids = inputs["input_ids"]
    prompt_tokens = int(input_ids.size)
    budget = textgen.token_budget(prompt_tokens, sampling.max_tokens, context_length)
    results = mlx_vlm.stream_generate(
        model, processor, prompt, input_ids=input_ids, pixel_values=inputs.get("pixel_values"),
        mask=inputs.get("attention_mask"), max_tokens=budget, sampler=make_sampler(sampling, vocab),
        logits_processors=logits_processors(sampling, tokenizer_of(processor), vocab), **extra_inputs(inputs))
    tokenizer = tokenizer_of(processor)
    for result in results:
        yield textgen.Step(result.text, result.generation_tokens, prompt_tokens, result.finish_reason,
                           textgen.logprob_of(sampling, tokenizer, result.token, result.logprobs, result.finish_reason))
