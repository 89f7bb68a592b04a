"""Shard readers: `open_shard` sniffs the container (safetensors, Arrow IPC file or stream, Parquet)
and returns a `Shard` whose structure (metadata, ids, offsets, counts) is checked on open in O(N),
never touching the T x dim values; `read_docs` reads only the rows asked for and checks them for
NaN/Inf. `read_queries` reads a whole query file (or an Arrow IPC stream on stdin).

Opening a shard and reading its ids and offsets needs no torch (numpy and pyarrow); torch is imported
when token rows are first read, as the tensors of a `DocBatch`.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import shlex
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from maxsim_cli.arrays import array_values, numbers, strings_array
from maxsim_cli.errors import MaxsimError
from maxsim_cli.shards.format import (
    ARROW_VALUE_TYPES,
    MAX_SAFETENSORS_HEADER,
    SAFETENSORS_DTYPE_NAMES,
    SAFETENSORS_ITEMSIZE,
    SHARD_SUFFIXES,
    ArrowIds,
    DocBatch,
    ShardInfo,
    check_counts,
    check_ids,
    check_offsets,
    check_values,
    decode_ids,
    input_error,
    one_line,
    parse_metadata,
    show_id,
    torch_dtypes,
)

if TYPE_CHECKING:
    import torch


def _shard_info(
    path: str, fmt: str, num_docs: int, num_tokens: int, dim: int, dtype: str, meta: dict[str, Any]
) -> ShardInfo:
    """What a shard holds, once its structure has been checked against its metadata."""
    return ShardInfo(
        path, fmt, num_docs, num_tokens, dim, dtype, meta["quantization"], meta["normalized"],
        meta["encoder"], meta["patch_grid"], meta["patch_start"],
    )  # fmt: skip


class Shard:
    """An open shard: `ids`, `offsets` (int64 numpy [N+1]) and `info` in memory, values read on demand.

    Use `open_shard(path)`; the subclasses differ only in how `_read_rows` fetches a document range.
    Reads are serialised by a lock, so a prefetch thread may share the shard.
    """

    def __init__(
        self, info: ShardInfo, ids: list[str] | None, offsets: np.ndarray, id_array: pa.Array | None = None
    ) -> None:
        if ids is None and id_array is None:
            raise ValueError("Shard: give the ids as a list or as an Arrow array")
        self.info = info
        self.path = info.path
        self._ids = ids
        self.offsets = offsets
        self._id_array = id_array
        self._lock = threading.Lock()

    @property
    def ids(self) -> list[str]:
        """The ids as Python strings, made from the Arrow array on first use: exhaustive scoring never
        asks, and making them took ~0.03 s per 780K ids when every shard was opened."""
        if self._ids is None:
            assert self._id_array is not None
            self._ids = self._id_array.to_pylist()
        return self._ids

    @property
    def id_array(self) -> pa.Array:
        """The ids as an Arrow large_string array (built from `ids` once where the reader had none)."""
        if self._id_array is None:
            self._id_array = strings_array(self.ids)
        return self._id_array

    # -- subclass hook --
    def _read_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token rows of documents start..stop-1 (stop > start): `[t, dim]` values, `[t]` scales or None."""
        raise NotImplementedError

    # -- public API --
    @property
    def num_docs(self) -> int:
        return self.info.num_docs

    @property
    def num_tokens(self) -> int:
        return self.info.num_tokens

    def __len__(self) -> int:
        return self.info.num_docs

    def __enter__(self) -> Shard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the file (memory map, handles). Reading afterwards is an error."""

    def _empty_batch(self, first_doc: int = 0) -> DocBatch:
        import torch

        dtype = torch_dtypes()[self.info.dtype]
        scales = torch.empty(0, dtype=torch.float32) if self.info.dtype == "int8" else None
        return DocBatch(
            [],
            torch.empty(0, self.info.dim, dtype=dtype),
            torch.zeros(1, dtype=torch.int64),
            scales,
            first_doc,
        )

    def read_docs(self, start: int, stop: int) -> DocBatch:
        """Documents `start..stop-1`: reads only their rows `offsets[start]:offsets[stop]`; checks NaN/Inf."""
        import torch

        n = self.info.num_docs
        if not (0 <= start <= stop <= n):
            raise IndexError(f"{self.path}: document range {start}:{stop} outside 0:{n}")
        if start == stop:
            return self._empty_batch(start)
        with self._lock:
            embeddings, scales = self._read_rows(start, stop)
        local = self.offsets[start : stop + 1] - self.offsets[start]
        ids = self.ids[start:stop]
        check_values(self.path, embeddings, scales, local, ids, start)
        return DocBatch(ids, embeddings, torch.from_numpy(np.array(local, dtype=np.int64)), scales, start)

    def read_doc_indices(self, indices: Sequence[int]) -> DocBatch:
        """Documents at `indices`, in that order (repeats allowed); reads each consecutive run once."""
        import torch

        wanted = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self.info.num_docs
        if wanted.size == 0:
            return self._empty_batch()
        if wanted.min() < 0 or wanted.max() >= n:
            raise IndexError(f"{self.path}: document index outside 0:{n}")
        unique = np.unique(wanted)
        runs = np.split(unique, np.flatnonzero(np.diff(unique) != 1) + 1)
        emb_parts, scale_parts = [], []
        for run in runs:
            batch = self.read_docs(int(run[0]), int(run[-1]) + 1)
            emb_parts.append(batch.embeddings)
            scale_parts.append(batch.scales)
        pool = emb_parts[0] if len(emb_parts) == 1 else torch.cat(emb_parts)
        pool_scales = None
        if scale_parts[0] is not None:
            pool_scales = scale_parts[0] if len(scale_parts) == 1 else torch.cat(scale_parts)  # type: ignore[arg-type]
        lengths_u = self.offsets[unique + 1] - self.offsets[unique]
        pool_starts = np.concatenate([[0], np.cumsum(lengths_u)[:-1]])
        pos = np.searchsorted(unique, wanted)
        lens = lengths_u[pos]
        out_offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        ids = [self.ids[i] for i in wanted.tolist()]
        if len(unique) == len(wanted) and np.array_equal(unique, wanted):
            emb, sc = pool, pool_scales  # already in order: no gather
        else:
            rows = torch.from_numpy(
                np.repeat(pool_starts[pos] - out_offsets[:-1], lens)
                + np.arange(out_offsets[-1], dtype=np.int64)
            )
            emb = pool.index_select(0, rows)
            sc = pool_scales.index_select(0, rows) if pool_scales is not None else None
        return DocBatch(ids, emb, torch.from_numpy(out_offsets), sc, int(wanted[0]))

    def iter_batches(
        self, max_tokens: int, *, start: int = 0, stop: int | None = None, max_docs: int | None = None
    ) -> Iterator[DocBatch]:
        """Consecutive documents in batches of at most `max_tokens` tokens (and `max_docs` documents);
        a document longer than `max_tokens` comes alone."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        stop = self.info.num_docs if stop is None else stop
        a = start
        while a < stop:
            b = int(np.searchsorted(self.offsets, self.offsets[a] + max_tokens, side="right")) - 1
            b = min(max(b, a + 1), stop)
            if max_docs is not None:
                b = min(b, a + max_docs)
            yield self.read_docs(a, b)
            a = b


