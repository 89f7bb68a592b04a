"""Shards of packed variable-length token embeddings (format v1): read, validate, write.

A shard holds N documents (or queries) with T token vectors of `dim` values in total, stored packed:
document i owns rows `offsets[i]:offsets[i+1]` of the `[T, dim]` matrix `embeddings`, with
`offsets[0] == 0`, `offsets[N] == T` and every document at least one token long. int8 shards carry one
float32 scale per token; a token is `x ≈ q * scale` with `scale = max|x| / 127`. The byte layout of the
three containers (safetensors, Arrow IPC, Parquet) and every rule checked here is in `docs/format.md`.

Readers validate structure on open in O(N) (never touching the T x dim values), read only the
document range they are asked for (memory-mapped safetensors slices, zero-copy Arrow record batches,
one Parquet row group at a time), and check each range they return for NaN/Inf. Writers validate the
same rules and write atomically: a temp file in the target directory, then `os.replace`.

Every problem with a user's file is an `InputError` with a one-line message naming the file and the
document id or offset. Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import struct
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from maxsim_cli.errors import InputError, MaxsimError

FORMAT_NAME = "maxsim-shard"
FORMAT_VERSION = "1"
CORPUS_FORMAT_NAME = "maxsim-corpus"
CORPUS_FORMAT_VERSION = 1
MANIFEST_NAME = "index.json"

DTYPES = ("float16", "bfloat16", "float32", "int8")
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
QUANTIZATIONS = ("none", "int8-per-token")
FORMATS = ("safetensors", "arrow", "parquet", "arrow-stream")
SHARD_SUFFIXES = {".safetensors": "safetensors", ".arrow": "arrow", ".parquet": "parquet"}

# Arrow list offsets are int32 and count tokens (the inner fixed_size_list holds one token's `dim`
# values), so an Arrow or Parquet shard holds at most 2^31 - 1 tokens.
MAX_ARROW_TOKENS = 2**31 - 1
# safetensors refuses headers above 100 MB; ours are a few hundred bytes.
MAX_SAFETENSORS_HEADER = 100_000_000
# A token counts as L2-normalised when | ||x||_2 - 1 | <= this. bf16 rounds each component with relative
# error <= 2^-9, which moves the norm of a unit vector by at most ~2e-3; 1e-2 leaves room for that.
NORM_TOLERANCE = 1e-2

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int8": torch.int8,
}
_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
_ST_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "int8": "I8"}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_ST_ITEMSIZE = {
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "I8": 1,
    "I64": 8,
    "U8": 1,
    "F64": 8,
    "I32": 4,
    "I16": 2,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
# Arrow has no bfloat16: bf16 values travel as their raw 16 bits in uint16.
_ARROW_VALUE_TYPES = {
    "float16": pa.float16(),
    "bfloat16": pa.uint16(),
    "float32": pa.float32(),
    "int8": pa.int8(),
}
_NUMPY_STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "int8": np.int8}

ID_WHITESPACE = re.compile(r"\s")  # ASCII and Unicode whitespace, as str.split() sees it
# The same characters as ID_WHITESPACE in RE2 syntax (Arrow's regexes): RE2's \s is ASCII only.
ID_WHITESPACE_RE2 = r"[\s\x0b\x1c-\x1f\x85\p{Z}]"
_ASCII_WHITESPACE = np.zeros(256, dtype=bool)
_ASCII_WHITESPACE[[0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x1F, 0x20]] = True  # str.isspace() < 0x80


def _one_line(text: object, limit: int = 200) -> str:
    """Collapse a library's (possibly multi-line) message into one short line."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _err(path: str, message: str) -> InputError:
    return InputError(f"{path}: {message}")


def _show_id(doc_id: str) -> str:
    """An id for an error message: quoted, escapes visible, never more than one line."""
    text = repr(doc_id)
    return text if len(text) <= 80 else text[:77] + "..."


# ----------------------------------------------------------------------------------------------------
# Public data types
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardInfo:
    """What a shard holds, from its metadata (checked against its contents on open)."""

    path: str
    format: str  # "safetensors" | "arrow" | "parquet" | "arrow-stream"
    num_docs: int
    num_tokens: int
    dim: int
    dtype: str  # one of DTYPES
    quantization: str  # "none" | "int8-per-token"
    normalized: bool
    encoder: str | None


@dataclass
class DocBatch:
    """Consecutive (or gathered) documents, packed: document i is `embeddings[offsets[i]:offsets[i+1]]`.

    `embeddings` is a contiguous CPU tensor `[T, dim]` in the shard's dtype; `offsets` int64 `[n+1]` with
    `offsets[0] == 0` and `offsets[-1] == T`; `scales` float32 `[T]` for int8 shards (`x ≈ q * scale`),
    else None; `first_doc` is the index of `ids[0]` in its shard.
    """

    ids: list[str]
    embeddings: torch.Tensor
    offsets: torch.Tensor
    scales: torch.Tensor | None
    first_doc: int = 0

    @property
    def num_docs(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return int(self.embeddings.shape[0])

    def lengths(self) -> torch.Tensor:
        """Tokens per document, int64 `[n]`."""
        return self.offsets[1:] - self.offsets[:-1]


# ----------------------------------------------------------------------------------------------------
# Validation shared by readers and writers
# ----------------------------------------------------------------------------------------------------


def _parse_metadata(path: str, meta: dict[str, str] | None, where: str) -> dict[str, Any]:
    """Check the format v1 metadata keys; return them typed. `where` says where they live."""
    if not meta:
        raise _err(path, f"no {where}; not a maxsim shard (see docs/format.md)")
    fmt = meta.get("format")
    if fmt != FORMAT_NAME:
        raise _err(
            path,
            f"unknown format {fmt!r} in {where} (expected {FORMAT_NAME!r}); "
            "convert the file with `maxsim pack`",
        )
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise _err(
            path,
            f"unsupported format_version {version!r} (this maxsim reads version "
            f"{FORMAT_VERSION}); upgrade maxsim or rewrite the shard",
        )
    dtype = meta.get("dtype")
    if dtype not in DTYPES:
        raise _err(path, f"unsupported dtype {dtype!r} in {where} (expected one of {', '.join(DTYPES)})")
    quantization = meta.get("quantization", "none")
    expected_q = "int8-per-token" if dtype == "int8" else "none"
    if quantization != expected_q:
        raise _err(
            path, f"quantization {quantization!r} does not fit dtype {dtype!r} (expected {expected_q!r})"
        )
    normalized = meta.get("normalized", "false")
    if normalized not in ("true", "false"):
        raise _err(path, f"normalized must be 'true' or 'false', not {normalized!r}")
    values: dict[str, Any] = {
        "dtype": dtype,
        "quantization": quantization,
        "normalized": normalized == "true",
        "encoder": meta.get("encoder") or None,
    }
    for key in ("dim", "num_docs", "num_tokens"):
        text = meta.get(key)
        if text is None or not text.isdigit():
            raise _err(path, f"{key} in {where} must be a non-negative integer, not {text!r}")
        values[key] = int(text)
    if values["dim"] < 1:
        raise _err(path, "dim is 0 in metadata; a shard needs vectors of at least one value")
    return values


def _check_ids(path: str, ids: list[str], *, what: str = "id") -> None:
    """Ids: non-empty, no whitespace (TREC fields are whitespace-separated), unique within the shard."""
    joined = "".join(ids)
    if ID_WHITESPACE.search(joined):
        for i, doc_id in enumerate(ids):
            if ID_WHITESPACE.search(doc_id):
                raise _err(
                    path,
                    f"{what} {_show_id(doc_id)} at index {i} contains whitespace; "
                    "ids must be single tokens for TREC runs",
                )
    if len(set(ids)) != len(ids):
        first: dict[str, int] = {}
        for i, doc_id in enumerate(ids):
            if doc_id in first:
                raise _err(
                    path,
                    f"duplicate {what} {_show_id(doc_id)} at indices {first[doc_id]} and {i}; "
                    "ids must be unique",
                )
            first[doc_id] = i
    for i, doc_id in enumerate(ids):
        if not doc_id:
            raise _err(path, f"empty {what} at index {i}; every document needs an id")


class _ArrowIds(Sequence[str]):
    """An Arrow string array read as a sequence of Python strings, one at a time (for messages that
    name a document, without a Python string per id)."""

    def __init__(self, array: pa.Array) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index):  # noqa: ANN001, ANN204
        if isinstance(index, slice):
            return self.array[index].to_pylist()
        return self.array[index].as_py()


