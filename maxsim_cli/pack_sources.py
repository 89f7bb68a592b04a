"""The sources `maxsim pack` reads, as batches of documents (`SourceBatch`: ids, token vectors, lengths
and where each document comes from), with bounded memory:

- Parquet or Arrow IPC (file or stream) tables with an id column and a token-embedding column of type
  `list<list<float>>`, `list<fixed_size_list<float, dim>>` or their `large_list` variants; an optional
  mask column leaves out padding stored with the vectors;
- a folder of such files (the Hugging Face hub's layout, a `datasets.Dataset.save_to_disk` folder);
- a directory of `.npy` files, one `[num_tokens, dim]` float array per document, read with
  `np.load(allow_pickle=False)` (never unpickled);
- a `datasets.Dataset` or `IterableDataset` in memory.

`source_parts` says which files a SOURCE stands for, `count_docs` how many documents a part holds (for
progress), `source_batches` reads a part in batches of about ``batch_bytes`` of values. Every problem
is an `InputError` (or a `UsageError` for an option) naming the file and row.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from maxsim_cli.arrays import numbers
from maxsim_cli.errors import InputError, UsageError


@dataclass
class SourceBatch:
    """Documents read from a source, in order: their token vectors packed, one length each."""

    ids: list[str]
    values: torch.Tensor  # [t, dim], the source's float dtype
    lengths: np.ndarray  # int64 [n]
    where: list[str]  # per document: "SOURCE row R" or the .npy path, for error messages


# Hugging Face shard names: `train-00000-of-00002.parquet` (hub), `data-00000-of-00001.arrow` (save_to_disk).
_HF_SHARD_NAME = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}")
_TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}


@dataclass
class SourcePart:
    """One file (or `.npy` folder, or in-memory dataset) that documents are read from, in order."""

    path: str  # what messages name
    kind: str  # parquet | arrow | arrow-stream | npy | dataset
    dataset: Any = None  # a `datasets.Dataset` / `IterableDataset`, for kind "dataset"


def _file_kind(path: str) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {os.strerror(exc.errno or 0) or exc}") from None
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1"):
        return "arrow"
    if head[:4] == b"\xff\xff\xff\xff":
        return "arrow-stream"
    raise InputError(f"{path}: not a Parquet or Arrow IPC file, nor a directory of .npy files")


def _visible_files(directory: str) -> list[str]:
    names = os.listdir(directory)
    return sorted(n for n in names if not n.startswith(".") and os.path.isfile(os.path.join(directory, n)))


def _saved_dataset_parts(directory: str) -> list[SourcePart]:
    """The Arrow files of a `datasets.Dataset.save_to_disk` folder, in the order its state.json lists them."""
    state_path = os.path.join(directory, "state.json")
    try:
        with open(state_path, encoding="utf-8") as f:
            files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(
            f"{state_path}: cannot read the dataset's file list ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())}); save the dataset again with save_to_disk"
        ) from None
    if not files or not all(isinstance(name, str) and name for name in files):
        raise InputError(f"{state_path}: lists no data files; save the dataset again with save_to_disk")
    parts = []
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise InputError(f"{path}: listed in {state_path} but missing; copy the whole folder again")
        parts.append(SourcePart(path, _file_kind(path)))
    return parts


def _table_folder_parts(directory: str, names: list[str], suffix: str) -> list[SourcePart]:
    """Parquet or Arrow files of a folder, by name; refused when they hold several splits (train, test)."""
    splits = sorted({m["split"] for m in map(_HF_SHARD_NAME.match, names) if m is not None})
    if len(splits) > 1:
        example = shlex.quote(os.path.join(directory, splits[0])) + f"-*{suffix}"
        raise UsageError(
            f"{directory}: holds the files of several splits ({', '.join(splits)}); pack one split's "
            f"files, e.g. maxsim pack {example} -o corpus/"
        )
    parts = []
    for name in names:
        path = os.path.join(directory, name)
        parts.append(SourcePart(path, _file_kind(path)))
    return parts


def source_parts(src: str) -> list[SourcePart]:
    """The files a SOURCE stands for: itself, a `.npy` folder, a folder of Parquet or Arrow files (the
    Hugging Face hub's `data/` layout, directly or in a `data/` subfolder), a `save_to_disk` folder."""
    if not os.path.isdir(src):
        return [SourcePart(src, _file_kind(src))]
    if os.path.isfile(os.path.join(src, "state.json")) and os.path.isfile(
        os.path.join(src, "dataset_info.json")
    ):
        return _saved_dataset_parts(src)
    names = _visible_files(src)
    if "dataset_dict.json" in names:
        splits = sorted(n for n in os.listdir(src) if os.path.isdir(os.path.join(src, n)))
        example = shlex.quote(os.path.join(src, splits[0] if splits else "train"))
        raise UsageError(
            f"{src}: a DatasetDict saved with save_to_disk (splits: {', '.join(splits) or 'none'}); "
            f"pack one split's folder, e.g. maxsim pack {example} -o corpus/"
        )
    by_suffix: dict[str, list[str]] = {}
    for name in names:
        suffix = os.path.splitext(name)[1].lower()
        if suffix in (".npy", *_TABLE_SUFFIXES):
            by_suffix.setdefault(suffix, []).append(name)
    if len(by_suffix) > 1:
        raise UsageError(
            f"{src}: holds {' and '.join(sorted(by_suffix))} files together; put each kind in a folder "
            "of its own or name the files"
        )
    if ".npy" in by_suffix:
        return [SourcePart(src, "npy")]
    for suffix in _TABLE_SUFFIXES:
        if suffix in by_suffix:
            return _table_folder_parts(src, by_suffix[suffix], suffix)
    data = os.path.join(src, "data")
    if os.path.isdir(data):
        return source_parts(data)
    raise InputError(f"{src}: no .npy, .parquet or .arrow files in this directory")


def _unwrap(arrow_type: pa.DataType) -> pa.DataType:
    """An extension type (datasets' Array2D, ...) as the Arrow type it stores."""
    return arrow_type.storage_type if isinstance(arrow_type, pa.ExtensionType) else arrow_type


def _storage(array: pa.Array) -> pa.Array:
    return array.storage if isinstance(array, pa.ExtensionArray) else array


def _is_list(arrow_type: pa.DataType) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _check_columns(
    path: str, schema: pa.Schema, id_column: str, embedding_column: str, mask_column: str | None
) -> None:
    columns = [("--id-column", id_column), ("--embedding-column", embedding_column)]
    if mask_column is not None:
        columns.append(("--mask-column", mask_column))
    try:
        names = schema.names
    except UnicodeDecodeError:  # pyarrow decodes them on reading
        raise InputError(f"{path}: a column name is not valid UTF-8, as Arrow's must be") from None
    for option, name in columns:
        if name not in names:
            raise UsageError(f"{path}: no column {name!r} ({option}); columns: {', '.join(names)}")
    id_type = _unwrap(schema.field(id_column).type)
    if not (pa.types.is_string(id_type) or pa.types.is_large_string(id_type) or pa.types.is_integer(id_type)):
        raise UsageError(f"{path}: id column {id_column!r} is {id_type}; it must hold strings or integers")
    emb_type = _unwrap(schema.field(embedding_column).type)
    ok = _is_list(emb_type)
    inner = _unwrap(emb_type.value_type) if ok else None
    ok = ok and (pa.types.is_fixed_size_list(inner) or _is_list(inner))
    if not ok or not pa.types.is_floating(inner.value_type):  # type: ignore[union-attr]
        raise UsageError(
            f"{path}: embedding column {embedding_column!r} is {emb_type}; it must be a list of token "
            "vectors: list<list<float>>, list<fixed_size_list<float, dim>> or their large_list variants"
        )
    if mask_column is not None:
        mask_type = _unwrap(schema.field(mask_column).type)
        value = mask_type.value_type if _is_list(mask_type) else None
        if value is None or not (
            pa.types.is_boolean(value) or pa.types.is_integer(value) or pa.types.is_floating(value)
        ):
            raise UsageError(
                f"{path}: mask column {mask_column!r} is {mask_type}; it must be a list of 0/1 or "
                "true/false per document, one entry per token vector (an attention mask)"
            )


def _doc_of(offsets: np.ndarray, index: int) -> int:
    """The document that flat position `index` (counted from offsets[0]) belongs to."""
    return int(np.searchsorted(offsets - offsets[0], index, side="right")) - 1


def _table_batch(
    path: str,
    batch: pa.RecordBatch | pa.Table,
    id_column: str,
    embedding_column: str,
    mask_column: str | None,
    first_row: int,
) -> SourceBatch:
    """Token vectors of one record batch, checked: no nulls, no empty documents, one width; with a mask
    column, the masked token vectors left out."""
    if isinstance(batch, pa.Table):  # from a dataset: one chunk per column, so one record batch
        batch = batch.combine_chunks().to_batches()[0]
    n = batch.num_rows
    id_col = _storage(batch.column(batch.schema.get_field_index(id_column)))
    emb_col = _storage(batch.column(batch.schema.get_field_index(embedding_column)))
    named = [(id_column, id_col), (embedding_column, emb_col)]
    mask_col = None
    if mask_column is not None:
        mask_col = _storage(batch.column(batch.schema.get_field_index(mask_column)))
        named.append((mask_column, mask_col))
    for name, col in named:
        try:  # offsets, UTF-8 and null counts, which the reads below trust (a bad offset is a crash)
            col.validate(full=True)
        except pa.ArrowException as exc:
            rows = f"rows {first_row}..{first_row + n - 1}"
            raise InputError(
                f"{path}: {rows}: column {name!r} is corrupt: {' '.join(str(exc).split())}"
            ) from None
        if col.null_count:
            row = first_row + int(np.flatnonzero(np.asarray(col.is_null()))[0])
            raise InputError(f"{path}: row {row}: null in column {name!r}")
    ids = [str(x) for x in id_col.to_pylist()]
    offsets = numbers(emb_col.offsets).astype(np.int64)
    lengths = np.diff(offsets)
    if np.any(lengths == 0):
        k = int(np.flatnonzero(lengths == 0)[0])
        raise InputError(
            f"{path}: row {first_row + k}: document {ids[k]!r} has zero tokens; every document needs "
            "at least one token vector"
        )
    vectors = _storage(emb_col.flatten())
    if vectors.null_count:
        k = _doc_of(offsets, int(np.flatnonzero(np.asarray(vectors.is_null()))[0]))
        raise InputError(f"{path}: row {first_row + k}: document {ids[k]!r} has a null token vector")
    if pa.types.is_fixed_size_list(vectors.type):
        dim = vectors.type.list_size
    else:
        widths = np.diff(numbers(vectors.offsets))
        dim = int(widths[0]) if widths.size else 0
        bad = np.flatnonzero(widths != dim)
        if bad.size:
            k = _doc_of(offsets, int(bad[0]))
            raise InputError(
                f"{path}: row {first_row + k}: document {ids[k]!r} has a token vector of "
                f"{int(widths[bad[0]])} values where the others have {dim}; all vectors need one dim"
            )
    values = vectors.flatten()
    if values.null_count:
        k = _doc_of(offsets, int(np.flatnonzero(np.asarray(values.is_null()))[0]) // max(dim, 1))
        raise InputError(f"{path}: row {first_row + k}: document {ids[k]!r} has null values")
    if dim < 1:
        raise InputError(f"{path}: row {first_row}: token vectors have no values")
    arr = numbers(values).reshape(-1, dim)
    where = [f"{path} row {first_row + k}" for k in range(n)]
    with warnings.catch_warnings():  # a read-only view of Arrow's buffer: only ever read, then cast
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(arr)
    if mask_col is not None:
        assert mask_column is not None
        tensor, lengths = _apply_mask(path, mask_column, mask_col, tensor, lengths, ids, first_row)
    return SourceBatch(ids, tensor, lengths, where)


def _apply_mask(
    path: str,
    mask_column: str,
    mask_col: pa.Array,
    values: torch.Tensor,
    lengths: np.ndarray,
    ids: list[str],
    first_row: int,
) -> tuple[torch.Tensor, np.ndarray]:
    """Keep the token vectors whose mask entry is true / 1; refuse a mask of another length or values."""
    mask_offsets = numbers(mask_col.offsets).astype(np.int64)
    mask_lengths = np.diff(mask_offsets)
    bad = np.flatnonzero(mask_lengths != lengths)
    if bad.size:
        k = int(bad[0])
        raise InputError(
            f"{path}: row {first_row + k}: document {ids[k]!r} has {int(lengths[k])} token vectors but "
            f"{int(mask_lengths[k])} entries in {mask_column!r}; the mask needs one entry per token vector"
        )
    flat = _storage(mask_col.flatten())
    if flat.null_count:
        k = _doc_of(mask_offsets, int(np.flatnonzero(np.asarray(flat.is_null()))[0]))
        raise InputError(f"{path}: row {first_row + k}: document {ids[k]!r} has a null in {mask_column!r}")
    # booleans are bits in Arrow, with no numpy view: as 0/1 bytes (their to_numpy imports pandas)
    raw = numbers(flat.cast(pa.uint8()) if pa.types.is_boolean(flat.type) else flat)
    if raw.dtype != np.bool_:
        odd = np.flatnonzero((raw != 0) & (raw != 1))
        if odd.size:
            k = _doc_of(mask_offsets, int(odd[0]))
            raise InputError(
                f"{path}: row {first_row + k}: document {ids[k]!r} has {raw[odd[0]].item()!r} in "
                f"{mask_column!r}; a mask holds 1/true for real tokens and 0/false for padding"
            )
    keep = raw.astype(np.bool_)
    kept = np.add.reduceat(keep, mask_offsets[:-1] - mask_offsets[0]) if len(lengths) else lengths
    empty = np.flatnonzero(kept == 0)
    if empty.size:
        k = int(empty[0])
        raise InputError(
            f"{path}: row {first_row + k}: document {ids[k]!r} has every token masked in {mask_column!r}; "
            "every document needs at least one token vector"
        )
    if bool(keep.all()):
        return values, lengths
    return values[torch.from_numpy(keep)], kept.astype(np.int64)


def _rows_per_batch(bytes_per_row: float, batch_bytes: int) -> int:
    return max(1, int(batch_bytes / max(bytes_per_row, 1.0)))


def _columns(id_column: str, embedding_column: str, mask_column: str | None) -> list[str]:
    return [id_column, embedding_column, *([mask_column] if mask_column is not None else [])]


def _parquet_batches(
    path: str, id_column: str, embedding_column: str, mask_column: str | None, batch_bytes: int
) -> Iterator[SourceBatch]:
    try:
        pf = pq.ParquetFile(path, memory_map=False, pre_buffer=False, buffer_size=1 << 22)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: corrupt or truncated Parquet file: {' '.join(str(exc).split())}") from None
    _check_columns(path, pf.schema_arrow, id_column, embedding_column, mask_column)
    meta = pf.metadata
    total = meta.num_rows
    if total == 0:
        return
    # Uncompressed size of the file's row groups spread over its rows: sizes the decode batches.
    # pre_buffer=False and a read buffer stream each column chunk; with pre-buffering, pyarrow kept every
    # row group read so far (RSS grew with the file: 180 -> 414 MiB of Arrow memory over 330 MB).
    size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    rows = _rows_per_batch(size / total, batch_bytes)
    first = 0
    try:
        for batch in pf.iter_batches(
            batch_size=rows, columns=_columns(id_column, embedding_column, mask_column), use_threads=False
        ):
            yield _table_batch(path, batch, id_column, embedding_column, mask_column, first)
            first += batch.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise InputError(
            f"{path}: corrupt Parquet data near row {first}: {' '.join(str(exc).split())}"
        ) from None


def _arrow_batches(
    path: str, id_column: str, embedding_column: str, mask_column: str | None, stream: bool, batch_bytes: int
) -> Iterator[SourceBatch]:
    try:
        source = pa.OSFile(path, "rb")  # batch by batch: a memory map would grow RSS to the file size
        reader = pa.ipc.open_stream(source) if stream else pa.ipc.open_file(source)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(
            f"{path}: corrupt or truncated Arrow IPC file: {' '.join(str(exc).split())}"
        ) from None
    with source:
        _check_columns(path, reader.schema, id_column, embedding_column, mask_column)
        batches = iter(reader) if stream else (reader.get_batch(i) for i in range(reader.num_record_batches))
        first = 0
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                rows = _rows_per_batch(batch.nbytes / batch.num_rows, batch_bytes)
                for start in range(0, batch.num_rows, rows):
                    part = batch.slice(start, rows)
                    yield _table_batch(path, part, id_column, embedding_column, mask_column, first + start)
                first += batch.num_rows
        except (pa.ArrowException, OSError) as exc:
            raise InputError(
                f"{path}: corrupt Arrow data near row {first}: {' '.join(str(exc).split())}"
            ) from None


def _dataset_batches(
    name: str, dataset: Any, id_column: str, embedding_column: str, mask_column: str | None, batch_bytes: int
) -> Iterator[SourceBatch]:
    """A `datasets.Dataset` (or `IterableDataset`) read as Arrow tables of about `batch_bytes` each."""
    columns = _columns(id_column, embedding_column, mask_column)
    names = list(dataset.column_names or [])
    if names:  # an IterableDataset may not know its columns before the first row
        missing = [c for c in columns if c not in names]
        if missing:
            option = {id_column: "id_column", embedding_column: "embedding_column"}.get(
                missing[0], "mask_column"
            )
            raise UsageError(f"{name}: no column {missing[0]!r} ({option}=); columns: {', '.join(names)}")
        dataset = dataset.select_columns(columns)
    rows = 256
    data = getattr(dataset, "data", None)
    if data is not None and len(dataset):
        rows = _rows_per_batch(data.nbytes / max(len(data), 1), batch_bytes)
    first = 0
    checked = False
    for table in dataset.with_format("arrow").iter(batch_size=rows):
        if not checked:
            _check_columns(name, table.schema, id_column, embedding_column, mask_column)
            checked = True
        if table.num_rows:
            yield _table_batch(name, table.select(columns), id_column, embedding_column, mask_column, first)
        first += table.num_rows


def _npy_files(directory: str) -> list[str]:
    names = sorted(n for n in os.listdir(directory) if n.endswith(".npy") and not n.startswith("."))
    if not names:
        raise InputError(f"{directory}: no .npy files in this directory")
    return [os.path.join(directory, n) for n in names]


def _npy_batches(directory: str, batch_bytes: int) -> Iterator[SourceBatch]:
    ids: list[str] = []
    arrays: list[torch.Tensor] = []
    where: list[str] = []
    pending = 0
    dim = None
    for path in _npy_files(directory):
        try:
            arr = np.load(path, allow_pickle=False, mmap_mode="r")
        except ValueError as exc:
            raise InputError(
                f"{path}: cannot read as a numeric .npy array ({' '.join(str(exc).split())}); "
                "save plain float arrays with np.save"
            ) from None
        except OSError as exc:
            raise InputError(
                f"{path}: corrupt or truncated .npy file: {' '.join(str(exc).split())}"
            ) from None
        doc_id = os.path.basename(path)[: -len(".npy")]
        if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
            raise InputError(
                f"{path}: document {doc_id!r} has shape {arr.shape}; expected [num_tokens >= 1, dim]"
            )
        if arr.dtype.kind != "f":
            raise InputError(f"{path}: document {doc_id!r} has dtype {arr.dtype}; expected float values")
        if dim is not None and arr.shape[1] != dim:
            raise InputError(
                f"{path}: document {doc_id!r} has vectors of {arr.shape[1]} values where earlier documents "
                f"have {dim}; all vectors need one dim"
            )
        dim = arr.shape[1]
        arrays.append(torch.from_numpy(np.array(arr, dtype=arr.dtype.newbyteorder("="), copy=True)))
        ids.append(doc_id)
        where.append(path)
        pending += arr.nbytes
        if pending >= batch_bytes:
            yield _npy_batch(ids, arrays, where)
            ids, arrays, where, pending = [], [], [], 0
    if ids:
        yield _npy_batch(ids, arrays, where)


def _npy_batch(ids: list[str], arrays: list[torch.Tensor], where: list[str]) -> SourceBatch:
    dtype = arrays[0].dtype
    values = torch.cat([a.to(dtype) for a in arrays])
    lengths = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    return SourceBatch(ids, values, lengths, where)


def count_docs(part: SourcePart) -> int:
    """Documents in a part, from metadata only (for progress)."""
    try:
        if part.kind == "npy":
            return len(_npy_files(part.path))
        if part.kind == "parquet":
            return pq.ParquetFile(part.path).metadata.num_rows
        if part.kind == "arrow":
            with pa.memory_map(part.path, "r") as source:
                reader = pa.ipc.open_file(source)
                return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        if part.kind == "dataset":
            return len(part.dataset) if hasattr(part.dataset, "__len__") else 0
    except (pa.ArrowException, OSError, TypeError):
        return 0  # reading the part names what is wrong with it
    return 0  # a stream: unknown until read


def source_batches(
    part: SourcePart, id_column: str, embedding_column: str, mask_column: str | None, batch_bytes: int
) -> Iterator[SourceBatch]:
    """The documents of ``part`` in order, in batches of about ``batch_bytes`` of values, checked."""
    if part.kind == "npy":
        if mask_column is not None:
            raise UsageError(
                f"{part.path}: --mask-column applies to Parquet and Arrow sources; save each .npy "
                "document without its padding"
            )
        return _npy_batches(part.path, batch_bytes)
    if part.kind == "parquet":
        return _parquet_batches(part.path, id_column, embedding_column, mask_column, batch_bytes)
    if part.kind == "dataset":
        return _dataset_batches(
            part.path, part.dataset, id_column, embedding_column, mask_column, batch_bytes
        )
    stream = part.kind == "arrow-stream"
    return _arrow_batches(part.path, id_column, embedding_column, mask_column, stream, batch_bytes)
