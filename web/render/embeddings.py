"""OpenAI's embeddings answer: the `list` of `embedding` objects, as floats or as base64."""

from __future__ import annotations

import base64
from array import array

from web.render.base import Renderer


def vector_floats(encoded: str) -> list[float]:
    """A vector the worker sent (base64 of little-endian float32) as a list of numbers."""
    values = array("f", base64.b64decode(encoded))
    if values.itemsize != 4 or array("H", [1]).tobytes() != b"\x01\x00":  # (a big-endian host would need a swap)
        values.byteswap()
    return values.tolist()


def embedding_list(done: dict, encoding_format: str = "float") -> dict:
    """The whole answer from the job's `done` data (jobs.contract.EmbeddingResult)."""
    tokens = int(done.get("prompt_tokens") or 0)
    data = [{"object": "embedding", "index": i,
             "embedding": encoded if encoding_format == "base64" else vector_floats(encoded)}
            for i, encoded in enumerate(done["embeddings"])]
    return {"object": "list", "data": data, "model": done["model"],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def npy_file(done: dict) -> bytes:
    """The vectors as a NumPy .npy file (version 1.0): one little-endian float32 row per input."""
    rows, width = len(done["embeddings"]), int(done["dimensions"])
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {width}), }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"  # the data starts 64-byte aligned
    return (b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode("latin-1")
            + b"".join(base64.b64decode(row) for row in done["embeddings"]))


class Embeddings(Renderer):
    """An embeddings answer (never streamed)."""

    def __init__(self, encoding_format: str):
        self.encoding_format = encoding_format

    def body(self, done: dict) -> dict:
        """OpenAI's embedding list."""
        return embedding_list(done, self.encoding_format)
