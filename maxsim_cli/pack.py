"""Build format v1 shards from the embeddings users already have, streaming with bounded memory.

Sources:
- Parquet or Arrow IPC (file or stream) tables with an id column and a token-embedding column of type
  `list<list<float>>`, `list<fixed_size_list<float, dim>>` or their `large_list` variants (how Hugging Face
  datasets store token embeddings); ids may be strings or integers. An optional mask column (a list of
  0/1 or booleans per document, one per token vector) leaves out padding stored with the vectors.
- a folder of such files: the Hugging Face hub's layout (`data/train-00000-of-00002.parquet`, ...; the
  folder itself or the repository folder above `data/`), or a `datasets.Dataset.save_to_disk` folder
  (state.json + dataset_info.json + data-*.arrow).
- a directory of `.npy` files, one `[num_tokens, dim]` float array per document, id = file stem, read with
  `np.load(allow_pickle=False)` (never unpickled).
- from Python, a `datasets.Dataset` (`write_dataset`).

Parquet is read in record batches of about `BATCH_BYTES` of values (never the whole file), Arrow files
batch by batch, `.npy` files are memory-mapped one by one; a folder is read one file at a time. Documents
flow into `shard-00000.<ext>`, `shard-00001.<ext>`, ... with at most `shard_tokens` tokens per shard (a
longer document gets a shard of its own), and an `index.json` manifest. Everything is written in a temp
directory next to the output and moved into place at the end, so a failure leaves no partial shards.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from maxsim_cli.arrays import numbers
from maxsim_cli.errors import InputError, MaxsimWarning, UsageError
from maxsim_cli.lifeline import commit_point
from maxsim_cli.shards import (
    FLOAT_DTYPES,
    ID_RULE,
    MANIFEST_NAME,
    MAX_ARROW_TOKENS,
    SHARD_SUFFIXES,
    TORCH_DTYPES,
    ShardInfo,
    ShardWriter,
    first_nonfinite_row,
    id_problem,
    staging_dir,
    write_manifest,
)
from maxsim_cli.shards.files import OutputWriteError, check_output, move_into, swap_corpus_files
from maxsim_cli.shards.format import parse_patch_grid
from maxsim_cli.shards.inputs import zero_row_warning

# 8 Mi tokens per shard: 2 GiB at dim 128 in float16, far below the 2^31-token limit of Arrow shards,
# and few enough files that opening a corpus stays instant.
DEFAULT_SHARD_TOKENS = 1 << 23
# Values decoded per source batch. Peak RSS of `maxsim pack` on a 986 MB Parquet file (12,000 docs of
# 20-300 tokens, dim 128, float32, row groups of 1000 docs) was 417 / 517 / 685 / 926 MiB with 8 / 16 /
# 32 / 64 MiB batches (the interpreter with torch and pyarrow alone: 257 MiB); 16 MiB costs no
# measurable speed against 32 MiB and keeps the working set near a quarter of a GiB.
BATCH_BYTES = 16 << 20
OUTPUT_FORMATS = ("safetensors", "arrow")
_EXTENSIONS = {"safetensors": ".safetensors", "arrow": ".arrow"}


@dataclass
class PackResult:
    """What `pack` wrote."""

    outdir: str
    shards: list[ShardInfo]
    manifest: str
    num_docs: int = 0
    num_tokens: int = 0
    dim: int = 0
    dtype: str = ""
    normalized: bool = False
    sources: list[str] = field(default_factory=list)
    # Documents carrying an all-zero token row (padding kept without its mask, most often), the first one.
    zero_row_docs: int = 0
    first_zero_row_id: str = ""
    first_zero_row_where: str = ""

    def zero_row_warning(self, remedy: str) -> str:
        """One line about the documents with all-zero token rows, ending with `remedy`."""
        return zero_row_warning(
            self.outdir, self.zero_row_docs, self.first_zero_row_id, remedy, where=self.first_zero_row_where
        )


@dataclass
class _Batch:
    ids: list[str]
    values: torch.Tensor  # [t, dim], the source's float dtype
    lengths: np.ndarray  # int64 [n]
    where: list[str]  # per document: "SOURCE row R" or the .npy path, for error messages


# ----------------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------------

# Hugging Face shard names: `train-00000-of-00002.parquet` (hub), `data-00000-of-00001.arrow` (save_to_disk).
_HF_SHARD_NAME = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}")
_TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}


@dataclass
class _Part:
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


def _saved_dataset_parts(directory: str) -> list[_Part]:
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
        parts.append(_Part(path, _file_kind(path)))
    return parts


def _table_folder_parts(directory: str, names: list[str], suffix: str) -> list[_Part]:
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
        parts.append(_Part(path, _file_kind(path)))
    return parts


def _source_parts(src: str) -> list[_Part]:
    """The files a SOURCE stands for: itself, a `.npy` folder, a folder of Parquet or Arrow files (the
    Hugging Face hub's `data/` layout, directly or in a `data/` subfolder), a `save_to_disk` folder."""
    if not os.path.isdir(src):
        return [_Part(src, _file_kind(src))]
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
        return [_Part(src, "npy")]
    for suffix in _TABLE_SUFFIXES:
        if suffix in by_suffix:
            return _table_folder_parts(src, by_suffix[suffix], suffix)
    data = os.path.join(src, "data")
    if os.path.isdir(data):
        return _source_parts(data)
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
) -> _Batch:
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
    return _Batch(ids, tensor, lengths, where)


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


