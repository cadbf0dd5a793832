"""The multimodal chat backend: chats with images or audio, and any chat on a vision model (mlx-vlm).

Audio reaches a model that hears it (an omni model) as audio. For any other model it is first
transcribed by the request's speech model, window by window (yielding between windows like a
transcription job), and goes into the conversation as text that says it is a transcript: a plain
text LLM can then answer questions about a recording. Images need a vision model; the web tier
refuses them for others before anything is fetched.

These requests run alone, one choice after another: chats with audio, and chats on a vision model whose language
part cannot decode in the text batch. The others decode in their model's batch (workers/backends/vision_batch.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from jobs.contract import MultimodalRequest
from workers.audio import probe
from workers.backends import quantized_kv, reasoning, textgen, toolcalls, vision, whisper
from workers.backends.base import Outcome
from workers.backends.text import run_choices


class MultimodalBackend:
    """Multimodal chats behind the backend interface (workers/backends/base.py)."""

    model_kind = "vision"
    model_kinds = frozenset({"vision", "text"})  # a text model serves chats whose audio was transcribed
    resumable = False

    def load(self, path: Path, float32: bool):
        """Load an mlx-vlm model and its processor."""
        return vision.load(path, float32)

    def run(self, request: MultimodalRequest, job, models) -> Iterator[Outcome | None]:
        """Transcribe audio for a model that cannot hear it, then generate each choice."""
        messages, audio = request.messages, request.audio
        if request.speech_model is not None and audio:
            transcripts = yield from _transcribe_all(request, job, models)
            messages, audio = _with_transcripts(messages, transcripts), []
        resident = models.get(request.model)
        plans: dict[int, reasoning.Plan | None] = {}  # a reasoning text model's thinking, per choice
        if request.model.kind == "text":
            kv = quantized_kv.for_model(resident.model, request.model.path, job.settings)

            tokenizer = resident.processor

            def generate(conversation, index: int) -> Iterator[textgen.Piece]:
                ids = textgen.chat_prompt(tokenizer, _as_text(conversation), request.tools,
                                          reasoning.template_kwargs(request, tokenizer))
                plans[index] = reasoning.plan(request, tokenizer, ids)
                return textgen.generate(resident.model, tokenizer, ids, request.sampling,
                                        request.model.context_length, kv=kv)
        else:
            tokenizer = vision.text_tokenizer(resident.processor)

            def generate(conversation, index: int) -> Iterator[textgen.Piece]:
                return vision.generate(resident.model, resident.processor, conversation, request.images, audio,
                                       request.sampling, request.model.context_length, request.tools)
        yield from run_choices(_with_inputs(request, messages), job, generate,
                               lambda: toolcalls.for_request(request, tokenizer),
                               lambda index: reasoning.thoughts(plans.get(index)))


def _transcribe_all(request: MultimodalRequest, job, models):
    """The transcript of each audio part, in order; yields between Whisper windows."""
    model = models.get(request.speech_model).model
    options = whisper.Options(max_duration_s=job.settings.max_audio_s)
    transcripts = []
    for path in request.audio:
        total_s = probe(path, job.settings.max_audio_s)
        texts = []
        for chunk in whisper.transcribe_chunks(model, path, options):
            job.check_cancel()
            texts.extend(segment["text"].strip() for segment in chunk.segments)
            if chunk.finished:
                break
            yield
        transcripts.append((total_s, " ".join(t for t in texts if t)))
    return transcripts


def _with_transcripts(messages: list[dict], transcripts: list[tuple[float, str]]) -> list[dict]:
    """The messages with each audio part replaced by a text part that says it is a transcript."""
    converted = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [_transcript_part(part["audio"], *transcripts[part["audio"]])
                       if part["type"] == "input_audio" else part for part in content]
        converted.append({**message, "content": content})
    return converted


def _transcript_part(index: int, seconds: float, text: str) -> dict:
    """The text a model reads in place of audio clip `index`."""
    heard = text or "(no speech was recognized)"
    return {"type": "text", "text": f"\n[Transcript of audio clip {index + 1} ({seconds:.0f} s), made by a "
                                    f"speech-to-text model: {heard}]\n"}


def _as_text(messages: list[dict]) -> list[dict]:
    """Messages whose content parts are all text, joined into strings (what text chat templates take)."""
    return [{**m, "content": m["content"] if isinstance(m["content"], str)
             else "".join(part["text"] for part in m["content"])} for m in messages]


def _with_inputs(request: MultimodalRequest, messages: list[dict]) -> MultimodalRequest:
    """The request with its conversation replaced (after transcription)."""
    return replace(request, messages=messages)
