"""Reading safetensors files into numpy, bfloat16 included (numpy has no bf16, so we widen it by hand).

The format is simple: an 8-byte little-endian header length, a JSON header mapping tensor names to
dtype/shape/byte offsets, then the raw bytes. Reading it ourselves lets us check every offset and name
the file and tensor when something is wrong, instead of failing deep inside a library.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32: bf16 is the top half of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def read_safetensors(path: str | Path, float_dtype: np.dtype = np.float32,
                     select: Callable[[str], tuple[slice, ...] | None] | None = None) -> dict[str, np.ndarray]:
    """All tensors of one file; floating tensors converted to `float_dtype`.

    `select(name)` may name a slice of a tensor (a tensor-parallel shard): only that slice of the
    memory-mapped file is read and converted.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: safetensors file not found")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if data.size < 8:
        raise ValueError(f"{path}: corrupt safetensors file (shorter than its 8-byte header length)")
    (header_len,) = struct.unpack("<Q", data[:8].tobytes())
    if header_len > data.size - 8:
        raise ValueError(f"{path}: corrupt safetensors file (header length {header_len} exceeds file size)")
    try:
        header = json.loads(data[8 : 8 + header_len].tobytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    base = 8 + header_len
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: corrupt header entry for tensor {name!r}") from None
        if dtype_name not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dtype_name}")
        np_dtype = np.dtype(_DTYPES[dtype_name])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * np_dtype.itemsize or base + end > data.size or begin < 0:
            raise ValueError(f"{path}: tensor {name!r} has byte range [{begin}, {end}) that does not match "
                             f"shape {shape} x {dtype_name} or runs past the end of the file")
        arr = data[base + begin : base + end].view(np_dtype).reshape(shape)
        index = select(name) if select is not None else None
        if index is not None:
            arr = arr[index]
        if dtype_name == "BF16":
            arr = bf16_to_float32(arr)
        if np.issubdtype(arr.dtype, np.floating):
            arr = np.ascontiguousarray(arr, dtype=float_dtype)
        else:
            arr = np.array(arr)
        out[name] = arr
    return out
