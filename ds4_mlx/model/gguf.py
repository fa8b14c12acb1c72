"""A small, lazy reader for GGUF v3 files (the container ds4 reads).

Why our own and not `gguf.GGUFReader`: opening the 81 GB published file must cost milliseconds plus one pass over
the metadata (the two 129k-string tokenizer arrays dominate), every malformed file must fail with a message that
says exactly what is wrong and where, and tensor data must stay in the page cache until someone reads it.

Layout, little-endian throughout: magic "GGUF", u32 version (3), u64 tensor count, u64 metadata count; then the
metadata (key string, u32 value type, value); then the tensor directory (name string, u32 n_dims, u64 ne[n_dims],
u32 ggml type, u64 offset relative to the data section); then padding to `general.alignment` (default 32) and the
tensor data. A string is a u64 byte length followed by UTF-8 bytes. An array is a u32 element type, a u64 count,
and the elements.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GGUFError, ModelFileMissing

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 8


class GGMLType(IntEnum):
    """The ggml tensor types that occur in DeepSeek V4 Flash GGUF files (ds4.c)."""

    F32 = 0
    F16 = 1
    Q8_0 = 8
    Q2_K = 10
    Q4_K = 12
    IQ2_XXS = 16
    I32 = 26
    MXFP4 = 39


# (elements, bytes) per block; plain types are blocks of one element.
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q4_K: (256, 144),
    GGMLType.IQ2_XXS: (256, 66),
    GGMLType.I32: (1, 4),
    GGMLType.MXFP4: (32, 17),
}

# Names of other ggml types, only so that an unsupported tensor is reported by name.
_OTHER_TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 11: "Q3_K", 13: "Q5_K", 14: "Q6_K",
                     15: "Q8_K", 17: "IQ2_XS", 18: "IQ3_XXS", 24: "I8", 25: "I16", 27: "I64", 28: "F64", 30: "BF16"}


class ValueType(IntEnum):
    """GGUF metadata value types."""

    U8 = 0
    I8 = 1
    U16 = 2
    I16 = 3
    U32 = 4
    I32 = 5
    F32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    U64 = 10
    I64 = 11
    F64 = 12


_SCALARS: dict[ValueType, tuple[str, str]] = {  # type -> (struct format, short name)
    ValueType.U8: ("<B", "u8"),
    ValueType.I8: ("<b", "i8"),
    ValueType.U16: ("<H", "u16"),
    ValueType.I16: ("<h", "i16"),
    ValueType.U32: ("<I", "u32"),
    ValueType.I32: ("<i", "i32"),
    ValueType.F32: ("<f", "f32"),
    ValueType.BOOL: ("<B", "bool"),
    ValueType.U64: ("<Q", "u64"),
    ValueType.I64: ("<q", "i64"),
    ValueType.F64: ("<d", "f64"),
}
_NUMPY = {ValueType.U8: "<u1", ValueType.I8: "<i1", ValueType.U16: "<u2", ValueType.I16: "<i2",
          ValueType.U32: "<u4", ValueType.I32: "<i4", ValueType.F32: "<f4", ValueType.BOOL: "?",
          ValueType.U64: "<u8", ValueType.I64: "<i8", ValueType.F64: "<f8"}

# Smallest possible encodings, used to reject counts the file cannot hold before allocating anything.
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type, one-byte value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one ne, type, offset


def type_name(ggml_type: int) -> str:
    """The ggml name of a type id ("Q8_0"), or "type N" when it is unknown."""
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return _OTHER_TYPE_NAMES.get(ggml_type, f"type {ggml_type}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor directory entry; `shape` is in ggml ne order (ne0, the contiguous dimension, first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        """Bytes of one ne0 row (a whole number of blocks)."""
        elements, size = BLOCK_SIZES[self.ggml_type]
        return self.shape[0] // elements * size


MAX_ARRAY_NESTING = 8
"""Arrays of arrays deeper than this are refused; DeepSeek V4 files have none, and deep nesting would recurse."""


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file; every overrun becomes a GGUFError."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"{self.path}: truncated in {what}: needs {n} bytes at offset {self.pos}, "
                            f"file size is {self.size}")

    def unpack(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        if self.pos + n > self.size:
            raise GGUFError(f"{self.path}: {what} has length {n}, which runs past the end of the file "
                            f"(offset {self.pos}, file size {self.size})")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def value(self, vtype: int, what: str) -> tuple[Any, str]:
        """Read one metadata value; return it with its type name ("u32", "array[string]", ...)."""
        if vtype == ValueType.STRING:
            return self.string(what), "string"
        if vtype == ValueType.ARRAY:
            return self.array(what)
        try:
            fmt, name = _SCALARS[ValueType(vtype)]
        except ValueError:
            raise GGUFError(f"{self.path}: {what} has unknown value type {vtype}, expected 0..12") from None
        value = self.unpack(fmt, struct.calcsize(fmt), what)
        return (value != 0 if vtype == ValueType.BOOL else value), name

    def array(self, what: str, depth: int = 0) -> tuple[Any, str]:
        etype = self.u32(f"the element type of {what}")
        count = self.u64(f"the length of {what}")
        if etype == ValueType.STRING:
            return self.strings(count, what), "array[string]"
        if etype == ValueType.ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise GGUFError(f"{self.path}: {what} nests arrays more than {MAX_ARRAY_NESTING} deep")
            if count * 12 > self.size - self.pos:
                raise GGUFError(f"{self.path}: {what} has {count} arrays, which run past the end of the file "
                                f"(offset {self.pos}, file size {self.size})")
            items = [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]
            inner = items[0][1] if items else "array[?]"
            return [v for v, _ in items], f"array[{inner}]"
        try:
            dtype = np.dtype(_NUMPY[ValueType(etype)])
        except ValueError:
            raise GGUFError(f"{self.path}: {what} has unknown element type {etype}, expected 0..12") from None
        if count * dtype.itemsize > self.size - self.pos:
            raise GGUFError(f"{self.path}: {what} has {count} elements, which run past the end of the file "
                            f"(offset {self.pos}, file size {self.size})")
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += count * dtype.itemsize
        return values, f"array[{_SCALARS[ValueType(etype)][1]}]"

    def strings(self, count: int, what: str) -> list[str]:
        """An array of strings, in one tight loop: the tokenizer arrays hold ~129k entries each."""
        if count * 8 > self.size - self.pos:
            raise GGUFError(f"{self.path}: {what} has {count} strings, which run past the end of the file "
                            f"(offset {self.pos}, file size {self.size})")
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct("<Q").unpack_from
        out: list[str] = []
        append = out.append
        try:
            for i in range(count):
                if pos + 8 > size:
                    raise GGUFError(f"{self.path}: truncated in {what}[{i}]: needs 8 bytes at offset {pos}, "
                                    f"file size is {size}")
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > size:
                    raise GGUFError(f"{self.path}: {what}[{i}] has length {n}, which runs past the end of the "
                                    f"file (offset {pos}, file size {size})")
                append(buf[pos:pos + n].decode("utf-8"))
                pos += n
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what}[{len(out)}] is not valid UTF-8 ({e.reason})") from None
        self.pos = pos
        return out


class GGUFFile:
    """A memory-mapped GGUF v3 file: header, metadata and tensor directory parsed, tensor data left on disk.

    `metadata` holds scalars as Python values, numeric arrays as numpy arrays and string arrays as lists of str;
    `metadata_types` gives each key's GGUF type name ("u32", "f32", "array[string]", ...); `tensors` is in file
    order, with absolute data offsets.
    """

    def __init__(self, path: Path, buf: mmap.mmap, version: int, metadata: dict[str, Any],
                 metadata_types: dict[str, str], tensors: dict[str, TensorInfo], alignment: int,
                 data_offset: int) -> None:
        self.path = path
        self._buf: mmap.mmap | None = buf
        self.version = version
        self.metadata = metadata
        self.metadata_types = metadata_types
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset
        self.size = len(buf)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        """Map `path` and parse everything up to the tensor data; raise GGUFError if it is not a sound GGUF v3."""
        path = Path(path)
        if not path.exists():
            raise ModelFileMissing.at(path)
        if not path.is_file():
            raise GGUFError(f"{path} is not a regular file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                raise GGUFError(f"{path} is {size} bytes long, too short for a GGUF file (expected the magic "
                                f"'GGUF' and a 24-byte header)")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return cls._parse(path, buf)
        except BaseException:
            buf.close()
            raise

    @classmethod
    def _parse(cls, path: Path, buf: mmap.mmap) -> GGUFFile:
        cur = _Cursor(buf, path)
        magic = bytes(buf[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file: it starts with {magic!r} (hex {magic.hex()}), expected "
                            f"{GGUF_MAGIC!r}")
        cur.pos = 4
        version = cur.u32("the header (version)")
        if version != GGUF_VERSION:
            hint = " (a big-endian GGUF; only little-endian is supported)" if version == 3 << 24 else ""
            raise GGUFError(f"{path}: GGUF version {version}{hint}, expected version {GGUF_VERSION}")
        n_tensors = cur.u64("the header (tensor count)")
        n_kv = cur.u64("the header (metadata count)")
        if n_kv * _MIN_KV_BYTES > cur.size - cur.pos:
            raise GGUFError(f"{path}: header claims {n_kv} metadata entries, more than a {cur.size}-byte file "
                            f"can hold")
        if n_tensors * _MIN_TENSOR_BYTES > cur.size - cur.pos:
            raise GGUFError(f"{path}: header claims {n_tensors} tensors, more than a {cur.size}-byte file can hold")

        metadata: dict[str, Any] = {}
        types: dict[str, str] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in metadata:
                raise GGUFError(f"{path}: metadata key {key!r} appears twice")
            vtype = cur.u32(f"the value type of metadata key {key!r}")
            metadata[key], types[key] = cur.value(vtype, f"metadata value {key!r}")

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in metadata and (types["general.alignment"] != "u32" or alignment <= 0
                                                or alignment & (alignment - 1)):
            raise GGUFError(f"{path}: general.alignment is {alignment!r} ({types['general.alignment']}), "
                            f"expected a u32 power of two")

        entries = [cls._read_tensor_entry(cur, i) for i in range(n_tensors)]
        data_offset = -(-cur.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, rel in entries:
            if name in tensors:
                raise GGUFError(f"{path}: tensor {name!r} appears twice in the tensor directory")
            if rel % alignment:
                raise GGUFError(f"{path}: tensor {name!r} has data offset {rel}, which is not a multiple of the "
                                f"alignment {alignment}")
            info = TensorInfo(name, shape, ggml_type, data_offset + rel, _nbytes(path, name, shape, ggml_type))
            end = info.offset + info.nbytes
            if end > cur.size:
                raise GGUFError(f"{path}: data of tensor {name!r} ends at byte {end}, past the end of the file "
                                f"({cur.size} bytes); the file is truncated")
            tensors[name] = info
        return cls(path, buf, version, metadata, types, tensors, alignment, data_offset)

    @staticmethod
    def _read_tensor_entry(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLType, int]:
        name = cur.string(f"the name of tensor #{i}")
        n_dims = cur.u32(f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{cur.path}: tensor {name!r} has {n_dims} dimensions, expected 1..{MAX_DIMS}")
        cur.need(8 * n_dims, f"the shape of tensor {name!r}")
        shape = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
        cur.pos += 8 * n_dims
        if min(shape) == 0:
            raise GGUFError(f"{cur.path}: tensor {name!r} has shape {list(shape)} with an empty dimension")
        type_id = cur.u32(f"the type of tensor {name!r}")
        try:
            ggml_type = GGMLType(type_id)
        except ValueError:
            raise GGUFError(f"{cur.path}: tensor {name!r} has ggml type {type_name(type_id)} ({type_id}), "
                            f"expected one of {', '.join(t.name for t in GGMLType)}") from None
        rel = cur.u64(f"the data offset of tensor {name!r}")
        return name, tuple(shape), ggml_type, rel

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes (ggml blocks) of a tensor: a zero-copy uint8 view of the mapped file."""
        if self._buf is None:
            raise ValueError(f"{self.path} is closed")
        info = self.tensors[name]
        return np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def close(self) -> None:
        """Release the mapping; views handed out earlier keep it alive until they are dropped."""
        buf, self._buf = self._buf, None
        if buf is not None:
            try:
                buf.close()
            except BufferError:
                pass  # numpy views still reference the map; it is unmapped when the last one goes

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nbytes(path: Path, name: str, shape: tuple[int, ...], ggml_type: GGMLType) -> int:
    elements, size = BLOCK_SIZES[ggml_type]
    if shape[0] % elements:
        raise GGUFError(f"{path}: tensor {name!r} has rows of {shape[0]} elements, not a multiple of the "
                        f"{ggml_type.name} block size {elements}")
    n = shape[0] // elements * size
    for d in shape[1:]:
        n *= d
    return n