def _rows_per_batch(bytes_per_row: float) -> int:
    return max(1, int(BATCH_BYTES / max(bytes_per_row, 1.0)))


def _columns(id_column: str, embedding_column: str, mask_column: str | None) -> list[str]:
    return [id_column, embedding_column, *([mask_column] if mask_column is not None else [])]


def _parquet_batches(
    path: str, id_column: str, embedding_column: str, mask_column: str | None
) -> Iterator[_Batch]:
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
    rows = _rows_per_batch(size / total)
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
    path: str, id_column: str, embedding_column: str, mask_column: str | None, stream: bool
) -> Iterator[_Batch]:
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
                rows = _rows_per_batch(batch.nbytes / batch.num_rows)
                for start in range(0, batch.num_rows, rows):
                    part = batch.slice(start, rows)
                    yield _table_batch(path, part, id_column, embedding_column, mask_column, first + start)
                first += batch.num_rows
        except (pa.ArrowException, OSError) as exc:
            raise InputError(
                f"{path}: corrupt Arrow data near row {first}: {' '.join(str(exc).split())}"
            ) from None


def _dataset_batches(
    name: str, dataset: Any, id_column: str, embedding_column: str, mask_column: str | None
) -> Iterator[_Batch]:
    """A `datasets.Dataset` (or `IterableDataset`) read as Arrow tables of about BATCH_BYTES each."""
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
        rows = _rows_per_batch(data.nbytes / max(len(data), 1))
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


def _npy_batches(directory: str) -> Iterator[_Batch]:
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
        if pending >= BATCH_BYTES:
            yield _npy_batch(ids, arrays, where)
            ids, arrays, where, pending = [], [], [], 0
    if ids:
        yield _npy_batch(ids, arrays, where)


def _npy_batch(ids: list[str], arrays: list[torch.Tensor], where: list[str]) -> _Batch:
    dtype = arrays[0].dtype
    values = torch.cat([a.to(dtype) for a in arrays])
    lengths = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    return _Batch(ids, values, lengths, where)


def _count_docs(part: _Part) -> int:
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


def _batches(part: _Part, id_column: str, embedding_column: str, mask_column: str | None) -> Iterator[_Batch]:
    if part.kind == "npy":
        if mask_column is not None:
            raise UsageError(
                f"{part.path}: --mask-column applies to Parquet and Arrow sources; save each .npy "
                "document without its padding"
            )
        return _npy_batches(part.path)
    if part.kind == "parquet":
        return _parquet_batches(part.path, id_column, embedding_column, mask_column)
    if part.kind == "dataset":
        return _dataset_batches(part.path, part.dataset, id_column, embedding_column, mask_column)
    return _arrow_batches(
        part.path, id_column, embedding_column, mask_column, stream=part.kind == "arrow-stream"
    )