def _decode_ids(path: str, data: np.ndarray, id_offsets: np.ndarray) -> pa.Array:
    """Split the concatenated UTF-8 id bytes at `id_offsets` (int64 [N+1]) and check each id: the ids as
    an Arrow array (Python strings are made only where `Shard.ids` is asked for)."""
    n = len(id_offsets) - 1
    if n < 0 or id_offsets[0] != 0:
        raise _err(path, "id_offsets must start at 0")
    steps = np.diff(id_offsets)
    if np.any(steps < 0):
        i = int(np.flatnonzero(steps < 0)[0])
        raise _err(
            path,
            f"id_offsets are not monotonic at index {i} ({int(id_offsets[i])} then {int(id_offsets[i + 1])})",
        )
    if id_offsets[-1] != len(data):
        raise _err(path, f"id_offsets end at {int(id_offsets[-1])} but ids hold {len(data)} bytes")
    if np.any(steps == 0):
        raise _err(
            path, f"empty id at index {int(np.flatnonzero(steps == 0)[0])}; every document needs an id"
        )
    strings = pa.LargeStringArray.from_buffers(
        n, pa.py_buffer(np.ascontiguousarray(id_offsets, dtype=np.int64)), pa.py_buffer(data.tobytes())
    )
    try:
        strings.validate(full=True)
    except pa.ArrowInvalid:
        for i in range(n):
            raw = data[int(id_offsets[i]) : int(id_offsets[i + 1])].tobytes()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                raise _err(
                    path,
                    f"id at index {i} (bytes {int(id_offsets[i])}..{int(id_offsets[i + 1])}) "
                    f"is not valid UTF-8: {raw[:40]!r}",
                ) from None
        raise
    if not _ids_pass(strings):
        _check_ids(path, strings.to_pylist())  # names the offending id
    return strings


def _ids_pass(ids: pa.Array) -> bool:
    """Whether non-empty ids have no null, no whitespace and no duplicate, checked without a Python
    object per id; `_check_ids` then names what fails. Duplicates: equal neighbours once sorted. 12.8K
    ids: 0.7 ms against 3.6 ms for Python's regex and set."""
    if len(ids) == 0:
        return True
    if ids.null_count or has_whitespace(ids):
        return False
    return not _has_equal_neighbours(ids.take(pc.sort_indices(ids)))


def string_bytes(strings: pa.Array) -> np.ndarray:
    """The concatenated UTF-8 values of an Arrow (large) string array, as a uint8 view of its data buffer
    (no copy)."""
    _, offsets_buffer, data_buffer = strings.buffers()
    if len(strings) == 0 or data_buffer is None:
        return np.zeros(0, dtype=np.uint8)
    width = np.int64 if pa.types.is_large_string(strings.type) else np.int32
    offsets = np.frombuffer(offsets_buffer, dtype=width)[strings.offset : strings.offset + len(strings) + 1]
    return np.frombuffer(data_buffer, dtype=np.uint8)[int(offsets[0]) : int(offsets[-1])]


def has_whitespace(strings: pa.Array) -> bool:
    """Whether any value holds a character that `ID_WHITESPACE` (Python's \\s) matches: a byte table over
    the data when every byte is ASCII, Arrow's regex (`ID_WHITESPACE_RE2`) otherwise."""
    data = string_bytes(strings)
    if len(data) and int(data.max()) < 0x80:
        return bool(_ASCII_WHITESPACE[data].any())
    return bool(pc.any(pc.match_substring_regex(strings, ID_WHITESPACE_RE2)).as_py())


# Sorting the ids shard by shard pays from this many threads, or from this many ids on fewer threads.
# `python benchmarks/probe_id_sort.py`, 20 shards, against one sort of all ids: on the 16-core H200 host
# (benchmarks/results/id-sort-h200-host.json) 244K ids 0.032 s against 0.055, 8.8M ids 1.40 s against
# 3.64 (long ids 1.86 against 5.23); on a 2-core machine 244K ids 0.094 s against 0.077, 2M ids 0.57 s
# against 0.88.
BY_SHARD_SORT_MIN_THREADS = 4
BY_SHARD_SORT_MIN_IDS = 1_000_000


def concat_ids(shard_ids: Sequence[pa.Array]) -> pa.Array:
    """Per-shard id arrays as one large_string array, in order."""
    if not shard_ids:
        return pa.array([], type=pa.large_string())
    return pa.concat_arrays([a.cast(pa.large_string()) for a in shard_ids])


def sorted_id_order(shard_ids: Sequence[pa.Array]) -> tuple[pa.Array, np.ndarray, pa.Array]:
    """(all ids as one large_string array, the ordinals sorted by id (ascending UTF-8 bytes: Python's str
    order and trec_eval's strcmp), the ids in that order) for per-shard id arrays.

    With enough threads or ids, each shard's ids are sorted in a thread of their own (Arrow releases the
    GIL) and the concatenated sorted runs are sorted once more, which Arrow does ~3x faster than ids in
    no order. The order is the same as one sort of all ids, as long as the ids are unique (equal ids
    are refused by the caller)."""
    arrays = [a.cast(pa.large_string()) for a in shard_ids]
    ids = concat_ids(arrays)
    threads = min(len(arrays), os.cpu_count() or 1)
    if threads < 2 or (threads < BY_SHARD_SORT_MIN_THREADS and len(ids) < BY_SHARD_SORT_MIN_IDS):
        order = pc.sort_indices(ids)
        return ids, order.to_numpy().astype(np.int64), ids.take(order)

    def sort_run(values: pa.Array) -> tuple[np.ndarray, pa.Array]:
        run_order = pc.sort_indices(values)
        return run_order.to_numpy().astype(np.int64), values.take(run_order)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, thread_name_prefix="maxsim-ids") as pool:
        runs = list(pool.map(sort_run, arrays))
    starts = np.cumsum([0] + [len(a) for a in arrays[:-1]])
    ordinal_of_run = np.concatenate([order + start for (order, _), start in zip(runs, starts, strict=True)])
    sorted_runs = pa.concat_arrays([values for _, values in runs])
    order = pc.sort_indices(sorted_runs).to_numpy()
    return ids, ordinal_of_run[order], sorted_runs.take(pa.array(order))


def _has_equal_neighbours(values: pa.Array) -> bool:
    return len(values) > 1 and pc.any(pc.equal(values.slice(1), values.slice(0, len(values) - 1))).as_py()


def _check_offsets(path: str, offsets: np.ndarray, ids: Sequence[str], num_tokens: int) -> None:
    """offsets int64 [N+1]: start at 0, end at T, strictly increasing (no empty document)."""
    if offsets.ndim != 1 or len(offsets) != len(ids) + 1:
        raise _err(
            path,
            f"offsets has {len(offsets)} entries but the shard has {len(ids)} ids; expected num_docs + 1",
        )
    if offsets[0] != 0:
        raise _err(
            path, f"offsets start at {int(offsets[0])}, not 0 (offset 0 of document {_show_id(ids[0])})"
        )
    steps = np.diff(offsets)
    bad = np.flatnonzero(steps <= 0)
    if bad.size:
        i = int(bad[0])
        if steps[i] < 0:
            raise _err(
                path,
                f"offsets are not monotonic: offsets[{i + 1}] = {int(offsets[i + 1])} < "
                f"offsets[{i}] = {int(offsets[i])} (document {_show_id(ids[i])}, index {i})",
            )
        raise _err(
            path,
            f"document {_show_id(ids[i])} (index {i}, offset {int(offsets[i])}) has zero "
            "tokens; every document needs at least one token vector",
        )
    if offsets[-1] != num_tokens:
        raise _err(path, f"offsets end at {int(offsets[-1])} but embeddings hold {num_tokens} tokens")


def _check_counts(path: str, meta: dict[str, Any], num_docs: int, num_tokens: int, dim: int) -> None:
    for key, actual in (("num_docs", num_docs), ("num_tokens", num_tokens), ("dim", dim)):
        if meta[key] != actual:
            raise _err(path, f"metadata says {key}={meta[key]} but the file holds {actual}")


