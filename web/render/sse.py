"""Server-Sent Events: the frames, the keep-alive comment and the streaming response (the only place SSE is
written)."""

from __future__ import annotations

import json

from flask import Response


def sse_data(payload, event_id: int | None = None, event: str | None = None) -> str:
    """Frame one SSE message whose data is `payload` (JSON-encoded unless already a string)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    head = ""
    if event_id is not None:
        head += f"id: {event_id}\n"
    if event is not None:
        head += f"event: {event}\n"
    return head + "".join(f"data: {line}\n" for line in data.split("\n")) + "\n"


def sse_comment(text: str = "keep-alive") -> str:
    """An SSE comment line: ignored by clients, keeps proxies from closing an idle stream."""
    return f": {text}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Headers for event streams (no caching, no proxy buffering)."""


def event_stream(frames) -> Response:
    """A response that streams `frames` (SSE text) as they come, uncached and unbuffered."""
    return Response(frames, mimetype="text/event-stream", headers=SSE_HEADERS)
