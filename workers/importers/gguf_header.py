"""Read a GGUF file's header (scalar metadata and tensor table) without loading any tensor data.

mlx.core.load reads GGUF too, but it hides each tensor's on-disk type, silently dequantizes some
types (Q2_K, Q4_K, Q6_K and BF16 come back as float16) and silently drops others (TQ1_0, TQ2_0,
MXFP4). We read the header ourselves so we can refuse those before trusting mx.load, report the
exact quantization, and give a clear message for truncated or non-GGUF files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import ConversionError

# ggml tensor type ids (ggml.h) -> names used in llama.cpp's file names and our catalog.
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}

# (elements per block, bytes per block) for the types we can convert; enough to check the file size.
BLOCK_LAYOUT = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 24  # far above any real model; stops a garbage header from looping for hours


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: shape in numpy (row-major) order and byte range in the file."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    start: int  # absolute file offset
    nbytes: int | None  # None when the type is one we cannot size (we refuse those anyway)


@dataclass(frozen=True)
class GGUFHeader:
    """Scalar metadata (arrays are left out) and the tensor table of a GGUF file."""

    metadata: dict
    tensors: dict[str, TensorInfo]
    file_size: int


class _Reader:
    """Sequential little-endian reads that raise ConversionError instead of struct.error at EOF."""

    def __init__(self, handle, path: Path):
        self.handle, self.path = handle, path

    def take(self, n: int) -> bytes:
        data = self.handle.read(n)
        if len(data) != n:
            raise ConversionError(f"{self.path.name}: file ends inside the GGUF header (truncated download?)")
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        if length > _MAX_COUNT:
            raise ConversionError(f"{self.path.name}: corrupt GGUF header (string of {length} bytes)")
        return self.take(length).decode("utf-8", errors="replace")

    def count(self, what: str) -> int:
        value = self.unpack("<Q")
        if value > _MAX_COUNT:
            raise ConversionError(f"{self.path.name}: corrupt GGUF header ({value} {what})")
        return value


def read_header(path: Path) -> GGUFHeader:
    """Parse the header of the GGUF at path; ConversionError if it is not GGUF or is cut short."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            return _parse(_Reader(handle, path), size)
    except OSError as exc:
        raise ConversionError(f"cannot read {path}: {exc}") from exc


def _parse(reader: _Reader, size: int) -> GGUFHeader:
    magic = reader.handle.read(4)
    if magic != b"GGUF":
        raise ConversionError(f"{reader.path.name} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    version = reader.unpack("<I")
    if version not in (2, 3):
        raise ConversionError(f"{reader.path.name}: unsupported GGUF version {version} (need 2 or 3)")
    n_tensors, n_kv = reader.count("tensors"), reader.count("metadata keys")
    metadata = {}
    for _ in range(n_kv):
        key = reader.string()
        value = _value(reader, reader.unpack("<I"))
        if value is not _SKIPPED:
            metadata[key] = value
    raw = [_tensor_entry(reader) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", 32)) or 32
    data_start = -(-reader.handle.tell() // alignment) * alignment
    tensors = {name: TensorInfo(name, shape, kind, data_start + offset, _nbytes(kind, shape))
               for name, shape, kind, offset in raw}
    return GGUFHeader(metadata, tensors, size)


_SKIPPED = object()


def _value(reader: _Reader, kind: int):
    if kind in _SCALARS:
        return reader.unpack(_SCALARS[kind])
    if kind == _STRING:
        return reader.string()
    if kind != _ARRAY:
        raise ConversionError(f"{reader.path.name}: corrupt GGUF header (metadata value type {kind})")
    item_kind, length = reader.unpack("<I"), reader.count("array items")
    # Arrays (the vocabulary, merges...) are skipped here: mx.load returns them to the converter.
    if item_kind in _SCALARS:
        reader.take(struct.calcsize(_SCALARS[item_kind]) * length)
    else:
        for _ in range(length):
            _value(reader, item_kind)
    return _SKIPPED


def _tensor_entry(reader: _Reader):
    name = reader.string()
    n_dims = reader.unpack("<I")
    if n_dims > 8:
        raise ConversionError(f"{reader.path.name}: corrupt GGUF header (tensor {name} has {n_dims} dims)")
    dims = [reader.unpack("<Q") for _ in range(n_dims)]
    kind = reader.unpack("<I")
    offset = reader.unpack("<Q")
    # GGUF lists dimensions fastest-first; numpy/MLX order is the reverse.
    return name, tuple(reversed(dims)), GGML_TYPE_NAMES.get(kind, f"type {kind}"), offset


def _nbytes(type_name: str, shape: tuple[int, ...]) -> int | None:
    if type_name not in BLOCK_LAYOUT:
        return None
    per_block, block_bytes = BLOCK_LAYOUT[type_name]
    count = 1
    for dim in shape:
        count *= dim
    return -(-count // per_block) * block_bytes


def check_complete(header: GGUFHeader, path: Path) -> None:
    """Raise ConversionError when a tensor's data lies past the end of the file (a cut-short download)."""
    for info in header.tensors.values():
        if info.nbytes is not None and info.start + info.nbytes > header.file_size:
            raise ConversionError(
                f"{Path(path).name} is truncated: tensor {info.name} needs bytes up to "
                f"{info.start + info.nbytes} but the file has {header.file_size} (incomplete download?)")
