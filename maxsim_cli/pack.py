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

`maxsim_cli.pack_sources` reads the sources; this module checks the options and the output folder, and
packs the documents into shards.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from maxsim_cli.errors import InputError, MaxsimWarning, UsageError
from maxsim_cli.lifeline import commit_point
from maxsim_cli.pack_sources import SourceBatch, SourcePart, count_docs, source_batches, source_parts
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
from maxsim_cli.shards.id_index import ID_INDEX_SUFFIX, index_names
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


def _normalize(batch: SourceBatch) -> torch.Tensor:
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


def _check_ids(batch: SourceBatch) -> None:
    """Ids are TREC fields: non-empty, no whitespace, control or zero-width character (`id_problem`)."""
    for k, doc_id in enumerate(batch.ids):
        problem = id_problem(doc_id)
        if problem is not None:
            raise InputError(f"{batch.where[k]}: id {doc_id!r} {problem}; {ID_RULE}")


def _cast_checked(batch: SourceBatch, values: torch.Tensor, dtype: str) -> torch.Tensor:
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
    """The files of OUTDIR a corpus reader reads: shards, their id indexes and the manifest (the manifest
    first)."""
    names = [
        n
        for n in sorted(os.listdir(outdir))
        if n == MANIFEST_NAME
        or n.endswith(ID_INDEX_SUFFIX)
        or os.path.splitext(n)[1].lower() in SHARD_SUFFIXES
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
    parts = [part for src in sources for part in source_parts(src)]
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
        [SourcePart("dataset", "dataset", dataset)],
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
    parts: list[SourcePart],
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
    total_docs = sum(count_docs(part) for part in parts)
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
            swap_corpus_files(workdir, outdir, [*names, *index_names(names), MANIFEST_NAME], old_names)
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


def _raise_duplicate(
    where: str, doc_id: str, ordinal: int, part_starts: list[tuple[int, SourcePart]]
) -> None:
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


def _count_zero_rows(
    result: PackResult, batch: SourceBatch, values: torch.Tensor, offsets: np.ndarray
) -> None:
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
    parts: Sequence[SourcePart],
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
    part_starts: list[tuple[int, SourcePart]] = []  # (first ordinal, part)
    writer: ShardWriter | None = None
    all_normalized = True
    docs_done = 0
    try:
        for part in parts:
            part_starts.append((docs_done, part))
            for batch in source_batches(part, id_column, embedding_column, mask_column, BATCH_BYTES):
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