# ----------------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------------


def _normalize(batch: _Batch) -> torch.Tensor:
    """x / ||x||_2 per token vector, computed in float32 (float64 input stays float64)."""
    values = batch.values if batch.values.dtype == torch.float64 else batch.values.float()
    norms = values.norm(dim=1, keepdim=True)
    zero = norms[:, 0] == 0
    if bool(zero.any()):
        row = int(zero.nonzero()[0, 0])
        offsets = np.concatenate([[0], np.cumsum(batch.lengths)])
        k = int(np.searchsorted(offsets, row, side="right")) - 1
        raise InputError(
            f"{batch.where[k]}: document {batch.ids[k]!r} token {row - int(offsets[k])} is all zeros and "
            "cannot be L2-normalised; if it is padding, pass its mask with --mask-column, else drop that "
            "token or pack without --normalize"
        )
    return values / norms


def _check_ids(batch: _Batch) -> None:
    """Ids are TREC fields: non-empty, no whitespace, control or zero-width character (`id_problem`)."""
    for k, doc_id in enumerate(batch.ids):
        problem = id_problem(doc_id)
        if problem is not None:
            raise InputError(f"{batch.where[k]}: id {doc_id!r} {problem}; {ID_RULE}")


def _cast_checked(batch: _Batch, values: torch.Tensor, dtype: str) -> torch.Tensor:
    """`values` in the stored dtype; NaN/Inf (in the source, or from float16 overflow) names the document."""
    stored = values.to(TORCH_DTYPES[dtype])
    row = first_nonfinite_row(stored)
    if row is not None:
        offsets = np.concatenate([[0], np.cumsum(batch.lengths)])
        k = int(np.searchsorted(offsets, row, side="right")) - 1
        overflow = bool(torch.isfinite(values[row]).all())
        token = row - int(offsets[k])
        raise InputError(
            f"{batch.where[k]}: document {batch.ids[k]!r} has NaN or Inf values at token {token}"
            + (
                f" after conversion to {dtype} (out of its range); pack with --dtype float32"
                if overflow
                else ""
            )
        )
    return stored


def _corpus_names(outdir: str) -> list[str]:
    """The files of OUTDIR a corpus reader reads: shards and the manifest (the manifest first)."""
    names = [
        n
        for n in sorted(os.listdir(outdir))
        if n == MANIFEST_NAME or os.path.splitext(n)[1].lower() in SHARD_SUFFIXES
    ]
    return sorted(names, key=lambda n: n != MANIFEST_NAME)


def _check_outdir(outdir: str, overwrite: bool, overwrite_option: str) -> tuple[bool, list[str]]:
    """Whether OUTDIR exists already, and the corpus files in it that the new ones replace (only with
    `overwrite`; without it, a folder that holds shards or a manifest is refused)."""
    if not os.path.exists(outdir):
        parent = os.path.dirname(os.path.abspath(outdir))
        if not os.path.isdir(parent):
            raise UsageError(f"{outdir}: parent directory {parent} does not exist")
        return False, []
    if not os.path.isdir(outdir):
        raise UsageError(f"{outdir}: exists and is not a directory; give a new or empty directory with -o")
    old = _corpus_names(outdir)
    if old and not overwrite:
        raise UsageError(
            f"{outdir}: already holds shards ({old[0]}); choose a new or empty directory, or pass "
            f"{overwrite_option} to replace them"
        )
    return True, old