def first_nonfinite_row(values: torch.Tensor) -> int | None:
    """Index of the first row holding NaN/Inf, or None. One float32 sum first: cheap, no mask."""
    if values.numel() == 0 or values.dtype == torch.int8:
        return None
    if torch.isfinite(values.sum(dtype=torch.float32)):
        return None
    # The sum is NaN/Inf: find the row (an overflowing sum of finite values finds none).
    flat = values.reshape(values.shape[0], -1)
    chunk = max(1, (1 << 22) // max(1, flat.shape[1]))  # bounded temporary mask
    for start in range(0, flat.shape[0], chunk):
        bad = (~torch.isfinite(flat[start : start + chunk])).any(dim=1).nonzero()
        if bad.numel():
            return start + int(bad[0, 0])
    return None


def _check_values(
    path: str,
    embeddings: torch.Tensor,
    scales: torch.Tensor | None,
    offsets: np.ndarray,
    ids: Sequence[str],
    first_doc: int,
) -> None:
    """NaN/Inf in the values (or NaN/Inf/negative int8 scales): name the document and its token."""
    for tensor, what in ((embeddings, "NaN or Inf values"), (scales, "a NaN or Inf scale")):
        if tensor is None:
            continue
        row = first_nonfinite_row(tensor)
        if row is not None:
            doc = int(np.searchsorted(offsets, row, side="right")) - 1
            raise _err(
                path,
                f"document {_show_id(ids[doc])} (index {first_doc + doc}) has {what} at token "
                f"{row - int(offsets[doc])}; re-encode or drop that document",
            )
    if scales is not None and scales.numel() and bool((scales < 0).any()):
        row = int((scales < 0).nonzero()[0, 0])
        doc = int(np.searchsorted(offsets, row, side="right")) - 1
        raise _err(
            path,
            f"document {_show_id(ids[doc])} (index {first_doc + doc}) has a negative int8 scale "
            f"at token {row - int(offsets[doc])}; scales are max|x|/127 >= 0",
        )


# ----------------------------------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------------------------------


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
            self._id_array = pa.array(self.ids, type=pa.large_string())
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
        dtype = TORCH_DTYPES[self.info.dtype]
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
        n = self.info.num_docs
        if not (0 <= start <= stop <= n):
            raise IndexError(f"{self.path}: document range {start}:{stop} outside 0:{n}")
        if start == stop:
            return self._empty_batch(start)
        with self._lock:
            embeddings, scales = self._read_rows(start, stop)
        local = self.offsets[start : stop + 1] - self.offsets[start]
        ids = self.ids[start:stop]
        _check_values(self.path, embeddings, scales, local, ids, start)
        return DocBatch(ids, embeddings, torch.from_numpy(np.array(local, dtype=np.int64)), scales, start)

    def read_doc_indices(self, indices: Sequence[int]) -> DocBatch:
        """Documents at `indices`, in that order (repeats allowed); reads each consecutive run once."""
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
        raise _err(
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
        raise _err(path, f"corrupt header entry for tensor {name!r}")
    if dtype not in _ST_ITEMSIZE:
        raise _err(path, f"tensor {name!r} has unknown dtype {dtype!r}")
    begin, end = span
    if end < begin or end - begin != math.prod(shape) * _ST_ITEMSIZE[dtype]:
        raise _err(path, f"tensor {name!r}: data_offsets {span} do not match shape {shape} of {dtype}")
    if end > data_size:
        raise _err(
            path,
            f"truncated: tensor {name!r} ends at byte {end} of the data section but only "
            f"{data_size} bytes follow the header; re-copy or rewrite the file",
        )
    return dtype, shape


class SafetensorsShard(Shard):
    """safetensors container: header parsed and checked here, values through `safe_open(...).get_slice`."""

    def __init__(self, path: str) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _err(
                    path, f"truncated: {size} bytes, shorter than the 8-byte safetensors header length"
                )
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_SAFETENSORS_HEADER:
                raise _err(
                    path,
                    f"corrupt safetensors header length {header_len} (at offset 0); "
                    "not a safetensors file or damaged",
                )
            if 8 + header_len > size:
                raise _err(
                    path,
                    f"truncated: header needs {header_len} bytes after offset 8 but the file "
                    f"has {size} bytes",
                )
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _err(
                path, f"corrupt safetensors header (bytes 8..{8 + header_len}): {_one_line(exc)}"
            ) from None
        if not isinstance(header, dict):
            raise _err(path, "corrupt safetensors header: not a JSON object")
        meta_raw = header.get("__metadata__")
        if meta_raw is not None and (
            not isinstance(meta_raw, dict) or not all(isinstance(v, str) for v in meta_raw.values())
        ):
            raise _err(path, "corrupt __metadata__: must map strings to strings")
        meta = _parse_metadata(path, meta_raw, "__metadata__")
        data_size = size - 8 - header_len
        emb_dtype, emb_shape = _st_tensor(path, header, "embeddings", data_size)
        if emb_dtype not in _ST_NAMES:
            raise _err(
                path, f"unsupported embeddings dtype {emb_dtype} (expected F16, BF16, F32, or I8 with scales)"
            )
        dtype = _ST_NAMES[emb_dtype]
        if dtype != meta["dtype"]:
            raise _err(path, f"embeddings are {emb_dtype} but metadata says dtype={meta['dtype']}")
        if len(emb_shape) != 2:
            raise _err(path, f"embeddings must be 2-D [num_tokens, dim], got shape {emb_shape}")
        num_tokens, dim = emb_shape
        shapes: dict[str, list[int]] = {}
        for name, want in (("offsets", "I64"), ("ids", "U8"), ("id_offsets", "I64")):
            got, shape = _st_tensor(path, header, name, data_size)
            if got != want or len(shape) != 1:
                raise _err(path, f"tensor {name!r} must be a 1-D {want} tensor, got {got} {shape}")
            shapes[name] = shape
        if dtype == "int8":
            if "scales" not in header:
                raise _err(
                    path,
                    "int8 embeddings without scales: an int8 shard needs a F32 'scales' "
                    "tensor [num_tokens]; rewrite it with `maxsim quantize`",
                )
            got, shape = _st_tensor(path, header, "scales", data_size)
            if got != "F32" or shape != [num_tokens]:
                raise _err(path, f"tensor 'scales' must be F32 [{num_tokens}], got {got} {shape}")
        if shapes["offsets"] != shapes["id_offsets"]:
            raise _err(
                path,
                f"offsets {shapes['offsets']} and id_offsets {shapes['id_offsets']} differ in "
                "length; both must be [num_docs + 1]",
            )
        try:
            from safetensors import safe_open

            self._file = safe_open(path, framework="pt")
            id_offsets = self._file.get_tensor("id_offsets").numpy()
            id_bytes = self._file.get_tensor("ids").numpy()
            offsets = self._file.get_tensor("offsets").numpy()
            self._emb = self._file.get_slice("embeddings")
            self._scales = self._file.get_slice("scales") if dtype == "int8" else None
        except MaxsimError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise _err(path, f"corrupt safetensors file: {_one_line(exc)}") from None
        id_array = _decode_ids(path, id_bytes, id_offsets)
        _check_offsets(path, offsets, _ArrowIds(id_array), num_tokens)
        _check_counts(path, meta, len(id_array), num_tokens, dim)
        info = ShardInfo(
            path,
            "safetensors",
            len(id_array),
            num_tokens,
            dim,
            dtype,
            meta["quantization"],
            meta["normalized"],
            meta["encoder"],
        )
        super().__init__(info, None, offsets.astype(np.int64, copy=False), id_array)

    def _read_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._emb is None:
            raise MaxsimError(f"{self.path}: shard is closed")
        t0, t1 = int(self.offsets[start]), int(self.offsets[stop])
        emb = self._emb[t0:t1].contiguous()
        scales = self._scales[t0:t1].contiguous() if self._scales is not None else None
        return emb, scales

    def close(self) -> None:
        self._emb = None
        self._scales = None
        self._file = None


def _arrow_schema_types(path: str, schema: pa.Schema, dim: int, dtype: str) -> tuple[bool, bool]:
    """Check the id / embedding / scales / length columns; return (inner_is_fixed, has_length)."""
    names = schema.names
    for col in ("id", "embedding"):
        if col not in names:
            raise _err(
                path,
                f"no {col!r} column (columns: {', '.join(names)}); a maxsim shard has 'id' and 'embedding'",
            )
    if schema.field("id").type not in (pa.string(), pa.large_string()):
        raise _err(path, f"column 'id' must be utf8 or large_utf8, not {schema.field('id').type}")
    emb_type = schema.field("embedding").type
    if not (pa.types.is_list(emb_type) or pa.types.is_large_list(emb_type)):
        raise _err(path, f"column 'embedding' must be list<fixed_size_list<T, dim>>, not {emb_type}")
    inner = emb_type.value_type
    fixed = pa.types.is_fixed_size_list(inner)
    if not (fixed or pa.types.is_list(inner) or pa.types.is_large_list(inner)):
        raise _err(path, f"column 'embedding' must be list<fixed_size_list<T, dim>>, not {emb_type}")
    if fixed and inner.list_size != dim:
        raise _err(path, f"embedding vectors have {inner.list_size} values but metadata says dim={dim}")
    want = _ARROW_VALUE_TYPES[dtype]
    if inner.value_type != want:
        raise _err(
            path,
            f"embedding values are {inner.value_type} but metadata says dtype={dtype} (stored as {want})",
        )
    if dtype == "int8":
        if "scales" not in names:
            raise _err(
                path,
                "int8 embeddings without scales: an int8 shard needs a 'scales' "
                "list<float32> column; rewrite it with `maxsim quantize`",
            )
        st = schema.field("scales").type
        if not ((pa.types.is_list(st) or pa.types.is_large_list(st)) and st.value_type == pa.float32()):
            raise _err(path, f"column 'scales' must be list<float32>, not {st}")
    has_length = "length" in names
    if has_length and not pa.types.is_integer(schema.field("length").type):
        raise _err(path, f"column 'length' must be an integer, not {schema.field('length').type}")
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
    offs = arr.offsets.to_numpy(zero_copy_only=False)
    return np.diff(offs).astype(np.int64)


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
                raise _err(
                    self.path,
                    f"document {_show_id(ids[first + doc])} has a token vector of "
                    f"{int(widths[bad[0]])} values; dim is {self.dim}",
                )
        values = vectors.flatten()
        if values.null_count:
            raise _err(self.path, f"null values in the embeddings of documents {lo}..{hi} of a record batch")
        arr = values.to_numpy(zero_copy_only=False)
        return arr.reshape(-1, self.dim)

    def scales(self, column: pa.Array, lo: int, hi: int) -> np.ndarray:
        return column.slice(lo, hi - lo).flatten().to_numpy(zero_copy_only=False)


def _to_torch(parts: list[np.ndarray], dtype: str) -> torch.Tensor:
    """Copy numpy pieces (possibly read-only views of a memory map) into one torch tensor."""
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
        embeddings = _to_torch(emb_parts, self.info.dtype)
        expected = int(self.offsets[stop] - self.offsets[start])
        if embeddings.shape[0] != expected:
            raise _err(
                self.path,
                f"documents {start}..{stop} hold {embeddings.shape[0]} tokens but their "
                f"lengths say {expected}",
            )
        scales = _to_torch(scale_parts, "float32") if scale_parts else None
        if scales is not None and scales.shape[0] != expected:
            raise _err(
                self.path, f"documents {start}..{stop} have {scales.shape[0]} scales for {expected} tokens"
            )
        return embeddings, scales


def _record_metadata(
    path: str, schema: pa.Schema, meta_raw: dict[bytes, bytes] | None, where: str
) -> tuple[dict[str, Any], bool, bool]:
    meta = _parse_metadata(path, _decode_meta(meta_raw), where)
    fixed, has_length = _arrow_schema_types(path, schema, meta["dim"], meta["dtype"])
    return meta, fixed, has_length


def _check_nulls(path: str, batch: pa.RecordBatch | pa.Table, names: Sequence[str], first_doc: int) -> None:
    for name in names:
        col = batch.column(name)
        if col.null_count:
            nulls = np.flatnonzero(np.asarray(_combine(col).is_null()))
            raise _err(path, f"null in column {name!r} at document index {first_doc + int(nulls[0])}")


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
                raise _err(path, f"corrupt record batch {i}: {_one_line(exc)}") from None
            _check_nulls(path, batch, names, starts[-1])
            id_col = batch.column("id")
            try:
                id_col.validate(full=True)
            except pa.ArrowInvalid as exc:
                raise _err(
                    path,
                    f"id column of record batch {i} (documents from {starts[-1]}) is not valid "
                    f"UTF-8: {_one_line(exc)}",
                ) from None
            ids.extend(id_col.to_pylist())
            doc_lengths = _list_lengths(batch.column("embedding"))
            if dtype == "int8" and not np.array_equal(_list_lengths(batch.column("scales")), doc_lengths):
                raise _err(path, f"record batch {i}: scales and embedding lists differ in length")
            lengths.append(doc_lengths)
            starts.append(starts[-1] + batch.num_rows)
        _check_ids(path, ids)
        lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        num_tokens = int(offsets[-1])
        _check_offsets(path, offsets, ids, num_tokens)
        _check_counts(path, meta, len(ids), num_tokens, dim)
        info = ShardInfo(
            path,
            fmt,
            len(ids),
            num_tokens,
            dim,
            dtype,
            meta["quantization"],
            meta["normalized"],
            meta["encoder"],
        )
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

    def close(self) -> None:
        self._batches = None
        if self._source is not None:
            self._source.close()
            self._source = None


def _open_arrow(path: str) -> ArrowShard:
    try:
        source = pa.memory_map(path, "r")
    except (OSError, pa.ArrowException) as exc:
        raise _err(path, f"cannot open: {_one_line(exc)}") from None
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
        return ArrowShard(path, batches, reader.schema, fmt, source)
    except MaxsimError:
        source.close()
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        source.close()
        raise _err(path, f"corrupt or truncated Arrow IPC file: {_one_line(exc)}") from None


class ParquetShard(_RecordShard):
    """Parquet: ids and per-document lengths on open, embeddings one row group at a time (the last one
    read is kept, so consecutive reads decode each row group once)."""

    def __init__(self, path: str) -> None:
        try:
            self._file: pq.ParquetFile | None = pq.ParquetFile(path, memory_map=True)
            schema = self._file.schema_arrow
            file_meta = self._file.metadata
        except (pa.ArrowException, OSError) as exc:
            raise _err(path, f"corrupt or truncated Parquet file: {_one_line(exc)}") from None
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
            _check_nulls(path, head, head.column_names, 0)
            ids = head.column("id").to_pylist()
            if has_length:
                lens = head.column("length").to_numpy().astype(np.int64)
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
            raise _err(path, f"corrupt or truncated Parquet file: {_one_line(exc)}") from None
        _check_ids(path, ids)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        num_tokens = int(offsets[-1])
        _check_offsets(path, offsets, ids, num_tokens)
        _check_counts(path, meta, len(ids), num_tokens, dim)
        info = ShardInfo(
            path,
            "parquet",
            len(ids),
            num_tokens,
            dim,
            dtype,
            meta["quantization"],
            meta["normalized"],
            meta["encoder"],
        )
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
                raise _err(self.path, f"corrupt row group {index}: {_one_line(exc)}") from None
            first = int(self._chunk_starts[index])
            _check_nulls(self.path, table, names, first)
            lens = _list_lengths(_combine(table.column("embedding")))
            want = np.diff(self.offsets[first : int(self._chunk_starts[index + 1]) + 1])
            if not np.array_equal(lens, want):
                doc = first + int(np.flatnonzero(lens != want)[0])
                raise _err(
                    self.path,
                    f"document {_show_id(self.ids[doc])} (index {doc}) has "
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
        raise _err(path, "no such file")
    if os.path.isdir(path):
        raise _err(path, "is a directory; open it with open_corpus or name a shard file")
    kind = _sniff(path)
    if kind == "safetensors" and os.path.splitext(path)[1].lower() != ".safetensors":
        with open(path, "rb") as f:
            head = f.read(9)
        if len(head) < 9 or head[8:9] != b"{":
            raise _err(
                path, "not a shard: expected a safetensors, Arrow IPC or Parquet file (see docs/format.md)"
            )
    if kind == "arrow":
        return _open_arrow(path)
    if kind == "parquet":
        return ParquetShard(path)
    return SafetensorsShard(path)


def read_queries(path: str) -> DocBatch:
    """The whole query file as one batch (ids are query ids). `-` reads an Arrow IPC stream from stdin."""
    if path == "-":
        name = "<stdin>"
        data = sys.stdin.buffer.read()
        if not data:
            raise _err(name, "no data on stdin; pipe an Arrow IPC stream of queries (see docs/format.md)")
        try:
            reader = pa.ipc.open_stream(pa.py_buffer(data))
            batches = list(reader)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise _err(name, f"not an Arrow IPC stream: {_one_line(exc)}") from None
        shard: Shard = ArrowShard(name, batches, reader.schema, "arrow-stream")
    else:
        shard = open_shard(path)
    with shard:
        return shard.read_docs(0, shard.num_docs)


# ----------------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------------


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def list_shard_files(directory: str) -> list[str]:
    """Shard files of a directory (`*.safetensors`, `*.arrow`, `*.parquet`), sorted by name."""
    names = sorted(
        n
        for n in os.listdir(directory)
        if os.path.splitext(n)[1].lower() in SHARD_SUFFIXES and not n.startswith(".")
    )
    return [os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))]


def read_manifest(directory: str) -> list[dict[str, Any]]:
    """Entries of `directory/index.json`, each with a checked `path` (inside the directory) made absolute."""
    manifest = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(manifest, encoding="utf-8") as f:
            doc = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _err(manifest, f"not valid JSON: {_one_line(exc)}") from None
    if not isinstance(doc, dict) or doc.get("format") != CORPUS_FORMAT_NAME:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise _err(manifest, f"unknown format {got!r} (expected {CORPUS_FORMAT_NAME!r})")
    if doc.get("format_version") != CORPUS_FORMAT_VERSION:
        raise _err(
            manifest,
            f"unsupported format_version {doc.get('format_version')!r} "
            f"(this maxsim reads version {CORPUS_FORMAT_VERSION})",
        )
    entries = doc.get("shards")
    if not isinstance(entries, list) or not entries:
        raise _err(manifest, "'shards' must be a non-empty list")
    root = os.path.realpath(directory)
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise _err(manifest, f"shards[{i}] needs a 'path' string")
        rel = entry["path"]
        parts = re.split(r"[\\/]", rel)
        if not rel or os.path.isabs(rel) or rel.startswith(("/", "\\")) or ".." in parts:
            raise _err(
                manifest,
                f"shards[{i}] path {rel!r} names a file outside the corpus directory; "
                "manifest paths must be relative names inside it",
            )
        full = os.path.join(directory, rel)
        real = os.path.realpath(full)
        if os.path.commonpath([root, real]) != root:
            raise _err(
                manifest,
                f"shards[{i}] path {rel!r} resolves (through a symlink) to {real}, outside "
                "the corpus directory; copy the shard into it",
            )
        if not os.path.isfile(full):
            raise _err(manifest, f"shards[{i}] path {rel!r}: no such file in {directory}")
        for key in ("num_docs", "num_tokens"):
            if key in entry and not (isinstance(entry[key], int) and entry[key] >= 0):
                raise _err(manifest, f"shards[{i}] {key} must be a non-negative integer")
        out.append({**entry, "path": full, "relpath": rel})
    return out


class Corpus:
    """Shards that are scored together: one dim, dtype and quantization, ids unique across all shards.

    Documents are numbered globally in shard order: shard s holds `doc_starts[s]:doc_starts[s+1]`.
    """

    def __init__(self, shards: list[Shard]) -> None:
        if not shards:
            raise InputError("corpus: no shards given")
        first = shards[0].info
        for shard in shards[1:]:
            info = shard.info
            for key in ("dim", "dtype", "quantization"):
                if getattr(info, key) != getattr(first, key):
                    raise _err(
                        info.path,
                        f"{key} mismatch: {key}={getattr(info, key)} here but "
                        f"{key}={getattr(first, key)} in {first.path}; a corpus needs "
                        "one dim, dtype and quantization",
                    )
        encoders = {s.info.encoder for s in shards} - {None}
        if len(encoders) > 1:
            named = sorted(encoders)
            raise _err(
                shards[0].path,
                f"shards were made by different encoders ({', '.join(map(repr, named))}); "
                "their scores cannot be compared",
            )
        self.shards = shards
        self.dim = first.dim
        self.dtype = first.dtype
        self.quantization = first.quantization
        self.normalized = all(s.info.normalized for s in shards)
        self.encoder = next(iter(encoders), None)
        self.doc_starts = np.concatenate([[0], np.cumsum([s.num_docs for s in shards])]).astype(np.int64)
        self.num_docs = int(self.doc_starts[-1])
        self.num_tokens = sum(s.num_tokens for s in shards)
        self._index: dict[str, tuple[int, int]] | None = None
        self._id_order: tuple[pa.Array, np.ndarray, pa.Array] | None = None
        self._rank_of_ordinal: np.ndarray | None = None
        self._check_unique_ids()  # refuses duplicate ids across shards now, not at scoring time

    def _check_unique_ids(self) -> None:
        # Each shard's ids are unique already; across shards, equal neighbours in the sorted ids (no
        # Python object per id, and the sort is the one `id_order` keeps for writing runs). The id ->
        # (shard, doc) index, which exhaustive scoring never needs, is built only to name a duplicate.
        if len(self.shards) > 1 and _has_equal_neighbours(self.id_order()[2]):
            self.id_index()  # raises, naming both documents

    def id_order(self) -> tuple[pa.Array, np.ndarray, pa.Array]:
        """All ids as one Arrow array (corpus ordinal order), the ordinals sorted by id (ascending UTF-8
        bytes: Python's str order and trec_eval's strcmp), and the ids in that order; computed once."""
        if self._id_order is None:
            self._id_order = sorted_id_order([s.id_array for s in self.shards])
        return self._id_order

    def rank_of_ordinal(self) -> np.ndarray:
        """The inverse of `id_order`'s permutation: each document's position among the ids sorted by
        bytes (int64 [docs], corpus ordinal order); computed once."""
        if self._rank_of_ordinal is None:
            ordinal_of_rank = self.id_order()[1]
            ranks = np.empty(len(ordinal_of_rank), dtype=np.int64)
            ranks[ordinal_of_rank] = np.arange(len(ordinal_of_rank), dtype=np.int64)
            self._rank_of_ordinal = ranks
        return self._rank_of_ordinal

    @property
    def paths(self) -> list[str]:
        return [s.path for s in self.shards]

    def candidate_index(self, docnos: Iterable[str]) -> dict[str, tuple[int, int]]:
        """`id_index` restricted to `docnos` (those of them in the corpus): one hash lookup of the
        distinct docnos in all ids, by Arrow, instead of a Python dict of every id. 2M ids, 2-core
        machine (`python benchmarks/probe_candidate_index.py`), the index and a lookup per candidate:
        100K candidates 0.56 s against 1.56 s with `id_index`, 1M candidates 1.45 s against 2.60 s; and
        no dict of the whole corpus's ids in memory."""
        wanted = list(dict.fromkeys(docnos))
        if not wanted:
            return {}
        # the ids in ordinal order: `id_order`'s array when it is made already, else a concatenation
        if self._id_order is not None:
            ids = self._id_order[0]
        else:
            ids = concat_ids([s.id_array for s in self.shards])
        found = pc.index_in(pa.array(wanted, type=pa.large_string()), value_set=ids)
        ordinals = found.fill_null(-1).to_numpy().astype(np.int64)
        present = np.flatnonzero(ordinals >= 0)
        shard = np.searchsorted(self.doc_starts, ordinals[present], side="right") - 1
        local = ordinals[present] - self.doc_starts[shard]
        return {
            wanted[i]: (s, d)
            for i, s, d in zip(present.tolist(), shard.tolist(), local.tolist(), strict=True)
        }

    def id_index(self) -> dict[str, tuple[int, int]]:
        """doc id -> (shard index, document index in that shard); built once. A dict of every id: for
        looking up some ids, `candidate_index` is faster and smaller."""
        if self._index is None:
            index: dict[str, tuple[int, int]] = {}
            for s, shard in enumerate(self.shards):
                if not index.keys().isdisjoint(shard.ids):
                    d, doc_id = next((d, i) for d, i in enumerate(shard.ids) if i in index)
                    other = index[doc_id]
                    raise _err(
                        shard.path,
                        f"duplicate id {_show_id(doc_id)}: document {d} here and document {other[1]} of "
                        f"{self.shards[other[0]].path}; ids must be unique across a corpus",
                    )
                index.update(zip(shard.ids, zip(itertools.repeat(s), range(shard.num_docs)), strict=False))
            self._index = index
        return self._index

    def close(self) -> None:
        for shard in self.shards:
            shard.close()

    def __enter__(self) -> Corpus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _expand(path: str, verify_checksums: bool) -> list[tuple[str, dict[str, Any] | None]]:
    if not os.path.exists(path):
        raise _err(path, "no such file or directory")
    if not os.path.isdir(path):
        return [(path, None)]
    if os.path.exists(os.path.join(path, MANIFEST_NAME)):
        entries = read_manifest(path)
        if verify_checksums:
            manifest = os.path.join(path, MANIFEST_NAME)
            for entry in entries:
                want = entry.get("sha256")
                if not isinstance(want, str):
                    raise _err(manifest, f"no sha256 for shard {entry['relpath']!r}; cannot verify checksums")
                got = _sha256(entry["path"])
                if got != want.lower():
                    raise _err(
                        entry["path"],
                        f"sha256 {got} does not match {want} in {manifest}; the file changed or is damaged",
                    )
        return [(e["path"], e) for e in entries]
    files = list_shard_files(path)
    if not files:
        raise _err(path, "no shards (*.safetensors, *.arrow, *.parquet) in this directory")
    return [(f, None) for f in files]


def open_corpus(paths: Sequence[str | os.PathLike[str]], *, verify_checksums: bool = False) -> Corpus:
    """Open shards given as files and/or directories (with an optional `index.json` manifest).

    Refuses a dim/dtype/quantization mismatch between shards and duplicate ids across them. Manifest counts
    are checked against the shards; sha256 only with `verify_checksums=True` (it reads every byte).
    """
    if not paths:
        raise InputError("corpus: no shard files or directories given")
    listed: list[tuple[str, dict[str, Any] | None]] = []
    for p in paths:
        listed.extend(_expand(os.fspath(p), verify_checksums))
    seen: dict[str, str] = {}
    for path, _ in listed:
        real = os.path.realpath(path)
        if real in seen:
            raise _err(path, f"the same shard is listed twice (also as {seen[real]}); name each shard once")
        seen[real] = path
    shards: list[Shard] = []
    try:
        for path, entry in listed:
            shard = open_shard(path)
            shards.append(shard)
            if entry is not None:
                for key in ("num_docs", "num_tokens"):
                    if key in entry and entry[key] != getattr(shard, key):
                        raise _err(
                            path,
                            f"{key}={getattr(shard, key)} but the manifest "
                            f"{os.path.join(os.path.dirname(path), MANIFEST_NAME)} says "
                            f"{entry[key]}; rebuild it with write_manifest",
                        )
        return Corpus(shards)
    except BaseException:
        for shard in shards:
            shard.close()
        raise


def check_same_dim(queries: DocBatch, query_path: str, corpus: Corpus) -> None:
    """Queries and corpus must share `dim` (the score is a sum of dot products)."""
    dim = int(queries.embeddings.shape[1])
    if dim != corpus.dim:
        raise _err(
            query_path,
            f"queries have dim {dim} but the corpus ({corpus.shards[0].path}) has dim "
            f"{corpus.dim}; encode both with the same model",
        )


# ----------------------------------------------------------------------------------------------------
# Writers
# ----------------------------------------------------------------------------------------------------


def current_umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def staging_dir(parent: str, prefix: str) -> str:
    """A new private working folder in `parent` (same filesystem as the output, so renames are atomic),
    with the mode `mkdir` would give rather than mkdtemp's 0700: it becomes the user's output folder."""
    workdir = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(workdir, 0o777 & ~current_umask())
    return workdir


def _atomic_temp(path: str) -> tuple[int, str]:
    """A temp file next to `path` (same filesystem, so `os.replace` is atomic) with the permissions a
    plain `open(path, "w")` would give, not mkstemp's 0600."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise InputError(f"{path}: directory {directory} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise MaxsimError(f"{path}: cannot write here: {exc.strerror}; check the directory") from None
    os.fchmod(fd, 0o666 & ~current_umask())
    return fd, tmp


def _remove_quietly(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` via a temp file in the same directory and `os.replace`."""
    fd, tmp = _atomic_temp(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    arr = np.asarray(x)
    if arr.dtype == np.float64 or arr.dtype == np.float32 or arr.dtype == np.float16 or arr.dtype == np.int8:
        with warnings.catch_warnings():  # read-only (memory-mapped) arrays: we never write to them
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    if arr.dtype.kind in "iu" or arr.dtype.kind == "f":
        return torch.from_numpy(arr.astype(np.float32))
    raise TypeError(f"embeddings must be numeric arrays or tensors, not {arr.dtype}")


def infer_dtype(x: torch.Tensor) -> str:
    """The shard dtype for an input tensor: float64 is stored as float32, the others as they are."""
    if x.dtype == torch.float64:
        return "float32"
    if x.dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[x.dtype]
    raise TypeError(f"unsupported embedding dtype {x.dtype}")


class _SafetensorsSink:
    """Writes embeddings as they come after a reserved header; the rest and the header at close."""

    def __init__(self, path: str, dim: int, dtype: str, meta_keys: dict[str, str]) -> None:
        self.path, self.dim, self.dtype, self.meta_keys = path, dim, dtype, meta_keys
        # Reserve room for the longest header the counts could need (20-digit numbers); padded with spaces.
        big = 10**19
        self.reserved = len(self._header(big, big, big)) + 64
        self.reserved += -self.reserved % 8
        fd, self.tmp = _atomic_temp(path)
        self.file = os.fdopen(fd, "wb")
        self.file.seek(8 + self.reserved)
        self.scales: list[torch.Tensor] = []

    def _header(self, num_docs: int, num_tokens: int, id_bytes: int) -> bytes:
        item = {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1}[self.dtype]
        layout = [
            ("embeddings", _ST_DTYPES[self.dtype], [num_tokens, self.dim], num_tokens * self.dim * item)
        ]
        if self.dtype == "int8":
            layout.append(("scales", "F32", [num_tokens], 4 * num_tokens))
        layout += [
            ("offsets", "I64", [num_docs + 1], 8 * (num_docs + 1)),
            ("id_offsets", "I64", [num_docs + 1], 8 * (num_docs + 1)),
            ("ids", "U8", [id_bytes], id_bytes),
        ]
        header: dict[str, Any] = {
            "__metadata__": {**self.meta_keys, "num_docs": str(num_docs), "num_tokens": str(num_tokens)}
        }
        pos = 0
        for name, st, shape, nbytes in layout:
            header[name] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
        return json.dumps(header, separators=(",", ":")).encode("utf-8")

    def add(
        self, ids: list[str], values: torch.Tensor, lengths: np.ndarray, scales: torch.Tensor | None
    ) -> None:
        raw = values.view(torch.int16) if values.dtype == torch.bfloat16 else values
        self.file.write(memoryview(raw.numpy()).cast("B"))
        if scales is not None:
            self.scales.append(scales)

    def finish(self, ids: list[str], offsets: np.ndarray, meta_keys: dict[str, str]) -> None:
        self.meta_keys = meta_keys
        if self.scales:
            self.file.write(memoryview(torch.cat(self.scales).numpy()).cast("B"))
        encoded = [i.encode("utf-8") for i in ids]
        id_offsets = np.concatenate([[0], np.cumsum([len(b) for b in encoded])]).astype("<i8")
        self.file.write(offsets.astype("<i8").tobytes())
        self.file.write(id_offsets.tobytes())
        self.file.write(b"".join(encoded))
        header = self._header(len(ids), int(offsets[-1]), int(id_offsets[-1]))
        if len(header) > self.reserved:
            raise MaxsimError(f"{self.path}: metadata too long for the reserved header")
        self.file.seek(0)
        self.file.write(struct.pack("<Q", self.reserved))
        self.file.write(header + b" " * (self.reserved - len(header)))
        self.file.close()
        os.replace(self.tmp, self.path)
        self.tmp = None

    def abort(self) -> None:
        self.file.close()
        _remove_quietly(self.tmp)


def arrow_schema(
    dim: int, dtype: str, metadata: dict[str, str] | None = None, *, length_column: bool = False
) -> pa.Schema:
    """The format v1 Arrow schema: id utf8, embedding list<fixed_size_list<T, dim>>, scales for int8."""
    fields = [
        pa.field("id", pa.string(), nullable=False),
        pa.field("embedding", pa.list_(pa.list_(_ARROW_VALUE_TYPES[dtype], dim)), nullable=False),
    ]
    if dtype == "int8":
        fields.append(pa.field("scales", pa.list_(pa.float32()), nullable=False))
    if length_column:
        fields.append(pa.field("length", pa.int32(), nullable=False))
    return pa.schema(fields, metadata=metadata)


def _record_batch(
    schema: pa.Schema,
    dim: int,
    dtype: str,
    ids: list[str],
    values: torch.Tensor,
    lengths: np.ndarray,
    scales: torch.Tensor | None,
) -> pa.RecordBatch:
    raw = values.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else values.numpy()
    list_offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), type=pa.int32())
    vectors = pa.FixedSizeListArray.from_arrays(
        pa.array(raw.reshape(-1), type=_ARROW_VALUE_TYPES[dtype]), dim
    )
    columns = [pa.array(ids, type=pa.string()), pa.ListArray.from_arrays(list_offsets, vectors)]
    if dtype == "int8":
        assert scales is not None
        columns.append(pa.ListArray.from_arrays(list_offsets, pa.array(scales.numpy(), type=pa.float32())))
    if "length" in schema.names:
        columns.append(pa.array(lengths.astype(np.int32), type=pa.int32()))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


