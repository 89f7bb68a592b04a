"""Build format v1 shards from the embeddings users already have, streaming with bounded memory.

Sources:
- Parquet or Arrow IPC (file or stream) tables with an id column and a token-embedding column of type
  `list<list<float>>`, `list<fixed_size_list<float, dim>>` or their `large_list` variants (how Hugging Face
  datasets store token embeddings); ids may be strings or integers.
- a directory of `.npy` files, one `[num_tokens, dim]` float array per document, id = file stem, read with
  `np.load(allow_pickle=False)` (never unpickled).

Parquet is read in record batches of about `BATCH_BYTES` of values (never the whole file), Arrow files are
memory-mapped, `.npy` files are memory-mapped one by one. Documents flow into `shard-00000.<ext>`,
`shard-00001.<ext>`, ... with at most `shard_tokens` tokens per shard (a longer document gets a shard of
its own), and an `index.json` manifest. Everything is written in a temp directory next to the output and
moved into place at the end, so a failure leaves no partial shards.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.shards import (
    FLOAT_DTYPES,
    ID_WHITESPACE,
    MANIFEST_NAME,
    MAX_ARROW_TOKENS,
    SHARD_SUFFIXES,
    TORCH_DTYPES,
    ShardInfo,
    ShardWriter,
    first_nonfinite_row,
    staging_dir,
    write_manifest,
)
from maxsim_cli.shards.files import OutputWriteError, check_output, write_error

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


@dataclass
class _Batch:
    ids: list[str]
    values: torch.Tensor  # [t, dim], the source's float dtype
    lengths: np.ndarray  # int64 [n]
    where: list[str]  # per document: "SOURCE row R" or the .npy path, for error messages


# ----------------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------------


def _source_kind(path: str) -> str:
    if os.path.isdir(path):
        return "npy"
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1"):
        return "arrow"
    if head[:4] == b"\xff\xff\xff\xff":
        return "arrow-stream"
    raise InputError(f"{path}: not a Parquet or Arrow IPC file, nor a directory of .npy files")


def _check_columns(path: str, schema: pa.Schema, id_column: str, embedding_column: str) -> None:
    for option, name in (("--id-column", id_column), ("--embedding-column", embedding_column)):
        if name not in schema.names:
            raise UsageError(f"{path}: no column {name!r} ({option}); columns: {', '.join(schema.names)}")
    id_type = schema.field(id_column).type
    if not (pa.types.is_string(id_type) or pa.types.is_large_string(id_type) or pa.types.is_integer(id_type)):
        raise UsageError(f"{path}: id column {id_column!r} is {id_type}; it must hold strings or integers")
    emb_type = schema.field(embedding_column).type
    ok = pa.types.is_list(emb_type) or pa.types.is_large_list(emb_type)
    inner = emb_type.value_type if ok else None
    ok = ok and (
        pa.types.is_fixed_size_list(inner) or pa.types.is_list(inner) or pa.types.is_large_list(inner)
    )
    if not ok or not pa.types.is_floating(inner.value_type):  # type: ignore[union-attr]
        raise UsageError(
            f"{path}: embedding column {embedding_column!r} is {emb_type}; it must be a list of token "
            "vectors: list<list<float>>, list<fixed_size_list<float, dim>> or their large_list variants"
        )


def _table_batch(
    path: str, batch: pa.RecordBatch, id_column: str, embedding_column: str, first_row: int
) -> _Batch:
    """Token vectors of one record batch, checked: no nulls, no empty documents, one width."""
    n = batch.num_rows
    id_col = batch.column(batch.schema.get_field_index(id_column))
    emb_col = batch.column(batch.schema.get_field_index(embedding_column))
    for name, col in ((id_column, id_col), (embedding_column, emb_col)):
        if col.null_count:
            row = first_row + int(np.flatnonzero(np.asarray(col.is_null()))[0])
            raise InputError(f"{path}: row {row}: null in column {name!r}")
    ids = [str(x) for x in id_col.to_pylist()]
    offsets = emb_col.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = np.diff(offsets)
    if np.any(lengths == 0):
        k = int(np.flatnonzero(lengths == 0)[0])
        raise InputError(
            f"{path}: row {first_row + k}: document {ids[k]!r} has zero tokens; every document needs "
            "at least one token vector"
        )
    vectors = emb_col.flatten()
    if vectors.null_count:
        token = int(np.flatnonzero(np.asarray(vectors.is_null()))[0])
        k = int(np.searchsorted(offsets - offsets[0], token, side="right")) - 1
        raise InputError(f"{path}: row {first_row + k}: document {ids[k]!r} has a null token vector")
    if pa.types.is_fixed_size_list(vectors.type):
        dim = vectors.type.list_size
    else:
        widths = np.diff(vectors.offsets.to_numpy(zero_copy_only=False))
        dim = int(widths[0]) if widths.size else 0
        bad = np.flatnonzero(widths != dim)
        if bad.size:
            k = int(np.searchsorted(offsets - offsets[0], bad[0], side="right")) - 1
            raise InputError(
                f"{path}: row {first_row + k}: document {ids[k]!r} has a token vector of "
                f"{int(widths[bad[0]])} values where the others have {dim}; all vectors need one dim"
            )
    values = vectors.flatten()
    if values.null_count:
        token = int(np.flatnonzero(np.asarray(values.is_null()))[0]) // max(dim, 1)
        k = int(np.searchsorted(offsets - offsets[0], token, side="right")) - 1
        raise InputError(f"{path}: row {first_row + k}: document {ids[k]!r} has null values")
    if dim < 1:
        raise InputError(f"{path}: row {first_row}: token vectors have no values")
    arr = values.to_numpy(zero_copy_only=False).reshape(-1, dim)
    where = [f"{path} row {first_row + k}" for k in range(n)]
    with warnings.catch_warnings():  # a read-only view of Arrow's buffer: only ever read, then cast
        warnings.simplefilter("ignore", UserWarning)
        values = torch.from_numpy(arr)
    return _Batch(ids, values, lengths, where)


def _rows_per_batch(bytes_per_row: float) -> int:
    return max(1, int(BATCH_BYTES / max(bytes_per_row, 1.0)))


def _parquet_batches(path: str, id_column: str, embedding_column: str) -> Iterator[_Batch]:
    try:
        pf = pq.ParquetFile(path, memory_map=False, pre_buffer=False, buffer_size=1 << 22)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: corrupt or truncated Parquet file: {' '.join(str(exc).split())}") from None
    _check_columns(path, pf.schema_arrow, id_column, embedding_column)
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
            batch_size=rows, columns=[id_column, embedding_column], use_threads=False
        ):
            yield _table_batch(path, batch, id_column, embedding_column, first)
            first += batch.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise InputError(
            f"{path}: corrupt Parquet data near row {first}: {' '.join(str(exc).split())}"
        ) from None


def _arrow_batches(path: str, id_column: str, embedding_column: str, stream: bool) -> Iterator[_Batch]:
    try:
        source = pa.OSFile(path, "rb")  # batch by batch: a memory map would grow RSS to the file size
        reader = pa.ipc.open_stream(source) if stream else pa.ipc.open_file(source)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(
            f"{path}: corrupt or truncated Arrow IPC file: {' '.join(str(exc).split())}"
        ) from None
    with source:
        _check_columns(path, reader.schema, id_column, embedding_column)
        batches = iter(reader) if stream else (reader.get_batch(i) for i in range(reader.num_record_batches))
        first = 0
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                rows = _rows_per_batch(batch.nbytes / batch.num_rows)
                for start in range(0, batch.num_rows, rows):
                    part = batch.slice(start, rows)
                    yield _table_batch(path, part, id_column, embedding_column, first + start)
                first += batch.num_rows
        except (pa.ArrowException, OSError) as exc:
            raise InputError(
                f"{path}: corrupt Arrow data near row {first}: {' '.join(str(exc).split())}"
            ) from None


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


def _count_docs(path: str, kind: str) -> int:
    """Documents in a source, from metadata only (for progress)."""
    if kind == "npy":
        return len(_npy_files(path))
    if kind == "parquet":
        return pq.ParquetFile(path).metadata.num_rows
    if kind == "arrow":
        with pa.memory_map(path, "r") as source:
            reader = pa.ipc.open_file(source)
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    return 0  # a stream: unknown until read


def _batches(path: str, kind: str, id_column: str, embedding_column: str) -> Iterator[_Batch]:
    if kind == "npy":
        return _npy_batches(path)
    if kind == "parquet":
        return _parquet_batches(path, id_column, embedding_column)
    return _arrow_batches(path, id_column, embedding_column, stream=kind == "arrow-stream")


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
            "cannot be L2-normalised; drop that token or pack without --normalize"
        )
    return values / norms


def _check_ids(batch: _Batch) -> None:
    """Ids are TREC fields: non-empty, no whitespace."""
    for k, doc_id in enumerate(batch.ids):
        if not doc_id or ID_WHITESPACE.search(doc_id):
            problem = "is empty" if not doc_id else "contains whitespace"
            raise InputError(
                f"{batch.where[k]}: id {doc_id!r} {problem}; ids must be single tokens for TREC runs"
            )


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


def _check_outdir(outdir: str) -> bool:
    """Whether OUTDIR exists already; refuses one that holds shards or a manifest."""
    if not os.path.exists(outdir):
        parent = os.path.dirname(os.path.abspath(outdir))
        if not os.path.isdir(parent):
            raise UsageError(f"{outdir}: parent directory {parent} does not exist")
        return False
    if not os.path.isdir(outdir):
        raise UsageError(f"{outdir}: exists and is not a directory; give a new or empty directory with -o")
    for name in sorted(os.listdir(outdir)):
        if name == MANIFEST_NAME or (os.path.splitext(name)[1].lower() in SHARD_SUFFIXES):
            raise UsageError(
                f"{outdir}: already holds shards ({name}); choose a new or empty directory, or remove them"
            )
    return True


def pack(
    sources: Sequence[str],
    outdir: str,
    *,
    id_column: str = "id",
    embedding_column: str = "embedding",
    dtype: str = "float16",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    normalize: bool = False,
    format: str = "safetensors",
    encoder: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PackResult:
    """Pack Parquet / Arrow IPC tables and `.npy` directories into shards `OUTDIR/shard-NNNNN.<ext>`.

    Documents keep their source order. A shard closes before the document that would take it past
    `shard_tokens` tokens. With `normalize`, every token vector becomes x / ||x||_2 (computed in float32)
    before the cast to `dtype`. Ids must be unique across all sources. `progress(docs, total_docs)` is
    called after each batch. Returns what was written; on any error nothing is left in or next to OUTDIR.
    """
    if not sources:
        raise UsageError("pack: give at least one SOURCE (Parquet, Arrow IPC, or a directory of .npy files)")
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
    kinds = []
    for src in sources:
        if not os.path.exists(src):
            raise InputError(f"{src}: no such file or directory")
        kinds.append(_source_kind(src))
    check_output(outdir, sources, folder=True)  # not an input folder (nor inside one), and writable
    existed = _check_outdir(outdir)
    total_docs = sum(_count_docs(s, k) for s, k in zip(sources, kinds, strict=True))
    parent = outdir if existed else os.path.dirname(os.path.abspath(outdir))
    try:
        workdir = staging_dir(parent, ".maxsim-pack-")
    except OutputWriteError as exc:
        raise exc.naming(outdir) from None
    moved: list[str] = []
    try:
        result = _pack_into(
            workdir,
            sources,
            kinds,
            id_column,
            embedding_column,
            dtype,
            shard_tokens,
            normalize,
            format,
            encoder,
            progress,
            total_docs,
        )
        names = [os.path.basename(s.path) for s in result.shards]
        manifest = write_manifest(workdir, names)
        if existed:
            for name in [*names, MANIFEST_NAME]:  # the manifest last: a corpus appears complete or not at all
                target = os.path.join(outdir, name)
                if os.path.exists(target):
                    raise UsageError(f"{outdir}: {name} appeared while packing; nothing was written")
                _move(os.path.join(workdir, name), target, outdir)
                moved.append(target)
            os.rmdir(workdir)
        else:
            _move(workdir, outdir, outdir)
        result.outdir = outdir
        result.manifest = os.path.join(outdir, os.path.basename(manifest))
        result.shards = [
            ShardInfo(**{**s.__dict__, "path": os.path.join(outdir, os.path.basename(s.path))})
            for s in result.shards
        ]
        return result
    except BaseException as exc:
        for target in moved:
            try:
                os.unlink(target)
            except OSError:
                pass
        shutil.rmtree(workdir, ignore_errors=True)
        if isinstance(exc, OutputWriteError):  # a shard of the staging folder: name the output folder
            raise exc.naming(outdir) from None
        raise


def _move(source: str, target: str, outdir: str) -> None:
    """`os.replace`, an error naming OUTDIR."""
    try:
        os.replace(source, target)
    except OSError as exc:
        raise write_error(outdir, exc) from None


def _raise_duplicate(
    where: str, doc_id: str, ordinal: int, source_starts: list[tuple[int, str, str]]
) -> None:
    """A document at `where` repeats the id of the document number `ordinal` (counted over all sources)."""
    start, src, kind = [s for s in source_starts if s[0] <= ordinal][-1]
    earlier = os.path.join(src, f"{doc_id}.npy") if kind == "npy" else f"{src} row {ordinal - start}"
    raise InputError(
        f"{where}: duplicate id {doc_id!r} (first at {earlier}); ids must be unique across all sources"
    )


def _pack_into(
    workdir: str,
    sources: Sequence[str],
    kinds: Sequence[str],
    id_column: str,
    embedding_column: str,
    dtype: str,
    shard_tokens: int,
    normalize: bool,
    format: str,
    encoder: str | None,
    progress: Callable[[int, int], None] | None,
    total_docs: int,
) -> PackResult:
    result = PackResult(outdir=workdir, shards=[], manifest="", dtype=dtype, sources=list(sources))
    seen: dict[str, int] = {}  # id -> ordinal of the document (over all sources) that first had it
    source_starts: list[tuple[int, str, str]] = []  # (first ordinal, source, kind)
    writer: ShardWriter | None = None
    all_normalized = True
    docs_done = 0
    try:
        for src, kind in zip(sources, kinds, strict=True):
            source_starts.append((docs_done, src, kind))
            for batch in _batches(src, kind, id_column, embedding_column):
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
                        _raise_duplicate(batch.where[k], doc_id, ordinal, source_starts)
                _check_ids(batch)
                values = _cast_checked(batch, _normalize(batch) if normalize else batch.values, dtype)
                offsets = np.concatenate([[0], np.cumsum(batch.lengths)]).astype(np.int64)
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
        raise InputError(f"{', '.join(sources)}: no documents to pack")
    result.num_docs = sum(s.num_docs for s in result.shards)
    result.num_tokens = sum(s.num_tokens for s in result.shards)
    result.normalized = all_normalized
    return result