def pack(
    sources: Sequence[str],
    outdir: str,
    *,
    id_column: str = "id",
    embedding_column: str = "embedding",
    mask_column: str | None = None,
    dtype: str = "float16",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    normalize: bool = False,
    format: str = "safetensors",
    encoder: str | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    patch_grid: tuple[int, int] | str | None = None,
    patch_start: int = 0,
) -> PackResult:
    """Pack Parquet / Arrow IPC tables, folders of them (a Hugging Face hub `data/` folder, a
    `save_to_disk` folder) and `.npy` directories into shards `OUTDIR/shard-NNNNN.<ext>` + `index.json`.

    Documents keep their source order (a folder's files by name; a `save_to_disk` folder's in its
    state.json order). With `mask_column` (a list of 0/1 or booleans per document, one entry per token
    vector: an attention mask), masked token vectors are left out. A shard closes before the document
    that would take it past `shard_tokens` tokens. With `normalize`, every token vector becomes
    x / ||x||_2 (computed in float32) before the cast to `dtype`. Ids must be unique across all sources.
    An OUTDIR that holds shards is refused unless `overwrite`: its shards and manifest are then replaced
    (other files stay). `progress(docs, total_docs)` is called after each batch. `patch_grid` (rows,
    cols, or "ROWSxCOLS") and `patch_start` record image pages' patch grid in every shard
    (docs/format.md). Returns what was written,
    with the count of documents that carry all-zero token rows (`zero_row_docs`); on any error nothing is
    left in or next to OUTDIR and a replaced corpus is as it was.
    """
    if not sources:
        raise UsageError(
            "pack: give at least one SOURCE (Parquet, Arrow IPC, a folder of them, or a folder of .npy files)"
        )
    for src in sources:
        if not os.path.exists(src):
            raise InputError(f"{src}: no such file or directory")
    _check_options(dtype, format, shard_tokens)
    patch = _patch_option(patch_grid, patch_start)
    parts = [part for src in sources for part in _source_parts(src)]
    return _pack_parts(
        parts,
        outdir,
        list(sources),
        id_column=id_column,
        embedding_column=embedding_column,
        mask_column=mask_column,
        dtype=dtype,
        shard_tokens=shard_tokens,
        normalize=normalize,
        format=format,
        encoder=encoder,
        overwrite=overwrite,
        overwrite_option="--overwrite",
        progress=progress,
        patch=patch,
    )


def write_dataset(
    dataset: Any,
    outdir: str | os.PathLike[str],
    *,
    id_column: str = "id",
    embedding_column: str = "embedding",
    mask_column: str | None = None,
    dtype: str = "float16",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    normalize: bool = False,
    format: str = "safetensors",
    encoder: str | None = None,
    overwrite: bool = False,
    patch_grid: tuple[int, int] | str | None = None,
    patch_start: int = 0,
) -> PackResult:
    """Write a Hugging Face `datasets.Dataset` (or `IterableDataset`) of token embeddings as a corpus
    folder, exactly as `maxsim pack` writes one: shards `OUTDIR/shard-NNNNN.<ext>` and `index.json`.

    The dataset is read as Arrow record batches of about 16 MiB, so memory stays bounded (a memory-mapped
    dataset is never loaded whole). Columns: `id_column` (str or int), `embedding_column` (one list of
    token vectors per row), optionally `mask_column` (an attention mask: masked token vectors are left
    out). Documents with all-zero token rows (padding without its mask) are written as given, with a
    `MaxsimWarning`. The other options are `pack`'s.

        >>> write_dataset(ds, "corpus", embedding_column="colbert")  # doctest: +SKIP
    """
    if not (hasattr(dataset, "with_format") and hasattr(dataset, "column_names")):
        raise UsageError(
            f"write_dataset: expected a datasets.Dataset or IterableDataset, not {type(dataset).__name__}; "
            "for arrays in memory use write_shard"
        )
    _check_options(dtype, format, shard_tokens)
    patch = _patch_option(patch_grid, patch_start)
    # The dataset's own Arrow files are inputs: the output may not be (or be inside) their folder.
    inputs = [entry["filename"] for entry in getattr(dataset, "cache_files", None) or []]
    result = _pack_parts(
        [_Part("dataset", "dataset", dataset)],
        os.fspath(outdir),
        inputs,
        id_column=id_column,
        embedding_column=embedding_column,
        mask_column=mask_column,
        dtype=dtype,
        shard_tokens=shard_tokens,
        normalize=normalize,
        format=format,
        encoder=encoder,
        overwrite=overwrite,
        overwrite_option="overwrite=True",
        progress=None,
        patch=patch,
    )
    if result.zero_row_docs:
        remedy = "pass mask_column= (an attention mask column) so that padding is left out"
        warnings.warn(result.zero_row_warning(remedy), MaxsimWarning, stacklevel=2)
    return result