class _RecordSink:
    """Arrow IPC file or Parquet. The counts belong in the schema metadata, which precedes the data, so
    record batches are spilled to a temp IPC stream first and copied (memory-mapped) into the final file
    at close: bounded memory, twice the disk writes."""

    # A record batch / row group is flushed once it holds this many bytes of embeddings or documents:
    # small enough to bound memory, large enough that per-batch overhead is noise.
    FLUSH_BYTES = 16 << 20
    FLUSH_DOCS = 8192

    def __init__(self, path: str, dim: int, dtype: str, fmt: str) -> None:
        self.path, self.dim, self.dtype, self.fmt = path, dim, dtype, fmt
        self.schema = arrow_schema(dim, dtype, length_column=fmt == "parquet")
        fd, self.spill = _atomic_temp(path + ".spill")
        os.close(fd)
        self.writer = pa.ipc.new_stream(self.spill, self.schema)
        self.pending: list[tuple[list[str], torch.Tensor, np.ndarray, torch.Tensor | None]] = []
        self.pending_bytes = 0
        self.pending_docs = 0
        self.tmp: str | None = None

    def add(
        self, ids: list[str], values: torch.Tensor, lengths: np.ndarray, scales: torch.Tensor | None
    ) -> None:
        self.pending.append((ids, values, lengths, scales))
        self.pending_bytes += values.numel() * values.element_size()
        self.pending_docs += len(ids)
        if self.pending_bytes >= self.FLUSH_BYTES or self.pending_docs >= self.FLUSH_DOCS:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        ids = [i for p in self.pending for i in p[0]]
        values = torch.cat([p[1] for p in self.pending])
        lengths = np.concatenate([p[2] for p in self.pending])
        scales = torch.cat([p[3] for p in self.pending]) if self.dtype == "int8" else None  # type: ignore[misc]
        self.writer.write_batch(
            _record_batch(self.schema, self.dim, self.dtype, ids, values, lengths, scales)
        )
        self.pending, self.pending_bytes, self.pending_docs = [], 0, 0

    def finish(self, ids: list[str], offsets: np.ndarray, meta_keys: dict[str, str]) -> None:
        self._flush()
        self.writer.close()
        final_schema = self.schema.with_metadata(
            {**meta_keys, "num_docs": str(len(ids)), "num_tokens": str(int(offsets[-1]))}
        )
        fd, self.tmp = _atomic_temp(self.path)
        os.close(fd)
        with pa.OSFile(self.spill, "rb") as source:  # plain reads: a memory map would count in RSS
            reader = pa.ipc.open_stream(source)
            if self.fmt == "parquet":
                with pq.ParquetWriter(self.tmp, final_schema, compression="none") as out:
                    for batch in reader:
                        out.write_batch(batch)
            else:
                with pa.ipc.new_file(self.tmp, final_schema) as out:
                    for batch in reader:
                        out.write_batch(batch)
        os.replace(self.tmp, self.path)
        self.tmp = None
        _remove_quietly(self.spill)

    def abort(self) -> None:
        try:
            self.writer.close()
        except pa.ArrowException:
            pass
        _remove_quietly(self.spill)
        _remove_quietly(self.tmp)


