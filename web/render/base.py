"""The shape every API's renderer has: one answer built by its view, fed the job's events by web/jobrun.py."""

from __future__ import annotations

from typing import Iterator

from flask import Response, jsonify


class Renderer:
    """One answer in one API's wire shapes: the final body, or the frames of its stream (one per request:
    a stream's renderer keeps state between events)."""

    def body(self, done: dict) -> dict:
        """The whole answer's JSON body from the job's `done` data."""
        raise NotImplementedError

    def answer(self, done: dict) -> Response:
        """The non-streamed answer (JSON: sent as it is, past flask-smorest's schema)."""
        return jsonify(self.body(done))

    def frames(self, event: dict) -> Iterator[str]:
        """The SSE frames for one of the job's events (delta, segment, done; errors go to error_frame)."""
        raise NotImplementedError

    def error_frame(self, error: dict) -> str:
        """The frame that ends a stream whose job failed (`error`: the error event's data)."""
        raise NotImplementedError

    def closing(self) -> Iterator[str]:
        """Frames after the last one, whatever ended the stream (OpenAI's `[DONE]`); none by default."""
        return iter(())
