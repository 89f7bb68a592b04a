"""`SafetensorsShard`: a safetensors shard, its header parsed and checked here, its ids and offsets read
on open, its token rows read with `os.pread` at their byte positions (never through a map of the file).
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from maxsim_cli.codecs import has_scales
from maxsim_cli.errors import MaxsimError
from maxsim_cli.shards.format import (
    MAX_SAFETENSORS_HEADER,
    SAFETENSORS_DTYPE_NAMES,
    SAFETENSORS_ITEMSIZE,
    ArrowIds,
    check_counts,
    check_offsets,
    decode_ids,
    input_error,
    one_line,
    parse_metadata,
    torch_dtypes,
)
from maxsim_cli.shards.shard import (
    Shard,
    check_unchanged,
    file_identity,
    pread_into,
    pread_pieces,
    shard_info,
)

if TYPE_CHECKING:
    import torch


def _code_width(path: str, meta: dict[str, Any], stored: int) -> int:
    """The dim of a shard whose `embeddings` rows hold ``stored`` values: refuses rows of codes that are
    not the width the codec gives the metadata's dim."""
    if meta["width"] == meta["dim"]:
        return stored
    if stored == meta["width"]:
        return meta["dim"]
    raise input_error(
        path,
        f"embeddings rows are {stored} bytes but {meta['quantization']} codes of dim {meta['dim']} take "
        f"{meta['width']}; the file is damaged or was written by another codec: quantize again",
    )


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


def read_header(path: str) -> tuple[dict[str, Any], int, os.stat_result]:
    """A safetensors file's header (checked to be a JSON object), its length in bytes, and the file's
    `os.stat` when it was read."""
    try:
        opened = os.stat(path)
        f = open(path, "rb")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise input_error(path, f"cannot read: {one_line(exc)}") from None
    size = opened.st_size
    with f:
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
                f"truncated: header needs {header_len} bytes after offset 8 but the file has {size} bytes",
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
    return header, header_len, opened


