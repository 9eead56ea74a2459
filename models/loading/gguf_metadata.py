"""A GGUF file's metadata block, read without touching its tensors (tens of milliseconds, where
gguf.GGUFReader builds numpy views of every vocabulary string and takes seconds: about 20 s for
Gemma 3's 262,144 tokens on 2 busy cores), and `read_gguf`: the metadata plus the tensors as
memory-mapped byte arrays, what the weight loader needs and nothing more."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types: fixed-size scalars (struct format), 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of a GGUF file, as plain Python values, without touching the tensors.

    Strings are str, arrays are lists. Raises ValueError naming the file when it is not a readable
    little-endian GGUF v2/v3.
    """
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as exc:  # missing, a directory, unreadable
        raise ValueError(f"{path}: cannot be read as a GGUF file: {exc}") from exc
    with handle:
        try:
            blob = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # mmap refuses an empty file with ValueError
            raise ValueError(f"{path}: cannot be read as a GGUF file: {exc}") from exc
        with blob:
            return _parse_metadata(blob, path)[0]


def _parse_metadata(blob: mmap.mmap, path: Path) -> tuple[dict[str, Any], int, int]:
    """(metadata, offset just past it, tensor count)."""
    if blob[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
        if version not in (2, 3):
            raise ValueError(
                f"{path}: GGUF version {version} is not supported (only little-endian v2 and v3; "
                "for other files pass a gguf.GGUFReader)"
            )
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = _read_string(blob, pos)
            (value_type,) = struct.unpack_from("<I", blob, pos)
            metadata[key], pos = _read_value(blob, pos + 4, value_type, path, key)
        return metadata, pos, tensor_count
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise ValueError(f"{path}: GGUF metadata is truncated or corrupt: {exc}") from exc


def _read_string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(blob, pos)
    end = pos + 8 + length
    if end > len(blob):
        raise IndexError(f"a string of {length} bytes at offset {pos} runs past the end of the file")
    return blob[pos + 8 : end].decode("utf-8"), end


def _read_value(blob: mmap.mmap, pos: int, value_type: int, path: Path, key: str) -> tuple[Any, int]:
    if value_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(blob, pos)
    if value_type != _ARRAY:
        raise ValueError(f"{path}: metadata key {key!r} has unknown GGUF value type {value_type}")
    item_type, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item_type in _NUMPY_TYPES:
        dtype = np.dtype(_NUMPY_TYPES[item_type])
        end = pos + count * dtype.itemsize
        if end > len(blob):
            raise IndexError(f"the array under {key!r} runs past the end of the file")
        return np.frombuffer(blob, dtype=dtype, count=count, offset=pos).tolist(), end
    if item_type == _STRING:
        values = []
        for _ in range(count):  # variable-length entries: nothing to do but walk them
            value, pos = _read_string(blob, pos)
            values.append(value)
        return values, pos
    if item_type == _ARRAY:  # nested arrays: never used by tokenizer keys, but must be skipped correctly
        values = []
        for _ in range(count):  # each element is an array value: its item type, count, then items
            value, pos = _read_value(blob, pos, _ARRAY, path, key)
            values.append(value)
        return values, pos
    raise ValueError(f"{path}: metadata key {key!r} is an array of unknown GGUF value type {item_type}")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its GGUF dims (fastest first, as the file lists them), its ggml type, and
    its bytes as uint8 [rows, bytes per row] (a view into the memory-mapped file)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def read_gguf(path: str | Path) -> GGUFFile:
    """Metadata and tensors of a GGUF v2/v3 file; the tensors' bytes stay on disk until read (mmap).

    ValueError naming the file when it is not a readable GGUF, a tensor has an unknown type, or its bytes run
    past the end of the file.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        with path.open("rb") as handle:
            blob = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # missing, a directory, empty
        raise ValueError(f"{path}: cannot be read as a GGUF file: {exc}") from exc
    data = np.frombuffer(blob, dtype=np.uint8)  # the tensors' views keep the mapping alive
    metadata, pos, count = _parse_metadata(blob, path)
    infos = []
    try:
        for _ in range(count):
            name, pos = _read_string(blob, pos)
            (n_dims,) = struct.unpack_from("<I", blob, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in dims), ggml_type, offset))
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise ValueError(f"{path}: GGUF tensor table is truncated or corrupt: {exc}") from exc
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-pos // alignment) * alignment
    tensors = []
    for name, dims, ggml_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
        if not dims or dims[0] % block:
            raise ValueError(f"{path}: tensor {name!r} of dims {dims} is not whole {qtype.name} blocks")
        row_bytes = dims[0] // block * block_bytes
        rows = int(np.prod(dims[1:], dtype=np.int64))
        begin = start + offset
        if begin + rows * row_bytes > len(data):
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        tensors.append(GGUFTensor(name, dims, qtype, data[begin:begin + rows * row_bytes].reshape(rows, row_bytes)))
    return GGUFFile(path, metadata, tensors)