def _st_tensor(path: str, header: dict[str, Any], name: str, data_size: int) -> tuple[str, list[int]]:
    """Check one safetensors header entry; return (dtype, shape)."""
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise input_error(
            path,
            f"missing tensor {name!r}; a maxsim shard has embeddings, offsets, ids, id_offsets "
            "(and scales when int8)",
        )
    dtype, shape, span = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if (
        not isinstance(dtype, str)
        or not isinstance(shape, list)
        or not isinstance(span, list)
        or len(span) != 2
        or not all(isinstance(s, int) and s >= 0 for s in [*shape, *span])
    ):
        raise input_error(path, f"corrupt header entry for tensor {name!r}")
    if dtype not in SAFETENSORS_ITEMSIZE:
        raise input_error(path, f"tensor {name!r} has unknown dtype {dtype!r}")
    begin, end = span
    if end < begin or end - begin != math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]:
        raise input_error(path, f"tensor {name!r}: data_offsets {span} do not match shape {shape} of {dtype}")
    if end > data_size:
        raise input_error(
            path,
            f"truncated: tensor {name!r} ends at byte {end} of the data section but only "
            f"{data_size} bytes follow the header; re-copy or rewrite the file",
        )
    return dtype, shape


class SafetensorsShard(Shard):
    """safetensors container: header parsed and checked here, values through `safe_open(...).get_slice`."""

    def __init__(self, path: str) -> None:
        opened = os.stat(path)
        size = opened.st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise input_error(
                    path, f"truncated: {size} bytes, shorter than the 8-byte safetensors header length"
                )
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_SAFETENSORS_HEADER:
                raise input_error(
                    path,
                    f"corrupt safetensors header length {header_len} (at offset 0); "
                    "not a safetensors file or damaged",
                )
            if 8 + header_len > size:
                raise input_error(
                    path,
                    f"truncated: header needs {header_len} bytes after offset 8 but the file "
                    f"has {size} bytes",
                )
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise input_error(
                path, f"corrupt safetensors header (bytes 8..{8 + header_len}): {one_line(exc)}"
            ) from None
        if not isinstance(header, dict):
            raise input_error(path, "corrupt safetensors header: not a JSON object")
        meta_raw = header.get("__metadata__")
        if meta_raw is not None and (
            not isinstance(meta_raw, dict) or not all(isinstance(v, str) for v in meta_raw.values())
        ):
            raise input_error(path, "corrupt __metadata__: must map strings to strings")
        meta = parse_metadata(path, meta_raw, "__metadata__")
        data_size = size - 8 - header_len
        emb_dtype, emb_shape = _st_tensor(path, header, "embeddings", data_size)
        if emb_dtype not in SAFETENSORS_DTYPE_NAMES:
            raise input_error(
                path, f"unsupported embeddings dtype {emb_dtype} (expected F16, BF16, F32, or I8 with scales)"
            )
        dtype = SAFETENSORS_DTYPE_NAMES[emb_dtype]
        if dtype != meta["dtype"]:
            raise input_error(path, f"embeddings are {emb_dtype} but metadata says dtype={meta['dtype']}")
        if len(emb_shape) != 2:
            raise input_error(path, f"embeddings must be 2-D [num_tokens, dim], got shape {emb_shape}")
        num_tokens, dim = emb_shape
        shapes: dict[str, list[int]] = {}
        for name, want in (("offsets", "I64"), ("ids", "U8"), ("id_offsets", "I64")):
            got, shape = _st_tensor(path, header, name, data_size)
            if got != want or len(shape) != 1:
                raise input_error(path, f"tensor {name!r} must be a 1-D {want} tensor, got {got} {shape}")
            shapes[name] = shape
        if dtype == "int8":
            if "scales" not in header:
                raise input_error(
                    path,
                    "int8 embeddings without scales: an int8 shard needs a F32 'scales' "
                    "tensor [num_tokens]; rewrite it with `maxsim quantize`",
                )
            got, shape = _st_tensor(path, header, "scales", data_size)
            if got != "F32" or shape != [num_tokens]:
                raise input_error(path, f"tensor 'scales' must be F32 [{num_tokens}], got {got} {shape}")
        if shapes["offsets"] != shapes["id_offsets"]:
            raise input_error(
                path,
                f"offsets {shapes['offsets']} and id_offsets {shapes['id_offsets']} differ in "
                "length; both must be [num_docs + 1]",
            )
        try:
            from safetensors import safe_open

            # safetensors checks the whole header here; ids and offsets come as numpy arrays, so opening
            # needs no torch. The values are read through a torch handle, opened on the first read.
            with safe_open(path, framework="numpy") as f:
                id_offsets = f.get_tensor("id_offsets")
                id_bytes = f.get_tensor("ids")
                offsets = f.get_tensor("offsets")
        except MaxsimError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise input_error(path, f"corrupt safetensors file: {one_line(exc)}") from None
        # The values are read with `os.pread` at these byte positions (docs/format.md: row-major,
        # little-endian), never through a map of the file: a file truncated while mapped kills the
        # process with SIGBUS, a short read is a one-line error.
        base = 8 + header_len
        self.row_bytes = dim * SAFETENSORS_ITEMSIZE[emb_dtype]
        self.emb_start = base + int(header["embeddings"]["data_offsets"][0])
        self.scales_start = base + int(header["scales"]["data_offsets"][0]) if dtype == "int8" else None
        self._identity = _identity(opened)
        self._fd: int | None = None
        self._fd_lock = threading.Lock()
        self._closed = False
        id_array = decode_ids(path, id_bytes, id_offsets)
        check_offsets(path, offsets, ArrowIds(id_array), num_tokens)
        check_counts(path, meta, len(id_array), num_tokens, dim)
        info = _shard_info(path, "safetensors", len(id_array), num_tokens, dim, dtype, meta)
        super().__init__(info, None, offsets.astype(np.int64, copy=False), id_array)

    def _values_fd(self) -> int:
        """The file, opened on the first read and checked to be the one opened (same inode, size and
        modification time)."""
        with self._fd_lock:
            if self._closed:
                raise MaxsimError(f"{self.path}: shard is closed")
            if self._fd is None:
                try:
                    fd = os.open(self.path, os.O_RDONLY)
                except OSError as exc:
                    raise input_error(
                        self.path, f"cannot reopen it to read values: {one_line(exc)}"
                    ) from None
                try:
                    check_unchanged(self.path, self._identity, os.fstat(fd))
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            return self._fd

    def read_rows_into(self, t0: int, t1: int, embeddings: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Token rows t0..t1-1 into ``embeddings[: t1 - t0]`` (and ``scales[: t1 - t0]`` for int8), with
        `os.preadv` straight into the caller's buffers: one copy out of the page cache, no map, no lock
        (reader threads share the file). Values are not checked here."""
        fd = self._values_fd()
        pread_into(self.path, fd, self._identity, embeddings[: t1 - t0], self.emb_start + t0 * self.row_bytes)
        if self.scales_start is not None and scales is not None:
            pread_into(self.path, fd, self._identity, scales[: t1 - t0], self.scales_start + t0 * 4)

    def _read_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        import torch

        t0, t1 = int(self.offsets[start]), int(self.offsets[stop])
        emb = torch.empty(t1 - t0, self.info.dim, dtype=torch_dtypes()[self.info.dtype])
        scales = torch.empty(t1 - t0, dtype=torch.float32) if self.scales_start is not None else None
        self.read_rows_into(t0, t1, emb, scales)
        return emb, scales

    def close(self) -> None:
        with self._fd_lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


# What identifies the file a shard was opened from: (device, inode, size, modification time in ns).
FileIdentity = tuple[int, int, int, int]


def _identity(st: os.stat_result) -> FileIdentity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_unchanged(path: str, identity: FileIdentity, st: os.stat_result) -> None:
    """`InputError` when the file ``st`` describes is not the one opened: replaced, resized or written."""
    now = _identity(st)
    if now == identity:
        return
    if now[:2] != identity[:2]:
        what = "was replaced by another file"
    elif now[2] != identity[2]:
        what = f"changed size from {identity[2]} to {now[2]} bytes"
    else:
        what = "was rewritten"
    raise input_error(
        path,
        f"{what} while maxsim was reading it; let the process writing it finish, then run again",
    )


def pread_into(path: str, fd: int, identity: FileIdentity, out: Any, offset: int) -> None:
    """Fill the tensor or array ``out`` with the file's bytes from ``offset`` (`os.preadv`). A read that
    ends early, or a file that changed (`check_unchanged`, checked after the read), is an `InputError`."""
    array = out.view(_uint8()).numpy() if hasattr(out, "numpy") else out.view(np.uint8)
    view = memoryview(array.reshape(-1)).cast("B")
    done = 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done : done + (1 << 30)]], offset + done)
        except OSError as exc:
            raise input_error(path, f"cannot read: {one_line(exc)}") from None
        if got <= 0:
            check_unchanged(path, identity, os.fstat(fd))
            raise input_error(
                path, f"truncated: the file ends at byte {offset + done}; re-copy or rewrite it"
            )
        done += got
    check_unchanged(path, identity, os.fstat(fd))


def _uint8() -> Any:
    import torch

    return torch.uint8


def _arrow_schema_types(path: str, schema: pa.Schema, dim: int, dtype: str) -> tuple[bool, bool]:
    """Check the id / embedding / scales / length columns; return (inner_is_fixed, has_length)."""
    names = schema.names
    for col in ("id", "embedding"):
        if col not in names:
            raise input_error(
                path,
                f"no {col!r} column (columns: {', '.join(names)}); a maxsim shard has 'id' and 'embedding'",
            )
    if schema.field("id").type not in (pa.string(), pa.large_string()):
        raise input_error(path, f"column 'id' must be utf8 or large_utf8, not {schema.field('id').type}")
    emb_type = schema.field("embedding").type
    if not (pa.types.is_list(emb_type) or pa.types.is_large_list(emb_type)):
        raise input_error(path, f"column 'embedding' must be list<fixed_size_list<T, dim>>, not {emb_type}")
    inner = emb_type.value_type
    fixed = pa.types.is_fixed_size_list(inner)
    if not (fixed or pa.types.is_list(inner) or pa.types.is_large_list(inner)):
        raise input_error(path, f"column 'embedding' must be list<fixed_size_list<T, dim>>, not {emb_type}")
    if fixed and inner.list_size != dim:
        raise input_error(
            path, f"embedding vectors have {inner.list_size} values but metadata says dim={dim}"
        )
    want = ARROW_VALUE_TYPES[dtype]
    if inner.value_type != want:
        raise input_error(
            path,
            f"embedding values are {inner.value_type} but metadata says dtype={dtype} (stored as {want})",
        )
    if dtype == "int8":
        if "scales" not in names:
            raise input_error(
                path,
                "int8 embeddings without scales: an int8 shard needs a 'scales' "
                "list<float32> column; rewrite it with `maxsim quantize`",
            )
        st = schema.field("scales").type
        if not ((pa.types.is_list(st) or pa.types.is_large_list(st)) and st.value_type == pa.float32()):
            raise input_error(path, f"column 'scales' must be list<float32>, not {st}")
    has_length = "length" in names
    if has_length and not pa.types.is_integer(schema.field("length").type):
        raise input_error(path, f"column 'length' must be an integer, not {schema.field('length').type}")
    return fixed, has_length


def _decode_meta(raw: dict[bytes, bytes] | None) -> dict[str, str] | None:
    if raw is None:
        return None
    return {
        k.decode("utf-8", "replace"): v.decode("utf-8", "replace")
        for k, v in raw.items()
        if not k.startswith(b"ARROW:")
    }


def _combine(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(column, pa.ChunkedArray):
        return column.chunk(0) if column.num_chunks == 1 else pa.concat_arrays(column.chunks)
    return column


def _list_lengths(arr: pa.Array) -> np.ndarray:
    return np.diff(array_values(arr.offsets)).astype(np.int64)


class _ArrowTokens:
    """Turns a slice of an `embedding` (and `scales`) column into numpy rows, checking vector lengths."""

    def __init__(self, path: str, dim: int, dtype: str, fixed: bool) -> None:
        self.path, self.dim, self.dtype, self.fixed = path, dim, dtype, fixed

    def rows(self, column: pa.Array, lo: int, hi: int, ids: Sequence[str], first: int) -> np.ndarray:
        sub = column.slice(lo, hi - lo)
        vectors = sub.flatten()
        if not self.fixed:
            widths = _list_lengths(vectors)
            bad = np.flatnonzero(widths != self.dim)
            if bad.size:
                tok_offsets = np.concatenate([[0], np.cumsum(_list_lengths(sub))])
                doc = int(np.searchsorted(tok_offsets, bad[0], side="right")) - 1
                raise input_error(
                    self.path,
                    f"document {show_id(ids[first + doc])} has a token vector of "
                    f"{int(widths[bad[0]])} values; dim is {self.dim}",
                )
        values = vectors.flatten()
        if values.null_count:
            raise input_error(
                self.path, f"null values in the embeddings of documents {lo}..{hi} of a record batch"
            )
        return numbers(values).reshape(-1, self.dim)

    def scales(self, column: pa.Array, lo: int, hi: int) -> np.ndarray:
        return numbers(column.slice(lo, hi - lo).flatten())


def _to_torch(parts: list[np.ndarray], dtype: str) -> torch.Tensor:
    """Copy numpy pieces (possibly read-only views of a memory map) into one torch tensor."""
    import torch

    arr = np.concatenate(parts) if len(parts) > 1 else np.array(parts[0], copy=True)
    if dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


class _RecordShard(Shard):
    """Common part of Arrow IPC (file or stream) and Parquet shards: a table split in chunks of rows."""

    _chunk_starts: np.ndarray  # doc index where each chunk (record batch / row group) starts, [C+1]
    _tokens: _ArrowTokens
    _emb_col: int
    _scale_col: int | None

    def _chunk(self, index: int) -> pa.RecordBatch | pa.Table:
        raise NotImplementedError

    def _read_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        emb_parts, scale_parts = self._row_parts(start, stop)
        return _to_torch(emb_parts, self.info.dtype), (
            _to_torch(scale_parts, "float32") if scale_parts else None
        )

    def rows_numpy(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """`_read_rows` without torch (for `maxsim serve`'s HTTP workers, which import none): token rows
        of documents start..stop-1 as one numpy array (bfloat16 as its 16-bit storage) and the int8
        scales or None, with the same checks."""
        emb_parts, scale_parts = self._row_parts(start, stop)
        embeddings = np.concatenate(emb_parts) if len(emb_parts) > 1 else np.array(emb_parts[0], copy=True)
        if not scale_parts:
            return embeddings, None
        return embeddings, np.array(np.concatenate(scale_parts), dtype=np.float32)

    def _row_parts(self, start: int, stop: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The rows (and scales) of documents start..stop-1, a piece per chunk they span (read-only views
        where Arrow allows), checked against the documents' lengths."""
        emb_parts, scale_parts = [], []
        c = int(np.searchsorted(self._chunk_starts, start, side="right")) - 1
        a = start
        while a < stop:
            c_start, c_stop = int(self._chunk_starts[c]), int(self._chunk_starts[c + 1])
            b = min(stop, c_stop)
            chunk = self._chunk(c)
            emb_col = _combine(chunk.column(self._emb_col))
            emb_parts.append(self._tokens.rows(emb_col, a - c_start, b - c_start, self.ids, c_start))
            if self._scale_col is not None:
                scale_col = _combine(chunk.column(self._scale_col))
                scale_parts.append(self._tokens.scales(scale_col, a - c_start, b - c_start))
            a = b
            c += 1
        expected = int(self.offsets[stop] - self.offsets[start])
        tokens = sum(part.shape[0] for part in emb_parts)
        if tokens != expected:
            raise input_error(
                self.path, f"documents {start}..{stop} hold {tokens} tokens but their lengths say {expected}"
            )
        scale_count = sum(part.shape[0] for part in scale_parts)
        if scale_parts and scale_count != expected:
            raise input_error(
                self.path, f"documents {start}..{stop} have {scale_count} scales for {expected} tokens"
            )
        return emb_parts, scale_parts


# Hugging Face shard file names: `train-00000-of-00002.parquet`, `data-00000-of-00001.arrow`.
_HF_SHARD_NAME = re.compile(r".+-\d{5}-of-\d{5}")


def _pack_command(path: str, schema: pa.Schema) -> str | None:
    """For a table of token embeddings that is not a shard (a Hugging Face dataset's file, ...): what it
    is and the `maxsim pack` command that makes a corpus of it; None for any other table."""

    def storage(t: pa.DataType) -> pa.DataType:
        return t.storage_type if isinstance(t, pa.ExtensionType) else t

    def is_list(t: pa.DataType) -> bool:
        return pa.types.is_list(t) or pa.types.is_large_list(t)

    embedding = mask = None
    id_columns = []
    for field in schema:
        t = storage(field.type)
        if is_list(t):
            inner = storage(t.value_type)
            vectors = is_list(inner) or pa.types.is_fixed_size_list(inner)
            if vectors and embedding is None and pa.types.is_floating(inner.value_type):
                embedding = field.name
            elif not vectors and mask is None and "mask" in field.name.lower():
                mask = field.name
        elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t):
            id_columns.append(field.name)
    if embedding is None:
        return None
    # a file of a Hugging Face dataset's folder: pack the whole folder
    folder = os.path.dirname(path)
    name = os.path.basename(path)
    whole = os.path.isfile(os.path.join(folder, "state.json")) or _HF_SHARD_NAME.match(name)
    command = ["maxsim", "pack", (folder or ".") + os.sep if whole else path]
    id_column = "id" if "id" in id_columns else (id_columns[0] if id_columns else "ID_COLUMN")
    if id_column != "id":
        command += ["--id-column", id_column]
    if embedding != "embedding":
        command += ["--embedding-column", embedding]
    if mask is not None:
        command += ["--mask-column", mask]
    return (
        f"a table of token embeddings (column {embedding!r}), not a maxsim shard; make a corpus of it "
        f"with: {shlex.join([*command, '-o', 'corpus/'])}"
    )


def _check_field_names(path: str, schema: pa.Schema) -> None:
    """Field names that pyarrow can read (Arrow's format says UTF-8; a name that is not raises
    `UnicodeDecodeError` wherever pyarrow makes it a Python string), and no column that a shard reads
    named twice (pyarrow then finds none by that name)."""

    def read_names(field: pa.Field) -> None:  # the field's name and those of the fields inside it
        _ = field.name  # decoding it is the check
        kind = field.type
        for j in range(kind.num_fields if hasattr(kind, "field") else 0):
            read_names(kind.field(j))

    for i in range(len(schema)):
        try:
            read_names(schema.field(i))
        except UnicodeDecodeError:
            raise input_error(
                path,
                f"the name of column {i} (or of a field inside it) is not valid UTF-8; Arrow field names "
                "are UTF-8 text",
            ) from None
    for name in ("id", "embedding", "scales", "length"):
        if len(schema.get_all_field_indices(name)) > 1:
            raise input_error(path, f"column {name!r} appears more than once; a shard has each column once")


def _record_metadata(
    path: str, schema: pa.Schema, meta_raw: dict[bytes, bytes] | None, where: str
) -> tuple[dict[str, Any], bool, bool]:
    _check_field_names(path, schema)
    decoded = _decode_meta(meta_raw)
    if not decoded or "format" not in decoded:
        hint = _pack_command(path, schema)
        if hint is not None:
            raise input_error(path, hint)
    meta = parse_metadata(path, decoded, where)
    fixed, has_length = _arrow_schema_types(path, schema, meta["dim"], meta["dtype"])
    return meta, fixed, has_length


def _validate_full(
    path: str, data: pa.RecordBatch | pa.Table | pa.Array, what: str, advice: str = "re-create the file"
) -> None:
    """Arrow's full validation of ``data`` (``validate(full=True)``): offsets in bounds and increasing,
    strings valid UTF-8, null counts that match the validity bitmaps. Reading values trusts all three
    (a string offset past its buffer is read as it stands, a crash), so whatever comes from outside is
    validated before any value is read. For lists of numbers it reads the offsets and bitmaps, never the
    numbers: a memory-mapped Arrow shard of 256 MB (20K documents) validated in 0.1 ms, its values
    left on disk (the process's resident memory unchanged)."""
    try:
        data.validate(full=True)
    except pa.ArrowException as exc:
        raise input_error(path, f"{what} is corrupt: {one_line(exc)}; {advice}") from None


def _check_nulls(path: str, batch: pa.RecordBatch | pa.Table, names: Sequence[str], first_doc: int) -> None:
    for name in names:
        col = batch.column(name)
        if col.null_count:
            nulls = np.flatnonzero(np.asarray(_combine(col).is_null()))
            raise input_error(path, f"null in column {name!r} at document index {first_doc + int(nulls[0])}")


class ArrowShard(_RecordShard):
    """Arrow IPC file (memory-mapped, zero-copy record batches) or an Arrow IPC stream already read."""

    def __init__(
        self, path: str, batches: list[pa.RecordBatch], schema: pa.Schema, fmt: str, source: Any = None
    ) -> None:
        meta, fixed, _ = _record_metadata(path, schema, schema.metadata, "schema metadata")
        dim, dtype = meta["dim"], meta["dtype"]
        ids: list[str] = []
        lengths: list[np.ndarray] = []
        starts = [0]
        names = ["id", "embedding"] + (["scales"] if dtype == "int8" else [])
        for i, batch in enumerate(batches):
            try:
                batch.validate()
            except pa.ArrowException as exc:
                raise input_error(path, f"corrupt record batch {i}: {one_line(exc)}") from None
            # Fully validated here, at open, are the columns a shard reads (its other columns never are
            # read): the ids and the lists' offsets are read now, the token values only when a read
            # asks for them, and validating does not touch those (`_validate_full`).
            for name in names:
                where = f"column {name!r} of record batch {i} (documents from {starts[-1]})"
                _validate_full(path, batch.column(name), where)
            _check_nulls(path, batch, names, starts[-1])
            ids.extend(batch.column("id").to_pylist())
            doc_lengths = _list_lengths(batch.column("embedding"))
            if dtype == "int8" and not np.array_equal(_list_lengths(batch.column("scales")), doc_lengths):
                raise input_error(path, f"record batch {i}: scales and embedding lists differ in length")
            lengths.append(doc_lengths)
            starts.append(starts[-1] + batch.num_rows)
        check_ids(path, ids)
        lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        num_tokens = int(offsets[-1])
        check_offsets(path, offsets, ids, num_tokens)
        check_counts(path, meta, len(ids), num_tokens, dim)
        info = _shard_info(path, fmt, len(ids), num_tokens, dim, dtype, meta)
        super().__init__(info, ids, offsets)
        self._batches: list[pa.RecordBatch] | None = batches
        self._source = source
        self._chunk_starts = np.asarray(starts, dtype=np.int64)
        self._tokens = _ArrowTokens(path, dim, dtype, fixed)
        self._emb_col = schema.get_field_index("embedding")
        self._scale_col = schema.get_field_index("scales") if dtype == "int8" else None

    def _chunk(self, index: int) -> pa.RecordBatch:
        if self._batches is None:
            raise MaxsimError(f"{self.path}: shard is closed")
        return self._batches[index]

    def _read_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        mapped = getattr(self._source, "mapped", None)
        if mapped is None:  # a stream read from stdin: in memory
            return super()._read_rows(start, stop)
        # The file is mapped: one truncated since it was opened would be SIGBUS on the first page past
        # its end, so its size and time are checked first (a change during the copy below is not caught)
        try:
            now = os.stat(self.path)
        except OSError as exc:  # removed (or its folder made unreadable) since it was opened
            raise input_error(
                self.path, f"cannot read values: {one_line(exc)}; put the file back or open the corpus again"
            ) from None
        check_unchanged(self.path, self._source.identity, now)
        rows = super()._read_rows(start, stop)  # copies the rows out of the map
        # the map's pages stay in the process's resident set until dropped (re-read from the page
        # cache if touched again)
        with contextlib.suppress(OSError, ValueError):
            mapped.madvise(mmap.MADV_DONTNEED)
        return rows

    def close(self) -> None:
        self._batches = None
        if self._source is not None:
            self._source.close()
            self._source = None


class _MappedFile:
    """A file mapped read-only for Arrow (`pa.BufferReader`) whose pages `ArrowShard` can drop."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.identity = _identity(st)
            if st.st_size == 0:
                raise OSError("the file is empty")
            self.mapped: mmap.mmap | None = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.reader = pa.BufferReader(pa.py_buffer(self.mapped))

    def close(self) -> None:
        # unmapped once the last Arrow buffer over it is gone (closing with buffers exported fails)
        self.reader = None
        self.mapped = None


def _open_arrow(path: str) -> ArrowShard:
    try:
        mapped = _MappedFile(path)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise input_error(path, f"cannot open: {one_line(exc)}") from None
    source = mapped.reader
    try:
        try:
            reader = pa.ipc.open_file(source)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            fmt = "arrow"
        except pa.ArrowInvalid:
            # Not the file format: an IPC stream written to disk (what Hugging Face datasets save).
            source.seek(0)
            stream = pa.ipc.open_stream(source)
            batches = list(stream)
            reader, fmt = stream, "arrow-stream"
        return ArrowShard(path, batches, reader.schema, fmt, mapped)
    except MaxsimError:
        mapped.close()
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        mapped.close()
        raise input_error(path, f"corrupt or truncated Arrow IPC file: {one_line(exc)}") from None


class ParquetShard(_RecordShard):
    """Parquet: ids and per-document lengths on open, embeddings one row group at a time (the last one
    read is kept, so consecutive reads decode each row group once)."""

    def __init__(self, path: str) -> None:
        try:
            # read, not mapped: row groups are decoded into memory anyway, and a map's pages would stay
            # in the process's resident set (and a file truncated meanwhile would be SIGBUS)
            self._file: pq.ParquetFile | None = pq.ParquetFile(path, memory_map=False)
            schema = self._file.schema_arrow
            file_meta = self._file.metadata
        except UnicodeDecodeError:  # pyarrow decodes the column names as it opens the file
            raise input_error(path, "a column name is not valid UTF-8, as Parquet's must be") from None
        except (pa.ArrowException, OSError) as exc:
            raise input_error(path, f"corrupt or truncated Parquet file: {one_line(exc)}") from None
        meta, fixed, has_length = _record_metadata(path, schema, file_meta.metadata, "key-value metadata")
        dim, dtype = meta["dim"], meta["dtype"]
        num_groups = file_meta.num_row_groups
        starts = np.concatenate(
            [[0], np.cumsum([file_meta.row_group(i).num_rows for i in range(num_groups)])]
        )
        self._chunk_starts = starts.astype(np.int64)
        # row groups are read with columns ["embedding"(, "scales")], in that order
        self._emb_col, self._scale_col = 0, (1 if dtype == "int8" else None)
        self._cache: tuple[int, pa.Table] | None = None
        self.path = path
        try:
            head = self._file.read(columns=["id", "length"] if has_length else ["id"])
            _validate_full(path, head, f"column {' and '.join(map(repr, head.column_names))}")
            _check_nulls(path, head, head.column_names, 0)
            ids = head.column("id").to_pylist()
            if has_length:
                lens = numbers(head.column("length").combine_chunks()).astype(np.int64)
            else:
                # No `length` column (a foreign writer): decode the embedding lists once to count tokens.
                parts = [
                    _list_lengths(_combine(self._file.read_row_group(g, columns=["embedding"]).column(0)))
                    for g in range(num_groups)
                ]
                lens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        except MaxsimError:
            raise
        except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
            raise input_error(path, f"corrupt or truncated Parquet file: {one_line(exc)}") from None
        check_ids(path, ids)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        num_tokens = int(offsets[-1])
        check_offsets(path, offsets, ids, num_tokens)
        check_counts(path, meta, len(ids), num_tokens, dim)
        info = _shard_info(path, "parquet", len(ids), num_tokens, dim, dtype, meta)
        super().__init__(info, ids, offsets)
        self._tokens = _ArrowTokens(path, dim, dtype, fixed)

    def _chunk(self, index: int) -> pa.Table:
        if self._file is None:
            raise MaxsimError(f"{self.path}: shard is closed")
        if self._cache is None or self._cache[0] != index:
            names = ["embedding"] + (["scales"] if self._scale_col is not None else [])
            try:
                table = self._file.read_row_group(index, columns=names)
            except (pa.ArrowException, OSError) as exc:
                raise input_error(self.path, f"corrupt row group {index}: {one_line(exc)}") from None
            first = int(self._chunk_starts[index])
            _validate_full(self.path, table, f"row group {index}")
            _check_nulls(self.path, table, names, first)
            lens = _list_lengths(_combine(table.column("embedding")))
            want = np.diff(self.offsets[first : int(self._chunk_starts[index + 1]) + 1])
            if not np.array_equal(lens, want):
                doc = first + int(np.flatnonzero(lens != want)[0])
                raise input_error(
                    self.path,
                    f"document {show_id(self.ids[doc])} (index {doc}) has "
                    f"{int(lens[doc - first])} tokens but the 'length' column says "
                    f"{int(want[doc - first])}",
                )
            self._cache = (index, table)
        return self._cache[1]

    def close(self) -> None:
        self._cache = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _sniff(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"ARROW1"):
        return "arrow"
    if head.startswith(b"PAR1"):
        return "parquet"
    if head[:4] == b"\xff\xff\xff\xff":
        return "arrow"  # IPC stream
    suffix = os.path.splitext(path)[1].lower()
    return SHARD_SUFFIXES.get(suffix, "safetensors")


def open_shard(path: str | os.PathLike[str]) -> Shard:
    """Open and validate one shard (safetensors, Arrow IPC file/stream or Parquet; sniffed from its bytes).

    Validation is O(N): metadata, dtype, dim, ids, offsets and counts; values are checked as they are read.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise input_error(path, "no such file")
    if os.path.isdir(path):
        raise input_error(path, "is a directory; open it with open_corpus or name a shard file")
    kind = _sniff(path)
    if kind == "safetensors" and os.path.splitext(path)[1].lower() != ".safetensors":
        with open(path, "rb") as f:
            head = f.read(9)
        if len(head) < 9 or head[8:9] != b"{":
            raise input_error(
                path, "not a shard: expected a safetensors, Arrow IPC or Parquet file (see docs/format.md)"
            )
    if kind == "arrow":
        return _open_arrow(path)
    if kind == "parquet":
        return ParquetShard(path)
    return SafetensorsShard(path)


def read_stream(name: str, data: bytes) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """An Arrow IPC stream held in memory (standard input, a request's body): its schema and record
    batches, each fully validated, every column (`_validate_full`), before anything reads a value.
    `InputError` names ``name`` for bytes that are not a stream or a batch that is corrupt."""
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        batches = list(reader)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise input_error(name, f"not an Arrow IPC stream: {one_line(exc)}") from None
    for i, batch in enumerate(batches):
        _validate_full(name, batch, f"record batch {i}", "check the program that wrote the stream")
    return reader.schema, batches


def read_queries(path: str) -> DocBatch:
    """The whole query file as one batch (ids are query ids). `-` reads an Arrow IPC stream from stdin."""
    if path == "-":
        name = "<stdin>"
        data = sys.stdin.buffer.read()
        if not data:
            raise input_error(
                name, "no data on stdin; pipe an Arrow IPC stream of queries (see docs/format.md)"
            )
        schema, batches = read_stream(name, data)
        shard: Shard = ArrowShard(name, batches, schema, "arrow-stream")
    else:
        shard = open_shard(path)
    with shard:
        batch = shard.read_docs(0, shard.num_docs)
    batch.encoder, batch.normalized = shard.info.encoder, shard.info.normalized  # compared with the corpus's
    return batch