class SafetensorsShard(Shard):
    """safetensors container: header parsed and checked here, values through `safe_open(...).get_slice`."""

    def __init__(self, path: str) -> None:
        header, header_len, opened = read_header(path)
        size = opened.st_size
        meta = _metadata(path, header)
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
        dim = _code_width(path, meta, dim)
        shapes: dict[str, list[int]] = {}
        for name, want in (("offsets", "I64"), ("ids", "U8"), ("id_offsets", "I64")):
            got, shape = _st_tensor(path, header, name, data_size)
            if got != want or len(shape) != 1:
                raise input_error(path, f"tensor {name!r} must be a 1-D {want} tensor, got {got} {shape}")
            shapes[name] = shape
        if has_scales(meta["quantization"]):
            if "scales" not in header:
                raise input_error(
                    path,
                    f"{dtype} embeddings without scales: an int8 shard needs a F32 'scales' "
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
        self.row_bytes = meta["width"] * SAFETENSORS_ITEMSIZE[emb_dtype]
        self.emb_start = base + int(header["embeddings"]["data_offsets"][0])
        scaled = has_scales(meta["quantization"])
        self.scales_start = base + int(header["scales"]["data_offsets"][0]) if scaled else None
        self._identity = file_identity(opened)
        self._fd: int | None = None
        self._fd_lock = threading.Lock()
        self._closed = False
        id_array = decode_ids(path, id_bytes, id_offsets)
        check_offsets(path, offsets, ArrowIds(id_array), num_tokens)
        check_counts(path, meta, len(id_array), num_tokens, dim)
        info = shard_info(path, "safetensors", len(id_array), num_tokens, dim, dtype, meta)
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

    def read_docs_into(
        self, indices: np.ndarray, embeddings: torch.Tensor, scales: torch.Tensor | None
    ) -> np.ndarray:
        """The token rows of documents ``indices`` (int64, in that order, repeats allowed) one after
        another into ``embeddings`` (and ``scales`` for int8): `read_rows_into` for a rerank's index list,
        with documents that follow one another in the file read at once and the file checked once
        (`pread_pieces`). Returns the documents' lengths. Values are not checked here."""
        indices = np.asarray(indices, dtype=np.int64)
        starts, stops = self.offsets[indices], self.offsets[indices + 1]
        if len(indices) == 0:
            return stops - starts
        # runs of documents whose rows follow one another in the file: one read each
        first = np.flatnonzero(np.concatenate([[True], starts[1:] != stops[:-1]]))
        last = np.concatenate([first[1:] - 1, [len(indices) - 1]])
        run_starts, run_rows = starts[first], stops[last] - starts[first]
        fd = self._values_fd()
        pread_pieces(
            self.path,
            fd,
            self._identity,
            embeddings,
            self.emb_start + run_starts * self.row_bytes,
            run_rows * self.row_bytes,
        )
        if self.scales_start is not None and scales is not None:
            pread_pieces(
                self.path, fd, self._identity, scales, self.scales_start + run_starts * 4, run_rows * 4
            )
        return stops - starts

    def _read_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        import torch

        t0, t1 = int(self.offsets[start]), int(self.offsets[stop])
        emb = torch.empty(t1 - t0, self.info.width, dtype=torch_dtypes()[self.info.dtype])
        scales = torch.empty(t1 - t0, dtype=torch.float32) if self.scales_start is not None else None
        self.read_rows_into(t0, t1, emb, scales)
        return emb, scales

    def close(self) -> None:
        with self._fd_lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def shard_metadata(path: str) -> dict[str, Any]:
    """A safetensors shard's metadata (`parse_metadata`: dim, dtype, quantization, encoder, ...), from its
    header alone."""
    header, _, _ = read_header(path)
    return _metadata(path, header)


def _metadata(path: str, header: dict[str, Any]) -> dict[str, Any]:
    meta_raw = header.get("__metadata__")
    if meta_raw is not None and (
        not isinstance(meta_raw, dict) or not all(isinstance(v, str) for v in meta_raw.values())
    ):
        raise input_error(path, "corrupt __metadata__: must map strings to strings")
    return parse_metadata(path, meta_raw, "__metadata__")


def ids_at(path: str, rows: np.ndarray, num_docs: int) -> Any:
    """The ids of documents ``rows`` of the safetensors shard at ``path`` (an Arrow large_binary array, in
    the order of ``rows``), read through a read-only map of its ``id_offsets`` and ``ids`` tensors: only
    the pages of the ids asked for are read, not the shard's. The header is checked first (both tensors
    whole inside the file: a map read past a file's end is SIGBUS, and the file is checked unchanged
    since) and so is each id's span."""
    import mmap

    from maxsim_cli.arrays import gather_strings

    header, header_len, opened = read_header(path)
    data_size = opened.st_size - 8 - header_len
    for name, want, shape in (("id_offsets", "I64", [num_docs + 1]), ("ids", "U8", None)):
        got, got_shape = _st_tensor(path, header, name, data_size)
        if got != want or len(got_shape) != 1 or (shape is not None and got_shape != shape):
            raise input_error(
                path,
                f"tensor {name!r} must be a 1-D {want} tensor{f' {shape}' if shape else ''}, got {got} "
                f"{got_shape}; the file changed since the manifest recorded {num_docs} documents",
            )
    base = 8 + header_len
    offsets_at = base + int(header["id_offsets"]["data_offsets"][0])
    ids_from, ids_to = (base + int(v) for v in header["ids"]["data_offsets"])
    with open(path, "rb") as f:
        check_unchanged(path, file_identity(opened), os.fstat(f.fileno()))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        id_offsets = np.frombuffer(mapped, dtype="<i8", count=num_docs + 1, offset=offsets_at)
        starts, stops = id_offsets[rows], id_offsets[rows + 1]
        del id_offsets
        if len(rows) and (
            int(starts.min()) < 0 or (stops < starts).any() or int(stops.max()) > ids_to - ids_from
        ):
            raise input_error(path, "id_offsets point outside the ids tensor; the file is damaged")
        data = np.frombuffer(mapped, dtype=np.uint8, count=ids_to - ids_from, offset=ids_from)
        try:
            return gather_strings(data, starts, stops)
        finally:
            del data
    finally:
        mapped.close()