def _check_options(dtype: str, format: str, shard_tokens: int) -> None:
    if dtype not in FLOAT_DTYPES:
        raise UsageError(
            f"--dtype {dtype!r}: choose float16, bfloat16 or float32 (int8: use `maxsim quantize`)"
        )
    if format not in OUTPUT_FORMATS:
        raise UsageError(f"--format {format!r}: choose safetensors or arrow")
    if shard_tokens < 1:
        raise UsageError(f"--shard-tokens {shard_tokens}: must be at least 1")
    if format == "arrow" and shard_tokens > MAX_ARROW_TOKENS:
        raise UsageError(f"--shard-tokens {shard_tokens}: Arrow shards hold at most 2^31-1 tokens")


def _patch_option(patch_grid: tuple[int, int] | str | None, patch_start: int) -> tuple[Any, int]:
    """``patch_grid`` and ``patch_start`` checked (`UsageError`, before anything is read)."""
    try:
        return parse_patch_grid(patch_grid, patch_start if patch_grid is not None or patch_start else None,
                                "--patch-grid")  # fmt: skip
    except InputError as exc:
        raise UsageError(str(exc)) from None


def _pack_parts(
    parts: list[_Part],
    outdir: str,
    inputs: list[str],
    *,
    id_column: str,
    embedding_column: str,
    mask_column: str | None,
    dtype: str,
    shard_tokens: int,
    normalize: bool,
    format: str,
    encoder: str | None,
    overwrite: bool,
    overwrite_option: str,
    progress: Callable[[int, int], None] | None,
    patch: tuple[Any, int] = (None, 0),
) -> PackResult:
    check_output(outdir, inputs, folder=True)  # not an input folder (nor inside one), and writable
    existed, old_names = _check_outdir(outdir, overwrite, overwrite_option)
    total_docs = sum(_count_docs(part) for part in parts)
    parent = outdir if existed else os.path.dirname(os.path.abspath(outdir))
    try:
        workdir = staging_dir(parent, ".maxsim-pack-")
    except OutputWriteError as exc:
        raise exc.naming(outdir) from None
    try:
        result = _pack_into(
            workdir,
            parts,
            id_column,
            embedding_column,
            mask_column,
            dtype,
            shard_tokens,
            normalize,
            format,
            encoder,
            progress,
            total_docs,
            patch,
        )
        result.sources = inputs if parts[0].kind != "dataset" else ["dataset"]
        names = [os.path.basename(s.path) for s in result.shards]
        manifest = write_manifest(workdir, names)
        if existed:
            swap_corpus_files(workdir, outdir, [*names, MANIFEST_NAME], old_names)
            os.rmdir(workdir)
        else:
            with commit_point():  # the folder in place: the command's output is complete
                move_into(workdir, outdir, outdir)
        result.outdir = outdir
        result.manifest = os.path.join(outdir, os.path.basename(manifest))
        result.shards = [
            ShardInfo(**{**s.__dict__, "path": os.path.join(outdir, os.path.basename(s.path))})
            for s in result.shards
        ]
        return result
    except BaseException as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        if isinstance(exc, OutputWriteError):  # a shard of the staging folder: name the output folder
            raise exc.naming(outdir) from None
        raise


def _raise_duplicate(where: str, doc_id: str, ordinal: int, part_starts: list[tuple[int, _Part]]) -> None:
    """A document at `where` repeats the id of the document number `ordinal` (counted over all parts)."""
    start, part = [s for s in part_starts if s[0] <= ordinal][-1]
    earlier = (
        os.path.join(part.path, f"{doc_id}.npy")
        if part.kind == "npy"
        else f"{part.path} row {ordinal - start}"
    )
    raise InputError(
        f"{where}: duplicate id {doc_id!r} (first at {earlier}); ids must be unique across all sources"
    )


