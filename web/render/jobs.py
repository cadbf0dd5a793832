"""The async jobs API's answers: a job's own events framed as they are, and a finished job's result."""

from __future__ import annotations

from web.render.embeddings import embedding_list
from web.render.openai import chat_completion
from web.render.sse import sse_data


def event_frame(event: dict) -> str:
    """One job event as SSE, with its id (Last-Event-ID resumes after it) and its type as the event name."""
    return sse_data(event["data"], event_id=event["id"], event=event["type"])


def result_body(record: dict, result: dict | None, params: dict | None = None):
    """An async job's result as clients see it: verbose_json, a chat.completion object for chat, an embedding
    list for embeddings (`params`: what the job was submitted with, its encoding_format)."""
    if record["kind"] == "embedding" and result is not None:
        return embedding_list(result, (params or {}).get("encoding_format") or "float")
    if record["kind"] != "chat" or result is None:
        return result
    return chat_completion(record["id"], result.get("created") or record["created_at"],
                           {**result, "model": result.get("model", record.get("model"))})
