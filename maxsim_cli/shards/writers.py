"""Shard writers: `ShardWriter` streams documents into a safetensors, Arrow IPC or Parquet shard,
checking every rule of the format as they arrive, and writes atomically (nothing appears at the path
unless `close()` succeeds); `write_shard` writes one shard from in-memory data; `write_manifest`
writes a corpus directory's `index.json`.

Embeddings come as encoders return them: a list of per-document `[len, dim]` arrays (PyLate, stanford
ColBERT), a padded `[n, L, dim]` array with an `[n, L]` mask (colpali-engine, a Hugging Face model's
attention mask), or packed `[T, dim]` rows with offsets. Masked tokens are left out. Documents that
still carry all-zero token rows (padding passed without its mask) are counted and reported with a
`MaxsimWarning` when the shard is closed.

Writing takes tensors (numpy input is wrapped), so torch is imported when documents are added.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from maxsim_cli.codecs import (
    CODE_QUANTIZATIONS,
    CODEBOOK_KEY,
    CODEBOOK_SHA256_KEY,
    NUM_CENTROIDS_KEY,
    SOURCE_DOCS_KEY,
    SOURCE_GENERATION_KEY,
    SOURCE_IDS_KEY,
    code_width,
    has_scales,
)
from maxsim_cli.errors import InputError, MaxsimError, MaxsimWarning
from maxsim_cli.shards.arrow_shards import SHARD_COLUMNS
from maxsim_cli.shards.files import file_sha256, list_shard_files, write_error, write_text_atomic
from maxsim_cli.shards.format import (
    CORPUS_FORMAT_NAME,
    CORPUS_FORMAT_VERSION,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_ARROW_TOKENS,
    NORM_TOLERANCE,
    PATCH_GRID_KEY,
    PATCH_START_KEY,
    SHARD_SUFFIXES,
    ShardInfo,
    check_id,
    check_offsets,
    check_values,
    input_error,
    parse_patch_grid,
    show_id,
    torch_dtypes,
)
from maxsim_cli.shards.inputs import as_tensor, infer_dtype, mask_rows, zero_row_warning
from maxsim_cli.shards.readers import open_shard
from maxsim_cli.shards.sinks import RecordSink, SafetensorsSink

if TYPE_CHECKING:
    import torch


def _as_id_list(ids: Any) -> list[Any]:
    """Ids as a list: a numpy array or a tensor of integer ids gives Python ints."""
    return ids.tolist() if hasattr(ids, "tolist") and not isinstance(ids, (str, bytes)) else list(ids)


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
    (default: from the file suffix; "arrow-stream" writes an Arrow IPC file). `patch_grid` (rows, cols)
    and `patch_start` record where the image patches of each document are (docs/format.md, "Metadata").

    Documents with all-zero token rows are counted (`zero_row_docs`, `first_zero_row_id`) and `close()`
    warns about them with a `MaxsimWarning` (`warn_zero_rows=False`: the caller reports them).

    `metadata_columns` (Arrow and Parquet): the schema of metadata columns written after the shard's own
    (docs/format.md, "Metadata columns"); each `add` then gives their rows for its documents, a
    `pyarrow.Table` (or record batch) with those columns and types.
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
        warn_zero_rows: bool = True,
        patch_grid: tuple[int, int] | str | None = None,
        patch_start: int = 0,
        quantization: str | None = None,
        code_metadata: dict[str, str] | None = None,
        metadata_columns: pa.Schema | None = None,
    ) -> None:
        self.path = os.fspath(path)
        # uint8 embeddings are codes below 8 bits: `quantization` names the codec, `code_metadata` its keys
        # (maxsim_cli.codecs; `maxsim quantize --bits 4/2` writes them)
        self.quantization = quantization or ("int8-per-token" if dtype == "int8" else "none")
        self.code_metadata = dict(code_metadata or {})
        if (dtype == "uint8") != (self.quantization in CODE_QUANTIZATIONS):
            raise InputError(f"{self.path}: dtype {dtype!r} does not go with quantization {quantization!r}")
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
        self.patch_grid, self.patch_start = parse_patch_grid(
            patch_grid, patch_start if patch_grid is not None or patch_start else None, self.path
        )
        self.claimed_normalized = normalized
        self.all_unit = True
        self.ids: list[str] = []
        self._seen: set[str] = set()
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0
        self.zero_row_docs = 0
        self.first_zero_row_id: str | None = None
        self.warn_zero_rows = warn_zero_rows
        self._closed = False
        self.metadata_columns = self._check_metadata_schema(metadata_columns)
        meta = self._meta_keys(False)
        self._sink: SafetensorsSink | RecordSink
        try:
            if fmt == "safetensors":
                self._sink = SafetensorsSink(self.path, self.width, dtype, meta)
            else:
                self._sink = RecordSink(
                    self.path, self.width, dtype, fmt, has_scales(self.quantization), self.metadata_columns
                )
        except OSError as exc:  # a full disk, a read-only folder, ...: one line naming the shard
            raise write_error(self.path, exc) from None

    @property
    def num_docs(self) -> int:
        return len(self.ids)

    def _check_metadata_schema(self, schema: pa.Schema | None) -> pa.Schema | None:
        """The metadata columns to write (None: none), each named once and apart from the shard's own."""
        if schema is None or len(schema) == 0:
            return None
        if self.format == "safetensors":
            raise InputError(
                f"{self.path}: a safetensors shard holds no metadata columns; write it as .arrow or .parquet"
            )
        for name in schema.names:
            if name in SHARD_COLUMNS or schema.names.count(name) > 1:
                what = "is a column of the shard's own" if name in SHARD_COLUMNS else "appears more than once"
                raise InputError(
                    f"{self.path}: metadata column {name!r} {what}; give each metadata column a name of "
                    "its own"
                )
        return schema

    def _metadata_rows(self, ids: list[Any], rows: Any) -> pa.Table | None:
        """``rows`` (the metadata columns of the documents ``ids``) as a table of `metadata_columns`."""
        if self.metadata_columns is None:
            if rows is not None:
                raise InputError(
                    f"{self.path}: metadata_columns= rows for a writer made without metadata_columns"
                )
            return None
        if rows is None:
            names = ", ".join(self.metadata_columns.names)
            raise InputError(f"{self.path}: no metadata_columns= rows; this writer writes {names}")
        table = pa.Table.from_batches([rows]) if isinstance(rows, pa.RecordBatch) else rows
        if not isinstance(table, pa.Table) or table.num_rows != len(ids):
            got = f"{table.num_rows} rows" if isinstance(table, pa.Table) else type(rows).__name__
            raise InputError(
                f"{self.path}: metadata_columns= {got} for {len(ids)} documents; give a pyarrow table, a row "
                "a document"
            )
        columns = []
        for field in self.metadata_columns:
            found = table.schema.get_all_field_indices(field.name)
            if len(found) != 1 or table.schema.field(found[0]).type != field.type:
                have = ", ".join(f"{f.name} ({f.type})" for f in table.schema) or "none"
                raise InputError(
                    f"{self.path}: metadata_columns= rows need column {field.name!r} of type {field.type} "
                    f"once (they have: {have})"
                )
            columns.append(table.column(found[0]))
        return pa.Table.from_arrays(columns, schema=self.metadata_columns)

    @property
    def width(self) -> int:
        """Values a token takes in the file: dim, or the bytes of its codes."""
        return code_width(self.quantization, self.dim)

    def _meta_keys(self, normalized: bool) -> dict[str, str]:
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "dim": str(self.dim),
            "dtype": self.dtype,
            "quantization": self.quantization,
            "normalized": "true" if normalized else "false",
            **self.code_metadata,
        }
        if self.encoder:
            meta["encoder"] = self.encoder
        if self.patch_grid is not None:
            meta[PATCH_GRID_KEY] = f"{self.patch_grid[0]}x{self.patch_grid[1]}"
            meta[PATCH_START_KEY] = str(self.patch_start)
        return meta

    def _source(self) -> tuple[int, str] | None:
        """The source corpus the metadata records (`maxsim quantize`), or None."""
        docs, sha = self.code_metadata.get(SOURCE_DOCS_KEY), self.code_metadata.get(SOURCE_IDS_KEY)
        return None if docs is None or sha is None else (int(docs), sha)

    def _check_new_ids(self, ids: Sequence[str | int]) -> list[str]:
        out = []
        for k, doc_id in enumerate(ids):
            index = len(self.ids) + k
            if isinstance(doc_id, (int, np.integer)) and not isinstance(doc_id, (bool, np.bool_)):
                doc_id = str(int(doc_id))  # as `maxsim pack` stores an integer id column: 7 -> "7"
            if not isinstance(doc_id, str):
                raise InputError(
                    f"{self.path}: id at index {index} is {type(doc_id).__name__}; ids must be str or int"
                )
            check_id(self.path, doc_id, f"at index {index}")
            try:
                doc_id.encode("utf-8")
            except UnicodeEncodeError:
                raise InputError(
                    f"{self.path}: id {show_id(doc_id)} at index {index} is not valid UTF-8 (lone surrogate)"
                ) from None
            out.append(doc_id)
        seen = self._seen
        for k, doc_id in enumerate(out):
            if doc_id in seen:
                first = self.ids.index(doc_id) if doc_id in self.ids else out.index(doc_id)
                raise InputError(
                    f"{self.path}: duplicate id {show_id(doc_id)} at indices {first} and "
                    f"{len(self.ids) + k}; ids must be unique"
                )
            seen.add(doc_id)
        return out

    def add(
        self,
        ids: Sequence[str | int],
        embeddings: Any,
        *,
        mask: Any = None,
        offsets: Any = None,
        scales: Any = None,
        metadata_columns: Any = None,
    ) -> None:
        """Append documents. `embeddings`: a list of per-document `[len, dim]` arrays/tensors, a padded
        `[n, L, dim]` array/tensor, or one packed `[T, dim]` with `offsets` `[n+1]`. `mask` (with a list
        or a padded array): `[n, L]` or one `[len]` per document, True/1 for real tokens; masked tokens
        are left out. int8 needs `scales` (per document `[len]`, padded `[n, L]`, or packed `[T]`).
        Ids are str or int (`7` is stored as `"7"`). `metadata_columns`: the documents' rows of the
        writer's metadata columns (a `pyarrow.Table`), when it was made with them.
        """
        if self._closed:
            raise MaxsimError(f"{self.path}: writer is closed")
        try:
            id_list = _as_id_list(ids)
            metadata = self._metadata_rows(id_list, metadata_columns)
            self._add(id_list, embeddings, mask, offsets, scales, metadata)
        except BaseException:
            self.abort()
            raise

    def _unpad(
        self, ids: list[Any], embeddings: Any, mask: Any, scales: Any
    ) -> tuple[list[torch.Tensor], Any]:
        """Per-document `[len, dim]` tensors, masked tokens left out (and so their scales)."""
        import torch

        base = len(self.ids)
        padded = isinstance(embeddings, (torch.Tensor, np.ndarray)) and embeddings.ndim == 3
        if isinstance(embeddings, (torch.Tensor, np.ndarray)) and not padded:
            raise InputError(
                f"{self.path}: embeddings of shape {tuple(embeddings.shape)}; pass a list of [tokens, dim] "
                "arrays (one per document), a padded [documents, tokens, dim] array with its mask, or "
                "packed [tokens, dim] rows with offsets="
            )
        if padded:
            docs = list(as_tensor(embeddings, f"{self.path}: embeddings").unbind(0))
        else:
            docs = [as_tensor(e, self._document(ids, k)) for k, e in enumerate(embeddings)]
        if len(docs) != len(ids):
            raise InputError(f"{self.path}: {len(ids)} ids but {len(docs)} documents of embeddings")
        for k, d in enumerate(docs):
            if d.ndim != 2 or d.shape[0] == 0:
                raise InputError(
                    f"{self._document(ids, k)} has shape {tuple(d.shape)}; expected "
                    f"[num_tokens >= 1, {self.dim}]"
                )
            if d.shape[1] != self.dim:
                raise InputError(
                    f"{self._document(ids, k)} has vectors of {d.shape[1]} values; this shard has dim "
                    f"{self.dim}; encode all documents with one model"
                )
        if mask is None:
            return docs, scales
        if padded and hasattr(mask, "shape") and tuple(mask.shape) != tuple(embeddings.shape[:2]):
            raise InputError(
                f"{self.path}: mask has shape {tuple(mask.shape)}; expected {tuple(embeddings.shape[:2])} "
                f"([documents, tokens]) for embeddings of shape {tuple(embeddings.shape)}"
            )
        masks = list(mask.unbind(0)) if isinstance(mask, torch.Tensor) else list(mask)
        if len(masks) != len(docs):
            raise InputError(f"{self.path}: {len(masks)} masks for {len(docs)} documents; give one each")
        keeps = []
        for k, (d, m) in enumerate(zip(docs, masks, strict=True)):
            where = f"{self.path}: the mask of document {show_id(str(ids[k]))} (index {base + k})"
            keep = mask_rows(m, where).reshape(-1)
            if keep.shape[0] != d.shape[0]:
                raise InputError(f"{where} has {keep.shape[0]} entries for {d.shape[0]} token rows")
            if not bool(keep.any()):
                raise InputError(f"{where} masks every token; every document needs at least one token")
            keeps.append(keep)
        if scales is not None:
            if isinstance(scales, (torch.Tensor, np.ndarray)) and scales.ndim == 1:
                raise InputError(
                    f"{self.path}: packed [T] scales with a mask; pass one [len] per document or a padded "
                    "[documents, tokens] array"
                )
            scales = [as_tensor(s).reshape(-1)[keep] for s, keep in zip(scales, keeps, strict=True)]
        return [d if bool(keep.all()) else d[keep] for d, keep in zip(docs, keeps, strict=True)], scales

    def _document(self, ids: list[Any], k: int) -> str:
        """The ``k``-th document of an `add` call, as messages name it (its id when it has one)."""
        doc_id = f"{show_id(str(ids[k]))} " if k < len(ids) else ""
        return f"{self.path}: document {doc_id}(index {len(self.ids) + k})"

    def _add(
        self,
        ids: list[Any],
        embeddings: Any,
        mask: Any,
        offsets: Any,
        scales: Any,
        metadata: pa.Table | None = None,
    ) -> None:
        import torch

        base = len(self.ids)
        if offsets is not None and mask is not None:
            raise InputError(
                f"{self.path}: mask= with offsets=: packed rows hold no padding; give the padded "
                "embeddings with their mask, or the packed rows alone"
            )
        if offsets is not None:
            packed = as_tensor(embeddings, f"{self.path}: embeddings")
            offs = np.asarray(offsets.cpu() if isinstance(offsets, torch.Tensor) else offsets, dtype=np.int64)
            if packed.ndim != 2:
                raise InputError(
                    f"{self.path}: packed embeddings must be [T, dim], got {tuple(packed.shape)}"
                )
            if len(ids) == 0:
                return
            check_offsets(self.path, offs, ids, packed.shape[0])
            lengths = np.diff(offs)
        else:
            if len(embeddings) == 0 and len(ids) == 0:
                return
            docs, scales = self._unpad(ids, embeddings, mask, scales)
            lengths = np.array([d.shape[0] for d in docs], dtype=np.int64)
            packed = (
                docs[0]
                if len(docs) == 1
                else torch.cat([d.to(docs[0].dtype) if d.dtype != docs[0].dtype else d for d in docs])
            )
        if packed.shape[1] != self.width:
            raise InputError(
                f"{self.path}: document {show_id(str(ids[0]))} (index {base}) has vectors of "
                f"{packed.shape[1]} values; this shard has dim {self.dim}"
                + (f" ({self.width} bytes of codes a token)" if self.width != self.dim else "")
            )
        ids = self._check_new_ids(ids)
        scale_t: torch.Tensor | None = None
        if self.dtype in ("int8", "uint8"):
            if packed.dtype != torch_dtypes()[self.dtype]:
                raise InputError(
                    f"{self.path}: {self.dtype} shard needs {self.dtype} embeddings (quantize first), "
                    f"got {packed.dtype}"
                )
            if not has_scales(self.quantization):
                if scales is not None:
                    raise InputError(f"{self.path}: {self.quantization} codes take no scales")
            elif scales is None:
                raise InputError(
                    f"{self.path}: int8 embeddings without scales (document {show_id(ids[0])}); "
                    "pass one float32 scale per token"
                )
            elif isinstance(scales, (list, tuple)):
                scale_t = torch.cat([as_tensor(s).reshape(-1) for s in scales])
            else:
                scale_t = as_tensor(scales).reshape(-1)
            if scale_t is not None:
                scale_t = scale_t.to(torch.float32).contiguous()
            if scale_t is not None and scale_t.shape[0] != packed.shape[0]:
                raise InputError(
                    f"{self.path}: {scale_t.shape[0]} scales for {packed.shape[0]} tokens "
                    f"(documents from {show_id(ids[0])})"
                )
            values = packed.contiguous()
        else:
            if packed.dtype == torch.int8:
                raise InputError(
                    f"{self.path}: int8 embeddings for a {self.dtype} shard; write an int8 shard "
                    "with scales instead"
                )
            values = packed.to(torch_dtypes()[self.dtype]).contiguous()
        local = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        check_values(self.path, values, scale_t, local, ids, base)
        if self.format != "safetensors" and self.num_tokens + values.shape[0] > MAX_ARROW_TOKENS:
            raise InputError(
                f"{self.path}: more than 2^31-1 tokens in one {self.format} shard (its list "
                "offsets are int32); split the documents over several shards"
            )
        if self.dtype not in ("int8", "uint8") and (self.all_unit or self.claimed_normalized):
            norms = values.float().norm(dim=1)
            off = (norms - 1).abs() > NORM_TOLERANCE
            if bool(off.any()):
                self.all_unit = False
                if self.claimed_normalized:
                    row = int(off.nonzero()[0, 0])
                    doc = int(np.searchsorted(local, row, side="right")) - 1
                    raise InputError(
                        f"{self.path}: normalized=True but token {row - int(local[doc])} of document "
                        f"{show_id(ids[doc])} has L2 norm {float(norms[row]):.4g}; normalise the "
                        "vectors or pass normalized=None"
                    )
        if self.dtype not in ("int8", "uint8"):
            self._count_zero_rows(values, local, ids)
        try:
            if metadata is None:
                self._sink.add(ids, values, lengths, scale_t)
            else:
                assert isinstance(self._sink, RecordSink)
                self._sink.add(ids, values, lengths, scale_t, metadata)
        except OSError as exc:
            raise write_error(self.path, exc) from None
        self.ids.extend(ids)
        self._lengths.append(lengths)
        self.num_tokens += int(values.shape[0])

    def _count_zero_rows(self, values: torch.Tensor, offsets: np.ndarray, ids: list[str]) -> None:
        """Count the documents with an all-zero token row: a real encoder never outputs one, padding does."""
        zero = ~values.ne(0).any(dim=1)
        if not bool(zero.any()):
            return
        rows = zero.nonzero()[:, 0].numpy()
        docs = np.unique(np.searchsorted(offsets, rows, side="right") - 1)
        self.zero_row_docs += len(docs)
        if self.first_zero_row_id is None:
            self.first_zero_row_id = ids[int(docs[0])]

    def close(self) -> ShardInfo:
        """Finish the file and move it into place; returns what was written."""
        return self._close(stacklevel=3)

    def _close(self, stacklevel: int) -> ShardInfo:
        if self._closed:
            raise MaxsimError(f"{self.path}: writer is already closed")
        try:
            if not self.ids:
                raise InputError(f"{self.path}: no documents to write; a shard holds at least one")
            if self.dtype in ("int8", "uint8"):
                normalized = bool(self.claimed_normalized)
            elif self.claimed_normalized is None:
                normalized = self.all_unit
            else:
                normalized = self.claimed_normalized
            offsets = np.concatenate([[0], np.cumsum(np.concatenate(self._lengths))]).astype(np.int64)
            try:
                self._sink.finish(self.ids, offsets, self._meta_keys(normalized))
            except OSError as exc:
                raise write_error(self.path, exc) from None
        except BaseException:
            self.abort()
            raise
        self._closed = True
        if self.warn_zero_rows and self.first_zero_row_id is not None:
            remedy = "pass mask= (the attention mask) so that padding is left out"
            message = zero_row_warning(self.path, self.zero_row_docs, self.first_zero_row_id, remedy)
            warnings.warn(message, MaxsimWarning, stacklevel=stacklevel)
        return ShardInfo(
            self.path,
            self.format,
            len(self.ids),
            self.num_tokens,
            self.dim,
            self.dtype,
            self.quantization,
            normalized,
            self.encoder,
            self.patch_grid,
            self.patch_start,
            self.code_metadata.get(CODEBOOK_KEY),
            self.code_metadata.get(CODEBOOK_SHA256_KEY),
            int(self.code_metadata.get(NUM_CENTROIDS_KEY, 0)),
            self._source(),
            _whole(self.code_metadata.get(SOURCE_GENERATION_KEY)),
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
            self._close(stacklevel=3)


def write_shard(
    path: str | os.PathLike[str],
    ids: Sequence[str | int],
    embeddings: Any,
    *,
    mask: Any = None,
    offsets: Any = None,
    scales: Any = None,
    dtype: str | None = None,
    normalized: bool | None = None,
    encoder: str | None = None,
    format: str | None = None,
    patch_grid: tuple[int, int] | str | None = None,
    patch_start: int = 0,
) -> ShardInfo:
    """Write one shard atomically from in-memory data and return its ShardInfo.

    `embeddings`: a list of per-document `[len, dim]` arrays/tensors (what PyLate and stanford ColBERT
    return), a padded `[n, L, dim]` array/tensor with `mask` `[n, L]` (what colpali-engine or a Hugging
    Face model returns, with the batch's attention mask; True/1 marks a real token), or one packed
    `[T, dim]` with `offsets` `[n+1]`. Masked tokens are left out of the shard. Ids are str or int (`7`
    is stored as `"7"`). `dtype` defaults to the input's (float64 is stored as float32); int8 needs
    `scales`. `format` defaults to the file suffix (`.arrow`, `.parquet`, else safetensors).
    `normalized=None` records whether all vectors have unit L2 norm. Documents with all-zero token rows
    (padding passed without its mask) are written as given, with a `MaxsimWarning`. Image-patch
    embeddings (ColPali) may record their patch grid, ``patch_grid=(rows, cols)`` (or ``"32x32"``) with
    ``patch_start`` the token of the first patch, for the heatmaps of `maxsim_cli.explain`.

        write_shard("docs.safetensors", ids, model.encode(texts, is_query=False))
        write_shard("pages.safetensors", ids, out, mask=batch["attention_mask"])
    """
    import torch

    path = os.fspath(path)
    if offsets is not None:
        first = as_tensor(embeddings, f"{path}: embeddings")
    elif isinstance(embeddings, (torch.Tensor, np.ndarray)) and embeddings.ndim != 3:
        raise InputError(
            f"{path}: embeddings of shape {tuple(embeddings.shape)}; pass a list of [tokens, dim] arrays "
            "(one per document), a padded [documents, tokens, dim] array with its mask, or packed "
            "[tokens, dim] rows with offsets="
        )
    else:
        if len(embeddings) == 0:
            raise InputError(f"{path}: no documents to write; a shard holds at least one")
        first = as_tensor(embeddings[0], f"{path}: document (index 0)")
    if first.ndim != 2:
        raise InputError(
            f"{path}: embeddings must be [num_tokens, dim] per document, padded [documents, tokens, dim] "
            f"with a mask, or packed [T, dim] with offsets; got shape {tuple(first.shape)}"
        )
    dim = int(first.shape[1])
    writer = ShardWriter(
        path,
        dim,
        dtype or infer_dtype(first),
        normalized=normalized,
        encoder=encoder,
        format=format,
        patch_grid=patch_grid,
        patch_start=patch_start,
    )
    writer.add(ids, embeddings, mask=mask, offsets=offsets, scales=scales)
    return writer._close(stacklevel=3)


def write_manifest(directory: str | os.PathLike[str], shard_paths: Sequence[str] | None = None) -> str:
    """Write `directory/index.json` (atomically) listing its shards with counts and sha256; return its path.

    `shard_paths` (names inside `directory`) fixes the order; default: every shard file, sorted by name.
    Beside each shard it writes the shard's id index (``<shard>.idindex``, `maxsim_cli.shards.id_index`),
    recorded with its sha256, and when the ids are unique across the shards it records that too
    (``unique_ids``): the write commands (`maxsim add`, `delete`) then find ids through the indexes
    without opening the corpus, and readers do not sort every id to check them unique. Duplicate ids are
    not an error here: the manifest then records nothing, and opening the corpus names them.
    """
    from maxsim_cli.shards.generations import unique_ids_digest
    from maxsim_cli.shards.id_index import (
        ID_INDEX_SUFFIX,
        IndexedShard,
        build_index,
        check_unique,
        write_index,
    )

    directory = os.fspath(directory)
    files = (
        list_shard_files(directory)
        if shard_paths is None
        else [os.path.join(directory, os.path.basename(p)) for p in shard_paths]
    )
    if not files:
        raise input_error(directory, "no shards to list in a manifest")
    entries = []
    indexed = []
    for f in files:
        with open_shard(f) as shard:
            index = build_index(shard.id_array)
            name = os.path.basename(f) + ID_INDEX_SUFFIX
            entries.append(
                {
                    "path": os.path.basename(f),
                    "num_docs": shard.num_docs,
                    "num_tokens": shard.num_tokens,
                    "sha256": file_sha256(f),
                    "ids": {"path": name, "sha256": write_index(os.path.join(directory, name), index)},
                }
            )
            indexed.append(IndexedShard(f, shard.num_docs, index))
    doc: dict[str, Any] = {
        "format": CORPUS_FORMAT_NAME,
        "format_version": CORPUS_FORMAT_VERSION,
        "shards": entries,
    }
    try:
        check_unique(indexed)
    except InputError:
        pass  # recorded as not known unique: opening the corpus names the duplicate
    else:
        doc["unique_ids"] = unique_ids_digest([(e["ids"]["sha256"], None) for e in entries])
    target = os.path.join(directory, MANIFEST_NAME)
    write_text_atomic(target, json.dumps(doc, indent=1) + "\n")
    return target


def _whole(value: str | None) -> int | None:
    return int(value) if value is not None else None
