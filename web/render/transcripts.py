"""Transcriptions (and translations) as OpenAI answers them: the result in the format asked for
(jobs/formats.py renders it: both tiers know the formats), or `transcript.text.delta` frames."""

from __future__ import annotations

from flask import Response, jsonify

from jobs.events import DONE, SEGMENT
from jobs.formats import logprobs_field, render
from web.render.base import Renderer
from web.render.openai import stream_error
from web.render.sse import sse_data


def transcription(result: dict, fmt: str, granularities) -> Response:
    """A verbose_json result in `fmt`: a JSON body, or text (text, srt, vtt: each as its own content type)."""
    body, mimetype = render(result, fmt, tuple(granularities))
    if isinstance(body, dict):
        return jsonify(body)
    return Response(body, content_type=mimetype)


class Transcript(Renderer):
    """One transcription's answer: the result in `fmt`, or its text deltas (each with its tokens'
    `logprobs` when include[]=logprobs asked for them) then `transcript.text.done`."""

    def __init__(self, fmt: str = "json", granularities=("segment",), request_id: str | None = None):
        self.fmt, self.granularities, self.request_id = fmt, granularities, request_id
        self.started = False

    def answer(self, done: dict) -> Response:
        """The result in the format asked for (JSON or text)."""
        return transcription(done["result"], self.fmt, self.granularities)

    def frames(self, event: dict):
        """A text delta per segment with text, then the whole text once done."""
        data = event["data"]
        if event["type"] == SEGMENT:
            text = data["segment"]["text"]
            # Segments carry their own leading space; the first delta starts the text without one.
            text = text if self.started else text.lstrip()
            if text:
                self.started = True
                yield sse_data({"type": "transcript.text.delta", "delta": text, **logprobs_field(data)})
        elif event["type"] == DONE:
            result = data["result"]
            yield sse_data({"type": "transcript.text.done", "text": result["text"], **logprobs_field(result)})

    def error_frame(self, error: dict) -> str:
        """An OpenAI-style error frame."""
        return stream_error(error, self.request_id)