def _count_zero_rows(result: PackResult, batch: _Batch, values: torch.Tensor, offsets: np.ndarray) -> None:
    """Count the documents with an all-zero token row (padding kept without its mask, most often)."""
    zero = ~values.ne(0).any(dim=1)
    if not bool(zero.any()):
        return
    docs = np.unique(np.searchsorted(offsets, zero.nonzero()[:, 0].numpy(), side="right") - 1)
    if not result.zero_row_docs:
        result.first_zero_row_id, result.first_zero_row_where = batch.ids[docs[0]], batch.where[docs[0]]
    result.zero_row_docs += len(docs)


def _pack_into(
    workdir: str,
    parts: Sequence[_Part],
    id_column: str,
    embedding_column: str,
    mask_column: str | None,
    dtype: str,
    shard_tokens: int,
    normalize: bool,
    format: str,
    encoder: str | None,
    progress: Callable[[int, int], None] | None,
    total_docs: int,
    patch: tuple[Any, int] = (None, 0),
) -> PackResult:
    result = PackResult(outdir=workdir, shards=[], manifest="", dtype=dtype)
    seen: dict[str, int] = {}  # id -> ordinal of the document (over all parts) that first had it
    part_starts: list[tuple[int, _Part]] = []  # (first ordinal, part)
    writer: ShardWriter | None = None
    all_normalized = True
    docs_done = 0
    try:
        for part in parts:
            part_starts.append((docs_done, part))
            for batch in _batches(part, id_column, embedding_column, mask_column):
                dim = int(batch.values.shape[1])
                if result.dim == 0:
                    result.dim = dim
                elif dim != result.dim:
                    raise InputError(
                        f"{batch.where[0]}: document {batch.ids[0]!r} has dim {dim} but earlier documents "
                        f"have dim {result.dim}; pack one encoder's output at a time"
                    )
                for k, doc_id in enumerate(batch.ids):
                    ordinal = seen.setdefault(doc_id, docs_done + k)
                    if ordinal != docs_done + k:
                        _raise_duplicate(batch.where[k], doc_id, ordinal, part_starts)
                _check_ids(batch)
                values = _cast_checked(batch, _normalize(batch) if normalize else batch.values, dtype)
                offsets = np.concatenate([[0], np.cumsum(batch.lengths)]).astype(np.int64)
                _count_zero_rows(result, batch, values, offsets)
                a, n = 0, len(batch.ids)
                while a < n:
                    if writer is None:
                        name = f"shard-{len(result.shards):05d}{_EXTENSIONS[format]}"
                        writer = ShardWriter(
                            os.path.join(workdir, name),
                            dim,
                            dtype,
                            normalized=True if normalize else None,
                            encoder=encoder,
                            format=format,
                            warn_zero_rows=False,  # counted here, where the source row is known
                            patch_grid=patch[0],
                            patch_start=patch[1],
                        )
                    room = shard_tokens - writer.num_tokens
                    # Documents a..b-1 fit in the room left; an empty shard takes at least one.
                    b = int(np.searchsorted(offsets, offsets[a] + room, side="right")) - 1
                    b = min(n, max(b, a if writer.num_docs else a + 1))
                    if b > a:
                        t0, t1 = int(offsets[a]), int(offsets[b])
                        writer.add(batch.ids[a:b], values[t0:t1], offsets=offsets[a : b + 1] - t0)
                    if b < n or writer.num_tokens >= shard_tokens:
                        info = writer.close()
                        writer = None
                        result.shards.append(info)
                        all_normalized &= info.normalized
                    a = b
                docs_done += n
                if progress is not None:
                    progress(docs_done, max(total_docs, docs_done))
        if writer is not None:
            info = writer.close()
            writer = None
            result.shards.append(info)
            all_normalized &= info.normalized
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if not result.shards:
        raise InputError(f"{', '.join(p.path for p in parts)}: no documents to pack")
    result.num_docs = sum(s.num_docs for s in result.shards)
    result.num_tokens = sum(s.num_tokens for s in result.shards)
    result.normalized = all_normalized
    return result
