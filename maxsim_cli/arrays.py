"""numpy and Arrow arrays into each other without pyarrow's pandas bridge.

pyarrow imports pandas the first time a process calls ``pa.array`` or ``Array.to_numpy`` (it probes
its input for pandas types, and its numpy conversion sets up pandas' types): 0.35-0.5 s of a fresh
`maxsim score`'s set-up on the H200 machine, ~0.2 s on 2 cores, for arrays of plain numbers and
strings. These build them from their buffers instead (docs/kernel-notes.md, "`maxsim score`: the
pass against the kernel"); ``tests/test_first_call.py`` holds `maxsim score` runs, and the shard
commands (`pack`, `quantize`, `inspect`: the Arrow and safetensors readers and writers), free of pandas.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

# Arrow's fixed-width number types and numpy's, both ways (``DataType.to_pandas_dtype`` would do one
# way, but some pyarrow releases import pandas for it)
_NUMPY_DTYPES = {
    pa.int8(): np.dtype("int8"),
    pa.int16(): np.dtype("int16"),
    pa.int32(): np.dtype("int32"),
    pa.int64(): np.dtype("int64"),
    pa.uint8(): np.dtype("uint8"),
    pa.uint16(): np.dtype("uint16"),
    pa.uint32(): np.dtype("uint32"),
    pa.uint64(): np.dtype("uint64"),
    pa.float16(): np.dtype("float16"),
    pa.float32(): np.dtype("float32"),
    pa.float64(): np.dtype("float64"),
}
_ARROW_TYPES = {dtype: kind for kind, dtype in _NUMPY_DTYPES.items()}


def _plain_numbers(values: pa.Array) -> bool:
    return values.type in _NUMPY_DTYPES and not values.null_count


def array_values(values: pa.Array) -> np.ndarray:
    """The values of a null-free fixed-width Arrow array (sort indices, offsets) as a read-only numpy
    view of its buffer: what ``to_numpy()`` gives, without pandas."""
    if not _plain_numbers(values):
        raise ValueError(f"array_values: {values.type} with {values.null_count} nulls; numbers without nulls")
    dtype = _NUMPY_DTYPES[values.type]
    if len(values) == 0:
        return np.empty(0, dtype=dtype)
    data = values.buffers()[1]
    return np.frombuffer(data, dtype=dtype, count=len(values), offset=values.offset * dtype.itemsize)


def numbers(values: pa.Array) -> np.ndarray:
    """`array_values` where it applies; an array with nulls (or of another type) goes through
    ``to_numpy``, as before (nulls as NaN where the type allows; the callers' checks name them)."""
    return array_values(values) if _plain_numbers(values) else values.to_numpy(zero_copy_only=False)


def values_array(values: np.ndarray) -> pa.Array:
    """A numeric numpy array, flattened, as an Arrow array over the same bytes (no nulls): what
    ``pa.array`` gives, without pandas."""
    values = np.ascontiguousarray(values).reshape(-1)
    return pa.Array.from_buffers(_ARROW_TYPES[values.dtype], len(values), [None, pa.py_buffer(values)])


def strings_array(items: Sequence[str], *, large: bool = True) -> pa.Array:
    """Python strings as an Arrow large_string array (``large=False``: string, int32 offsets; UTF-8
    bytes and offsets built here): what ``pa.array(items, type=pa.large_string())`` gives, without
    pandas. A string that is not valid Unicode (a lone surrogate), or more than 2 GiB of text for a
    string array, is left to ``pa.array``, which refuses it as before."""
    kind = pa.large_string() if large else pa.string()
    joined = "".join(items)
    if joined.isascii():  # a character is a byte: one join and one encode, no bytes object a string
        raw = joined.encode("ascii")
        lengths = np.fromiter(map(len, items), dtype=np.int64, count=len(items))
    else:
        try:
            encoded = [item.encode("utf-8") for item in items]
        except UnicodeEncodeError:
            return pa.array(list(items), type=kind)
        raw = b"".join(encoded)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = pa.py_buffer(raw)
    if large:
        return pa.LargeStringArray.from_buffers(len(items), pa.py_buffer(offsets), data)
    if offsets[-1] > np.iinfo(np.int32).max:
        return pa.array(list(items), type=kind)
    return pa.StringArray.from_buffers(len(items), pa.py_buffer(offsets.astype(np.int32)), data)


def gather_strings(data: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> pa.Array:
    """The byte strings ``data[starts[i]:stops[i]]`` as one large_binary array (bytes copied out)."""
    lengths = (stops - starts).astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    at = np.repeat(starts.astype(np.int64) - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    values = np.ascontiguousarray(data[at])
    return pa.Array.from_buffers(
        pa.large_binary(), len(lengths), [None, pa.py_buffer(offsets), pa.py_buffer(values)]
    )


# numpy dtypes as safetensors names them (`safetensors_bytes`)
_SAFETENSORS_DTYPES = {"<f2": "F16", "<f4": "F32", "<u4": "U32", "<i8": "I64", "|u1": "U8", "|i1": "I8"}


def safetensors_bytes(arrays: dict[str, np.ndarray], meta: dict[str, str]) -> bytes:
    """A safetensors file's bytes of ``arrays`` (little-endian numpy arrays: float16/32, uint32, int64,
    uint8, int8) and ``meta``, its header's keys sorted and the arrays in name order: the same contents
    give the same bytes and sha256, where the safetensors library writes its header from a hash map, in
    an order that changes from process to process. The header is padded to 8 bytes, as the format asks."""
    import json
    import struct

    header: dict[str, object] = {"__metadata__": dict(meta)}
    parts, start = [], 0
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        header[name] = {"dtype": _SAFETENSORS_DTYPES[array.dtype.str], "shape": list(array.shape),
                        "data_offsets": [start, start + array.nbytes]}  # fmt: skip
        parts.append(array.tobytes())
        start += array.nbytes
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *parts])
