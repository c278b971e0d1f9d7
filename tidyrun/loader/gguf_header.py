"""A GGUF file's header (metadata and tensor table) read in one pass, its tensor data left memory-mapped.

Why hand-written: ``gguf.GGUFReader`` builds every metadata value out of numpy memory-map slices, several per
string; the default model's tokenizer arrays (~98k strings) made that 2-4 s of each engine start, about
two thirds of it (engines built by the test suite, a notebook switching models). Read here with ``struct``
from the same map: about 0.1 s. The format is small and stable (GGUF v2/v3: magic, version, counts,
key/value pairs, tensor infos, aligned data); the tensor data views are shaped as gguf's reader shapes them,
so ``gguf.quants.dequantize`` takes them unchanged.
"""

from __future__ import annotations

import struct
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
# GGUF value types: struct formats of the scalar ones; 8 is a string, 9 an array.
_SCALARS = MappingProxyType({0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
                             12: "d"})
_STRING, _ARRAY = 8, 9
# Unquantized GGML types and their numpy dtypes (gguf's reader gives these as typed arrays, the rest as bytes).
_PLAIN_TYPES = MappingProxyType({0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                                 28: np.float64})


class GGUFTensor(NamedTuple):
    """One tensor of the file: ``shape`` in ggml order (fastest dimension first), ``tensor_type`` a
    ``gguf.GGMLQuantizationType``, ``data`` a read-only view of the memory map (typed for unquantized
    types, raw bytes [..., bytes per row] otherwise: what ``gguf.quants.dequantize`` takes)."""
    name: str
    shape: tuple[int, ...]
    tensor_type: object
    data: np.ndarray


class GGUFHeader:
    """A GGUF file opened read-only: ``fields`` (key -> Python value: int, float, bool, str or list) and
    ``tensors`` (in file order). Owns a read-only memory map of the file (host memory, paged in on access),
    released with the object. Raises ValueError (or struct.error) on a malformed file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        buf = self._map
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError("GGUF magic invalid")
        order = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            order = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (versions {_VERSIONS})")
        self._order = order
        tensor_count, kv_count = struct.unpack_from(order + "QQ", buf, 8)
        offset = 24
        self.fields: dict[str, object] = {}
        for _ in range(kv_count):
            key, offset = self._string(offset)
            (kind,), offset = struct.unpack_from(order + "I", buf, offset), offset + 4
            self.fields[key], offset = self._value(kind, offset)
        infos = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            (dims,), offset = struct.unpack_from(order + "I", buf, offset), offset + 4
            if dims > _MAX_DIMS:  # a corrupt count would build a format string of billions of characters
                raise ValueError(f"tensor {name!r} has {dims} dimensions (at most {_MAX_DIMS})")
            shape = struct.unpack_from(order + "Q" * dims, buf, offset)
            offset += 8 * dims
            kind, start = struct.unpack_from(order + "IQ", buf, offset)
            offset += 12
            infos.append((name, shape, kind, start))
        alignment = self.fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}: must be a power of two")
        data_start = -(-offset // alignment) * alignment
        self.tensors = self._tensors(infos, data_start)

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = struct.unpack_from(self._order + "Q", self._map, offset)
        end = offset + 8 + length
        if end > len(self._map):
            raise ValueError(f"a string at byte {offset} runs past the end of the file")
        return bytes(self._map[offset + 8:end]).decode("utf-8"), end

    def _value(self, kind: int, offset: int) -> tuple[object, int]:
        if kind == _STRING:
            return self._string(offset)
        if kind in _SCALARS:
            fmt = self._order + _SCALARS[kind]
            return struct.unpack_from(fmt, self._map, offset)[0], offset + struct.calcsize(fmt)
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind} at byte {offset}")
        item, count = struct.unpack_from(self._order + "IQ", self._map, offset)
        offset += 12
        if item in _SCALARS:  # one unpack for the whole array
            fmt = f"{self._order}{count}{_SCALARS[item]}"
            return list(struct.unpack_from(fmt, self._map, offset)), offset + struct.calcsize(fmt)
        values = []
        for _ in range(count):
            value, offset = self._value(item, offset)
            values.append(value)
        return values, offset

    def _tensors(self, infos: list, data_start: int) -> list[GGUFTensor]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        tensors, names = [], set()
        for name, shape, kind, start in infos:
            if name in names:
                raise ValueError(f"duplicated tensor {name!r}")
            names.add(name)
            ggml_type = GGMLQuantizationType(kind)
            elements = int(np.prod(shape, dtype=np.int64))
            np_shape = tuple(reversed(shape))
            first = data_start + start
            if kind in _PLAIN_TYPES:
                dtype = np.dtype(_PLAIN_TYPES[kind]).newbyteorder(self._order)
                size = elements * dtype.itemsize
                view = self._map[first:first + size].view(dtype)
            else:
                block, type_size = GGML_QUANT_SIZES[ggml_type]
                size = elements * type_size // block
                view, np_shape = self._map[first:first + size], quant_shape_to_byte_shape(np_shape, ggml_type)
            if first + size > len(self._map):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            tensors.append(GGUFTensor(name, tuple(int(d) for d in shape), ggml_type, view.reshape(np_shape)))
        return tensors
