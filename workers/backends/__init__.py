"""Backends: one module per kind of model, each behind the small interface of `base.Backend`."""

from __future__ import annotations


def default_backends() -> dict:
    """The backend for each request kind this worker serves (importing them loads mlx-lm, mlx-vlm and mlx-audio)."""
    from workers.backends.control import ControlBackend
    from workers.backends.embeddings import EmbeddingBackend
    from workers.backends.multimodal import MultimodalBackend
    from workers.backends.speech import SpeechBackend
    from workers.backends.text import TextBackend

    return {"text": TextBackend(), "transcription": SpeechBackend(), "multimodal": MultimodalBackend(),
            "embedding": EmbeddingBackend(), "control": ControlBackend()}
