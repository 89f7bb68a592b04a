"""`Shard`, what every shard reader is: ids, offsets and `ShardInfo` in memory (checked on open in O(N)),
token rows read on demand (`read_docs`, `read_doc_indices`, `iter_batches`) and checked for NaN/Inf; and
reading a file's bytes safely while another process may change it (`check_unchanged`, `pread_into`).

The containers' readers subclass `Shard`: `safetensors_shard` and `arrow_shards`; `readers` opens a file
with the right one. Opening a shard and reading its ids and offsets needs no torch (numpy and pyarrow);
torch is imported when token rows are first read, as the tensors of a `DocBatch`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from maxsim_cli.arrays import strings_array
from maxsim_cli.codecs import check_code_rows
from maxsim_cli.shards.format import DocBatch, ShardInfo, check_values, input_error, one_line, torch_dtypes

if TYPE_CHECKING:
    import torch


def shard_info(
    path: str, fmt: str, num_docs: int, num_tokens: int, dim: int, dtype: str, meta: dict[str, Any]
) -> ShardInfo:
    """What a shard holds, once its structure has been checked against its metadata."""
    return ShardInfo(
        path, fmt, num_docs, num_tokens, dim, dtype, meta["quantization"], meta["normalized"],
        meta["encoder"], meta["patch_grid"], meta["patch_start"], meta["codebook"], meta["codebook_sha256"],
        meta["num_centroids"], meta["source"], meta.get("source_generation"),
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

    def metadata_schema(self) -> pa.Schema | None:
        """The schema of the shard's metadata columns (every column beside the ones a shard is made of:
        what a ``where`` filter reads, `maxsim_cli.scoring.where`); None for a container that has no
        columns (safetensors, a corpus made in memory)."""
        return None

    def metadata_tables(self, columns: Sequence[str]) -> Iterator[tuple[int, pa.Table]]:
        """The metadata ``columns`` (names of `metadata_schema`), a piece of the shard at a time: (the
        index of the piece's first document, a table of those columns), every value validated; the
        token vectors are not read."""
        raise NotImplementedError(f"{type(self).__name__} has no metadata columns")

    def _empty_batch(self, first_doc: int = 0) -> DocBatch:
        import torch

        dtype = torch_dtypes()[self.info.dtype]
        scales = torch.empty(0, dtype=torch.float32) if self.info.scaled else None
        return DocBatch(
            [],
            torch.empty(0, self.info.width, dtype=dtype),
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
        if self.info.num_centroids:
            check_code_rows(
                self.path, self.info.quantization, embeddings, self.info.num_centroids, local, ids
            )
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


# What identifies the file a shard was opened from: (device, inode, size, modification time in ns).
FileIdentity = tuple[int, int, int, int]


def file_identity(st: os.stat_result) -> FileIdentity:
    """What identifies the file `st` describes (`FileIdentity`)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_unchanged(path: str, identity: FileIdentity, st: os.stat_result) -> None:
    """`InputError` when the file ``st`` describes is not the one opened: replaced, resized or written."""
    now = file_identity(st)
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


def pread_pieces(path: str, fd: int, identity: FileIdentity, out: Any, offsets: Any, sizes: Any) -> None:
    """Fill the tensor or array ``out`` with the file's byte ranges ``offsets[i] : offsets[i] + sizes[i]``
    one after another (`os.preadv` each, into views of one buffer): `pread_into` for many pieces, such as
    the rows of a rerank's candidates, at a Python call a piece. The file is checked once, after the
    reads; a read that ends early or a file that changed is the same `InputError` as there."""
    array = out.view(_uint8()).numpy() if hasattr(out, "numpy") else out.view(np.uint8)
    view = memoryview(array.reshape(-1)).cast("B")
    sizes = np.asarray(sizes, dtype=np.int64)
    if int(sizes.sum()) > len(view):
        raise ValueError(f"pread_pieces: {int(sizes.sum())} bytes do not fit a buffer of {len(view)}")
    done = 0
    for offset, size in zip(np.asarray(offsets).tolist(), sizes.tolist(), strict=True):
        start = done
        while done < start + size:
            at = offset + done - start  # the file's byte the read goes on from
            try:
                got = os.preadv(fd, [view[done : start + size]], at)
            except OSError as exc:
                raise input_error(path, f"cannot read: {one_line(exc)}") from None
            if got <= 0:
                check_unchanged(path, identity, os.fstat(fd))
                raise input_error(path, f"truncated: the file ends at byte {at}; re-copy or rewrite it")
            done += got
    check_unchanged(path, identity, os.fstat(fd))


def _uint8() -> Any:
    import torch

    return torch.uint8