def format_for_path(path: str) -> str:
    """The container a file name asks for: `.arrow` and `.parquet`, else safetensors."""
    return SHARD_SUFFIXES.get(os.path.splitext(path)[1].lower(), "safetensors")


class ShardWriter:
    """Streaming shard writer: `add(ids, embeddings)` any number of times, then `close()` -> ShardInfo.

    Checks every rule of the format as documents arrive (ids, lengths, dim, NaN/Inf) and writes
    atomically: nothing appears at `path` unless `close()` succeeds; `abort()` (or leaving a `with`
    block by an exception) removes the temp files. Memory holds the ids, the offsets and, for int8, the
    scales; embeddings go straight to disk.

    `normalized=None` records whether every token vector has unit L2 norm (within NORM_TOLERANCE);
    `True` asserts it and refuses vectors that are not. `format` is safetensors, arrow or parquet
    (default: from the file suffix; "arrow-stream" writes an Arrow IPC file).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        dim: int,
        dtype: str,
        *,
        normalized: bool | None = None,
        encoder: str | None = None,
        format: str | None = None,
    ) -> None:
        self.path = os.fspath(path)
        if dtype not in DTYPES:
            raise InputError(
                f"{self.path}: unsupported dtype {dtype!r} (expected one of {', '.join(DTYPES)})"
            )
        if not isinstance(dim, int) or dim < 1:
            raise InputError(f"{self.path}: dim must be a positive integer, not {dim!r}")
        fmt = format or format_for_path(self.path)
        if fmt == "arrow-stream":  # what a stream shard read back says; rewritten as a (seekable) IPC file
            fmt = "arrow"
        if fmt not in ("safetensors", "arrow", "parquet"):
            raise InputError(f"{self.path}: unknown shard format {fmt!r} (safetensors, arrow or parquet)")
        if encoder is not None and (not encoder or "\n" in encoder):
            raise InputError(f"{self.path}: encoder name must be a non-empty single line")
        if sys.byteorder != "little":
            raise MaxsimError("maxsim writes little-endian shards and needs a little-endian machine")
        self.dim, self.dtype, self.format, self.encoder = dim, dtype, fmt, encoder
        self.claimed_normalized = normalized
        self.all_unit = True
        self.ids: list[str] = []
        self._seen: set[str] = set()
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0
        self._closed = False
        meta = self._meta_keys(False)
        self._sink: _SafetensorsSink | _RecordSink
        if fmt == "safetensors":
            self._sink = _SafetensorsSink(self.path, dim, dtype, meta)
        else:
            self._sink = _RecordSink(self.path, dim, dtype, fmt)

    @property
    def num_docs(self) -> int:
        return len(self.ids)

    def _meta_keys(self, normalized: bool) -> dict[str, str]:
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "dim": str(self.dim),
            "dtype": self.dtype,
            "quantization": "int8-per-token" if self.dtype == "int8" else "none",
            "normalized": "true" if normalized else "false",
        }
        if self.encoder:
            meta["encoder"] = self.encoder
        return meta

    def _check_new_ids(self, ids: Sequence[str]) -> list[str]:
        out = []
        for k, doc_id in enumerate(ids):
            index = len(self.ids) + k
            if not isinstance(doc_id, str):
                raise InputError(f"{self.path}: id at index {index} is {type(doc_id).__name__}, not str")
            if not doc_id:
                raise InputError(f"{self.path}: empty id at index {index}; every document needs an id")
            if ID_WHITESPACE.search(doc_id):
                raise InputError(
                    f"{self.path}: id {_show_id(doc_id)} at index {index} contains whitespace; "
                    "ids must be single tokens for TREC runs"
                )
            try:
                doc_id.encode("utf-8")
            except UnicodeEncodeError:
                raise InputError(
                    f"{self.path}: id {_show_id(doc_id)} at index {index} is not valid UTF-8 (lone surrogate)"
                ) from None
            out.append(doc_id)
        seen = self._seen
        for k, doc_id in enumerate(out):
            if doc_id in seen:
                first = self.ids.index(doc_id) if doc_id in self.ids else out.index(doc_id)
                raise InputError(
                    f"{self.path}: duplicate id {_show_id(doc_id)} at indices {first} and "
                    f"{len(self.ids) + k}; ids must be unique"
                )
            seen.add(doc_id)
        return out

    def add(self, ids: Sequence[str], embeddings: Any, *, offsets: Any = None, scales: Any = None) -> None:
        """Append documents: `embeddings` is a list of per-document `[len, dim]` arrays/tensors, or one
        packed `[T, dim]` with `offsets` `[n+1]`. int8 needs `scales` (per document `[len]` or packed `[T]`).
        """
        if self._closed:
            raise MaxsimError(f"{self.path}: writer is closed")
        try:
            self._add(list(ids), embeddings, offsets, scales)
        except BaseException:
            self.abort()
            raise

    def _add(self, ids: list[str], embeddings: Any, offsets: Any, scales: Any) -> None:
        base = len(self.ids)
        if offsets is not None:
            packed = _as_tensor(embeddings)
            offs = np.asarray(offsets.cpu() if isinstance(offsets, torch.Tensor) else offsets, dtype=np.int64)
            if packed.ndim != 2:
                raise InputError(
                    f"{self.path}: packed embeddings must be [T, dim], got {tuple(packed.shape)}"
                )
            if len(ids) == 0:
                return
            _check_offsets(self.path, offs, ids, packed.shape[0])
            lengths = np.diff(offs)
        else:
            if len(embeddings) != len(ids):
                raise InputError(f"{self.path}: {len(ids)} ids but {len(embeddings)} embedding arrays")
            if len(ids) == 0:
                return
            docs = [_as_tensor(e) for e in embeddings]
            for k, d in enumerate(docs):
                if d.ndim != 2 or d.shape[0] == 0:
                    raise InputError(
                        f"{self.path}: document {_show_id(str(ids[k]))} (index {base + k}) has shape "
                        f"{tuple(d.shape)}; expected [num_tokens >= 1, {self.dim}]"
                    )
            lengths = np.array([d.shape[0] for d in docs], dtype=np.int64)
            packed = (
                docs[0]
                if len(docs) == 1
                else torch.cat([d.to(docs[0].dtype) if d.dtype != docs[0].dtype else d for d in docs])
            )
        if packed.shape[1] != self.dim:
            raise InputError(
                f"{self.path}: document {_show_id(str(ids[0]))} (index {base}) has vectors of "
                f"{packed.shape[1]} values; this shard has dim {self.dim}"
            )
        ids = self._check_new_ids(ids)
        scale_t: torch.Tensor | None = None
        if self.dtype == "int8":
            if packed.dtype != torch.int8:
                raise InputError(
                    f"{self.path}: int8 shard needs int8 embeddings (quantize first), got {packed.dtype}"
                )
            if scales is None:
                raise InputError(
                    f"{self.path}: int8 embeddings without scales (document {_show_id(ids[0])}); "
                    "pass one float32 scale per token"
                )
            if isinstance(scales, (list, tuple)):
                scale_t = torch.cat([_as_tensor(s).reshape(-1) for s in scales])
            else:
                scale_t = _as_tensor(scales).reshape(-1)
            scale_t = scale_t.to(torch.float32).contiguous()
            if scale_t.shape[0] != packed.shape[0]:
                raise InputError(
                    f"{self.path}: {scale_t.shape[0]} scales for {packed.shape[0]} tokens "
                    f"(documents from {_show_id(ids[0])})"
                )
            values = packed.contiguous()
        else:
            if packed.dtype == torch.int8:
                raise InputError(
                    f"{self.path}: int8 embeddings for a {self.dtype} shard; write an int8 shard "
                    "with scales instead"
                )
            values = packed.to(TORCH_DTYPES[self.dtype]).contiguous()
        local = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        _check_values(self.path, values, scale_t, local, ids, base)
        if self.format != "safetensors" and self.num_tokens + values.shape[0] > MAX_ARROW_TOKENS:
            raise InputError(
                f"{self.path}: more than 2^31-1 tokens in one {self.format} shard (its list "
                "offsets are int32); split the documents over several shards"
            )
        if self.dtype != "int8" and (self.all_unit or self.claimed_normalized):
            norms = values.float().norm(dim=1)
            off = (norms - 1).abs() > NORM_TOLERANCE
            if bool(off.any()):
                self.all_unit = False
                if self.claimed_normalized:
                    row = int(off.nonzero()[0, 0])
                    doc = int(np.searchsorted(local, row, side="right")) - 1
                    raise InputError(
                        f"{self.path}: normalized=True but token {row - int(local[doc])} of document "
                        f"{_show_id(ids[doc])} has L2 norm {float(norms[row]):.4g}; normalise the "
                        "vectors or pass normalized=None"
                    )
        self._sink.add(ids, values, lengths, scale_t)
        self.ids.extend(ids)
        self._lengths.append(lengths)
        self.num_tokens += int(values.shape[0])

    def close(self) -> ShardInfo:
        """Finish the file and move it into place; returns what was written."""
        if self._closed:
            raise MaxsimError(f"{self.path}: writer is already closed")
        try:
            if not self.ids:
                raise InputError(f"{self.path}: no documents to write; a shard holds at least one")
            if self.dtype == "int8":
                normalized = bool(self.claimed_normalized)
            elif self.claimed_normalized is None:
                normalized = self.all_unit
            else:
                normalized = self.claimed_normalized
            offsets = np.concatenate([[0], np.cumsum(np.concatenate(self._lengths))]).astype(np.int64)
            self._sink.finish(self.ids, offsets, self._meta_keys(normalized))
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return ShardInfo(
            self.path,
            self.format,
            len(self.ids),
            self.num_tokens,
            self.dim,
            self.dtype,
            "int8-per-token" if self.dtype == "int8" else "none",
            normalized,
            self.encoder,
        )

    def abort(self) -> None:
        """Drop everything written so far; nothing appears at `path`."""
        if not self._closed:
            self._closed = True
            self._sink.abort()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def write_shard(
    path: str | os.PathLike[str],
    ids: Sequence[str],
    embeddings: Any,
    *,
    offsets: Any = None,
    scales: Any = None,
    dtype: str | None = None,
    normalized: bool | None = None,
    encoder: str | None = None,
    format: str | None = None,
) -> ShardInfo:
    """Write one shard atomically from in-memory data and return its ShardInfo.

    `embeddings`: a list of per-document `[len, dim]` arrays/tensors (what PyLate and colpali-engine
    return), or one packed `[T, dim]` with `offsets` `[n+1]`. `dtype` defaults to the input's (float64 is
    stored as float32); int8 needs `scales`. `format` defaults to the file suffix (`.arrow`, `.parquet`,
    else safetensors). `normalized=None` records whether all vectors have unit L2 norm.

        write_shard("docs.safetensors", ids, model.encode(texts, is_query=False))
    """
    path = os.fspath(path)
    if offsets is not None:
        first = _as_tensor(embeddings)
    else:
        if len(embeddings) == 0:
            raise InputError(f"{path}: no documents to write; a shard holds at least one")
        first = _as_tensor(embeddings[0])
    if first.ndim != 2:
        raise InputError(
            f"{path}: embeddings must be [num_tokens, dim] per document (or packed [T, dim] with "
            f"offsets), got shape {tuple(first.shape)}"
        )
    dim = int(first.shape[1])
    writer = ShardWriter(
        path, dim, dtype or infer_dtype(first), normalized=normalized, encoder=encoder, format=format
    )
    writer.add(ids, embeddings, offsets=offsets, scales=scales)
    return writer.close()


def write_manifest(directory: str | os.PathLike[str], shard_paths: Sequence[str] | None = None) -> str:
    """Write `directory/index.json` (atomically) listing its shards with counts and sha256; return its path.

    `shard_paths` (names inside `directory`) fixes the order; default: every shard file, sorted by name.
    """
    directory = os.fspath(directory)
    files = (
        list_shard_files(directory)
        if shard_paths is None
        else [os.path.join(directory, os.path.basename(p)) for p in shard_paths]
    )
    if not files:
        raise _err(directory, "no shards to list in a manifest")
    entries = []
    for f in files:
        with open_shard(f) as shard:
            entries.append(
                {
                    "path": os.path.basename(f),
                    "num_docs": shard.num_docs,
                    "num_tokens": shard.num_tokens,
                    "sha256": _sha256(f),
                }
            )
    doc = {"format": CORPUS_FORMAT_NAME, "format_version": CORPUS_FORMAT_VERSION, "shards": entries}
    target = os.path.join(directory, MANIFEST_NAME)
    write_text_atomic(target, json.dumps(doc, indent=1) + "\n")
    return target
