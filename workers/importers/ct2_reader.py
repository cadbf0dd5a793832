"""A small reader for CTranslate2's model.bin, so importing needs no ctranslate2 install.

Layout (ctranslate2 python/ctranslate2/specs/model_spec.py `_serialize`, read back by
src/models/model.cc `Model::load`), all integers little-endian:

    u32 binary_version                      (1..6 are known)
    if version >= 2: string spec_name, u32 spec_revision
    u32 num_variables, then per variable:
        string name, u8 rank, u32 dims[rank],
        version >= 4: u8 dtype_id, u32 num_bytes
        version <  4: u8 item_size, u32 num_elements   (dtype guessed from the width)
        bytes data[num_bytes]
    if version >= 3: u32 num_aliases, then per alias: string alias, string target

A string is a u16 length that counts a trailing NUL, then that many bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from workers.importers.errors import ConversionError

# The newest layout we know; model.cc refuses anything newer, so do we.
MAX_BINARY_VERSION = 6

# model_spec.py `_dtype_to_type_id`: the dtype id is the index in this tuple.
# bfloat16 has no numpy dtype: it is kept as raw uint16 and named in `dtypes`.
DTYPE_NAMES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
_NUMPY_DTYPES = {"float32": "<f4", "int8": "i1", "int16": "<i2", "int32": "<i4",
                 "float16": "<f2", "bfloat16": "<u2"}
# Binary versions < 4 stored an item width instead of a dtype id (model.cc get_dtype_from_item_size).
_LEGACY_WIDTHS = {4: "float32", 2: "int16", 1: "int8"}
_MAX_RANK = 8


@dataclass
class Ct2Model:
    """The parsed contents of a model.bin: header, variables (numpy arrays) and aliases."""

    binary_version: int
    spec_name: str
    spec_revision: int
    variables: dict[str, np.ndarray] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        """True if `name` is a variable or an alias of one."""
        return self.resolve(name) in self.variables

    def resolve(self, name: str) -> str:
        """The variable name behind `name`, following aliases."""
        seen = set()
        while name in self.aliases and name not in seen:
            seen.add(name)
            name = self.aliases[name]
        return name

    def get(self, name: str) -> np.ndarray:
        """The array stored under `name` (or its alias target); ConversionError if absent."""
        real = self.resolve(name)
        if real not in self.variables:
            raise ConversionError(f"model.bin has no variable '{name}'")
        return self.variables[real]

    def dtype_of(self, name: str) -> str:
        """The CTranslate2 dtype name ('float16', 'bfloat16', ...) of a variable."""
        self.get(name)
        return self.dtypes[self.resolve(name)]


class _Cursor:
    """Reads little-endian values from a buffer, turning short reads into clear ConversionErrors."""

    def __init__(self, data: bytes | memoryview):
        self.data = data
        self.pos = 0

    def left(self) -> int:
        """Bytes remaining after the cursor."""
        return len(self.data) - self.pos

    def take(self, size: int, what: str) -> memoryview:
        """The next `size` bytes, or ConversionError naming `what` when the file ends first."""
        if size > self.left():
            raise ConversionError(f"model.bin is truncated: {what} needs {size} bytes, {self.left()} left")
        view = memoryview(self.data)[self.pos:self.pos + size]
        self.pos += size
        return view

    def unpack(self, fmt: str, what: str):
        """One struct value (little-endian `fmt`) named `what` for error messages."""
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        """A u16-length-prefixed, NUL-terminated UTF-8 string."""
        length = self.unpack("H", f"length of {what}")
        raw = bytes(self.take(length, what))
        if length == 0 or raw[-1] != 0:
            raise ConversionError(f"model.bin is corrupt: {what} at byte {self.pos - length} is not NUL-terminated")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConversionError(f"model.bin is corrupt: {what} is not valid UTF-8") from exc


def read_ct2_model(path: Path) -> Ct2Model:
    """Parse a CTranslate2 model.bin into numpy arrays (views over the file's bytes)."""
    cursor = _Cursor(Path(path).read_bytes())
    model = _read_header(cursor)
    count = cursor.unpack("I", "number of variables")
    for index in range(count):
        name, array, dtype = _read_variable(cursor, model.binary_version, index)
        model.variables[name] = array
        model.dtypes[name] = dtype
    if model.binary_version >= 3:
        model.aliases = _read_aliases(cursor)
    # Like model.cc we ignore anything after the aliases.
    return model


def _read_header(cursor: _Cursor) -> Ct2Model:
    version = cursor.unpack("I", "binary version")
    if not 1 <= version <= MAX_BINARY_VERSION:
        raise ConversionError(
            f"model.bin has binary version {version}; this reader knows versions 1 to {MAX_BINARY_VERSION}"
            " (is it a CTranslate2 model?)")
    if version < 2:
        # Version 1 files carry no spec name: they predate Whisper support in CTranslate2.
        return Ct2Model(binary_version=version, spec_name="", spec_revision=1)
    name = cursor.string("spec name")
    revision = cursor.unpack("I", "spec revision")
    return Ct2Model(binary_version=version, spec_name=name, spec_revision=revision)


def _read_variable(cursor: _Cursor, version: int, index: int) -> tuple[str, np.ndarray, str]:
    name = cursor.string(f"name of variable #{index}")
    rank = cursor.unpack("B", f"rank of variable '{name}'")
    if rank > _MAX_RANK:
        raise ConversionError(f"model.bin is corrupt: variable '{name}' claims rank {rank}")
    shape = tuple(cursor.unpack("I", f"shape of variable '{name}'") for _ in range(rank))
    dtype, num_bytes = _read_dtype_and_size(cursor, version, name)
    itemsize = np.dtype(_NUMPY_DTYPES[dtype]).itemsize
    expected = int(np.prod(shape, dtype=np.int64)) * itemsize
    if num_bytes != expected:
        raise ConversionError(
            f"model.bin is corrupt: variable '{name}' has shape {shape} of {dtype} ({expected} bytes)"
            f" but declares {num_bytes} bytes")
    raw = cursor.take(num_bytes, f"variable '{name}'")
    array = np.frombuffer(raw, dtype=_NUMPY_DTYPES[dtype]).reshape(shape)
    return name, array, dtype


def _read_dtype_and_size(cursor: _Cursor, version: int, name: str) -> tuple[str, int]:
    if version >= 4:
        type_id = cursor.unpack("B", f"dtype of variable '{name}'")
        size = cursor.unpack("I", f"byte count of variable '{name}'")
        if type_id >= len(DTYPE_NAMES):
            raise ConversionError(f"model.bin is corrupt: variable '{name}' has unknown dtype id {type_id}")
        return DTYPE_NAMES[type_id], size
    width = cursor.unpack("B", f"item size of variable '{name}'")
    count = cursor.unpack("I", f"element count of variable '{name}'")
    if width not in _LEGACY_WIDTHS:
        raise ConversionError(f"model.bin is corrupt: variable '{name}' has item size {width}")
    return _LEGACY_WIDTHS[width], count * width


def _read_aliases(cursor: _Cursor) -> dict[str, str]:
    aliases = {}
    for index in range(cursor.unpack("I", "number of aliases")):
        alias = cursor.string(f"alias #{index}")
        aliases[alias] = cursor.string(f"target of alias '{alias}'")
    return aliases
