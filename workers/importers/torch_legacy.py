"""Read a legacy `torch.save` file (PyTorch before 1.6: not a zip) into NumPy arrays, without torch.

Such a file is a run of pickles: a magic number, a protocol version, system facts, the saved object (its
tensors pickled as references to storages), the storages' keys, then each storage's raw bytes. Only tensors,
ordered dicts and plain data are unpickled: any other class in the file is refused, never imported.
"""

from __future__ import annotations

import collections
import pickle
import struct
from pathlib import Path

import numpy as np

MAGIC = 0x1950A86A20F9469CFC6C
PROTOCOL = 1001

_DTYPES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
           "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
           "ByteStorage": np.uint8, "BoolStorage": np.bool_}


class LegacyFormatError(ValueError):
    """The file is not a legacy torch.save file, or holds something other than tensors and plain data."""


class _Storage:
    def __init__(self, dtype, count: int):
        self.dtype, self.count, self.data = dtype, count, None


class _Tensor:
    """A tensor whose storage's bytes come later in the file."""

    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    def array(self) -> np.ndarray:
        data = self.storage.data
        return np.lib.stride_tricks.as_strided(data[self.offset:], shape=self.size,
                                               strides=[s * data.itemsize for s in self.stride]).copy()


def _rebuild_tensor(storage, offset, size, stride, *unused):
    return _Tensor(storage, offset, tuple(size), tuple(stride))


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, storages: dict):
        super().__init__(file)
        self.storages = storages

    def find_class(self, module, name):
        if module == "torch._utils" and name in ("_rebuild_tensor", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in _DTYPES:
            return name
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise LegacyFormatError(f"refusing to unpickle {module}.{name}: only tensors and plain data are read")

    def persistent_load(self, pid):
        kind, storage_type, key, _location, count = pid[:5]
        if kind != "storage" or storage_type not in _DTYPES:
            raise LegacyFormatError(f"unexpected persistent id {pid[:2]!r}")
        if key not in self.storages:
            self.storages[key] = _Storage(_DTYPES[storage_type], count)
        return self.storages[key]


def load(path: Path):
    """The object saved in `path`, its tensors as NumPy arrays."""
    storages: dict = {}
    with open(path, "rb") as f:
        read = _Unpickler(f, storages).load  # every pickle in the file, the plain ones too, goes through it
        try:
            if read() != MAGIC or read() != PROTOCOL:
                raise LegacyFormatError(f"{path} is not a legacy torch.save file")
        except (pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise LegacyFormatError(f"{path} is not a legacy torch.save file ({exc})") from None
        read()  # the system facts (byte order, sizes)
        saved = read()
        for key in read():
            storage = storages[key]
            (count,) = struct.unpack("<q", f.read(8))
            if count != storage.count:
                raise LegacyFormatError(f"storage {key}: {count} elements where {storage.count} were declared")
            size = count * np.dtype(storage.dtype).itemsize
            storage.data = np.frombuffer(f.read(size), dtype=storage.dtype)
            if len(storage.data) != count:
                raise LegacyFormatError(f"{path} is cut short")
    return _arrays(saved)


def _arrays(value):
    if isinstance(value, _Tensor):
        return value.array()
    if isinstance(value, dict):
        return type(value)((k, _arrays(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_arrays(v) for v in value)
    return value
