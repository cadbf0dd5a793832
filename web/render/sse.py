"""Server-Sent Events framing."""

from __future__ import annotations

import json


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
