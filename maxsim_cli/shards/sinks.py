"""The containers' writers under `ShardWriter`: `SafetensorsSink` (values written as they come after a
reserved header, the header at close) and `RecordSink` (Arrow IPC file or Parquet, record batches
spilled to a temp stream, then copied into the final file); `arrow_schema`, the format's Arrow schema.
Both write to a temp file next to the target and move it into place only when finished.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from maxsim_cli.arrays import strings_array, values_array
from maxsim_cli.codecs import has_scales
from maxsim_cli.errors import MaxsimError
from maxsim_cli.shards.files import atomic_temp, remove_quietly
from maxsim_cli.shards.format import ARROW_VALUE_TYPES, SAFETENSORS_DTYPES

if TYPE_CHECKING:
    import torch


class SafetensorsSink:
    """Writes embeddings as they come after a reserved header; the rest and the header at close."""

    def __init__(self, path: str, dim: int, dtype: str, meta_keys: dict[str, str]) -> None:
        self.path, self.dim, self.dtype, self.meta_keys = path, dim, dtype, meta_keys
        # Reserve room for the longest header the counts could need (20-digit numbers); padded with spaces.
        big = 10**19
        self.reserved = len(self._header(big, big, big)) + 64
        self.reserved += -self.reserved % 8
        self.tmp: str | None = None
        try:  # a signal in here (before the caller holds this sink to abort) removes the temp file
            fd, self.tmp = atomic_temp(path, claim=functools.partial(setattr, self, "tmp"))
            self.file = os.fdopen(fd, "wb")
            self.file.seek(8 + self.reserved)
        except BaseException:
            remove_quietly(self.tmp)
            raise
        self.scales: list[torch.Tensor] = []

    def _header(self, num_docs: int, num_tokens: int, id_bytes: int) -> bytes:
        item = {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1, "uint8": 1}[self.dtype]
        layout = [
            (
                "embeddings",
                SAFETENSORS_DTYPES[self.dtype],
                [num_tokens, self.dim],
                num_tokens * self.dim * item,
            )
        ]
        if has_scales(self.meta_keys.get("quantization", "none")):
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
        import torch

        raw = values.view(torch.int16) if values.dtype == torch.bfloat16 else values
        self.file.write(memoryview(raw.numpy()).cast("B"))
        if scales is not None:
            self.scales.append(scales)

    def finish(self, ids: list[str], offsets: np.ndarray, meta_keys: dict[str, str]) -> None:
        import torch

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
        try:
            self.file.close()  # flushing what is buffered may fail again (a full disk): the error is known
        except OSError:
            pass
        remove_quietly(self.tmp)


def arrow_schema(
    dim: int,
    dtype: str,
    metadata: dict[str, str] | None = None,
    *,
    length_column: bool = False,
    scaled: bool | None = None,
) -> pa.Schema:
    """The format v1 Arrow schema: id utf8, embedding list<fixed_size_list<T, dim>> (``dim``: the values a
    token takes), scales for int8 (and, with ``scaled``, for int4 codes)."""
    fields = [
        pa.field("id", pa.string(), nullable=False),
        pa.field("embedding", pa.list_(pa.list_(ARROW_VALUE_TYPES[dtype], dim)), nullable=False),
    ]
    if dtype == "int8" if scaled is None else scaled:
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
    metadata: pa.Table | None = None,
) -> pa.RecordBatch:
    import torch

    raw = values.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else values.numpy()
    # arrays built from their buffers (`maxsim_cli.arrays`): pa.array would import pandas
    list_offsets = values_array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    vectors = pa.FixedSizeListArray.from_arrays(values_array(raw), dim)
    assert vectors.type.value_type == ARROW_VALUE_TYPES[dtype]
    columns = [strings_array(ids, large=False), pa.ListArray.from_arrays(list_offsets, vectors)]
    if scales is not None:
        scale_values = values_array(scales.numpy().astype(np.float32, copy=False))
        columns.append(pa.ListArray.from_arrays(list_offsets, scale_values))
    if "length" in schema.names:
        columns.append(values_array(lengths.astype(np.int32)))
    if metadata is not None:  # the metadata columns, one chunk each (dictionaries unified)
        combined = metadata.combine_chunks()
        columns += [
            column.chunk(0) if column.num_chunks else pa.array([], column.type) for column in combined.columns
        ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


class RecordSink:
    """Arrow IPC file or Parquet. The counts belong in the schema metadata, which precedes the data, so
    record batches are spilled to a temp IPC stream first and copied (memory-mapped) into the final file
    at close: bounded memory, twice the disk writes. ``metadata``: the schema of metadata columns written
    after the shard's own (docs/format.md), whose rows each `add` gives."""

    # A record batch / row group is flushed once it holds this many bytes of embeddings or documents:
    # small enough to bound memory, large enough that per-batch overhead is noise.
    FLUSH_BYTES = 16 << 20
    FLUSH_DOCS = 8192

    def __init__(
        self,
        path: str,
        dim: int,
        dtype: str,
        fmt: str,
        scaled: bool | None = None,
        metadata: pa.Schema | None = None,
    ) -> None:
        self.path, self.dim, self.dtype, self.fmt = path, dim, dtype, fmt
        self.scaled = dtype == "int8" if scaled is None else scaled
        self.schema = arrow_schema(dim, dtype, length_column=fmt == "parquet", scaled=self.scaled)
        self.metadata = metadata if metadata is not None and len(metadata) else None
        for field in self.metadata or ():
            self.schema = self.schema.append(field)
        self.spill: str | None = None
        self.tmp: str | None = None
        try:  # a signal in here (before the caller holds this sink to abort) removes the spill file
            fd, self.spill = atomic_temp(path + ".spill", claim=functools.partial(setattr, self, "spill"))
            os.close(fd)
            self.writer = pa.ipc.new_stream(self.spill, self.schema)
        except BaseException:
            remove_quietly(self.spill)
            raise
        self.pending: list[tuple[list[str], torch.Tensor, np.ndarray, torch.Tensor | None]] = []
        self.pending_metadata: list[pa.Table] = []
        self.pending_bytes = 0
        self.pending_docs = 0

    def add(
        self,
        ids: list[str],
        values: torch.Tensor,
        lengths: np.ndarray,
        scales: torch.Tensor | None,
        metadata: pa.Table | None = None,
    ) -> None:
        self.pending.append((ids, values, lengths, scales))
        self.pending_bytes += values.numel() * values.element_size()
        if metadata is not None:
            self.pending_metadata.append(metadata)
            self.pending_bytes += metadata.nbytes
        self.pending_docs += len(ids)
        if self.pending_bytes >= self.FLUSH_BYTES or self.pending_docs >= self.FLUSH_DOCS:
            self._flush()

    def _flush(self) -> None:
        import torch

        if not self.pending:
            return
        ids = [i for p in self.pending for i in p[0]]
        values = torch.cat([p[1] for p in self.pending])
        lengths = np.concatenate([p[2] for p in self.pending])
        scales = torch.cat([p[3] for p in self.pending]) if self.scaled else None  # type: ignore[misc]
        metadata = pa.concat_tables(self.pending_metadata) if self.metadata is not None else None
        self.writer.write_batch(
            _record_batch(self.schema, self.dim, self.dtype, ids, values, lengths, scales, metadata)
        )
        self.pending, self.pending_metadata, self.pending_bytes, self.pending_docs = [], [], 0, 0

    def finish(self, ids: list[str], offsets: np.ndarray, meta_keys: dict[str, str]) -> None:
        self._flush()
        self.writer.close()
        final_schema = self.schema.with_metadata(
            {**meta_keys, "num_docs": str(len(ids)), "num_tokens": str(int(offsets[-1]))}
        )
        fd, self.tmp = atomic_temp(self.path, claim=functools.partial(setattr, self, "tmp"))
        os.close(fd)
        assert self.spill is not None
        with pa.OSFile(self.spill, "rb") as source:  # plain reads: a memory map would count in RSS
            reader = pa.ipc.open_stream(source)
            if self.fmt == "parquet":
                with pq.ParquetWriter(self.tmp, final_schema, compression="none") as out:
                    for batch in reader:
                        out.write_batch(batch)
            else:
                # an IPC file holds one dictionary a column (growing by deltas): `_one_dictionary`
                options = pa.ipc.IpcWriteOptions(emit_dictionary_deltas=True)
                with pa.ipc.new_file(self.tmp, final_schema, options=options) as out:
                    for batch in _one_dictionary(reader):
                        out.write_batch(batch)
        os.replace(self.tmp, self.path)
        self.tmp = None
        remove_quietly(self.spill)

    def abort(self) -> None:
        try:
            self.writer.close()
        except pa.ArrowException:
            pass
        remove_quietly(self.spill)
        remove_quietly(self.tmp)


def _one_dictionary(batches: Any) -> Any:
    """``batches`` with each dictionary column's dictionary grown from batch to batch (the values of the
    earlier batches first, the new ones after: what an IPC file's dictionary deltas can say), where the
    record batches of a stream may each bring a dictionary of their own."""
    dictionaries: dict[int, pa.Array] = {}
    for batch in batches:
        for i, field in enumerate(batch.schema):
            if not pa.types.is_dictionary(field.type):
                continue
            column = batch.column(i)
            known = dictionaries.get(i)
            if known is not None and not column.dictionary.equals(known):
                # unified after the known dictionary, whose values keep their indices
                before = pa.DictionaryArray.from_arrays(pa.array([], field.type.index_type), known)
                column = pa.chunked_array([before, column]).unify_dictionaries().chunk(1)
                batch = batch.set_column(i, field, column)
            dictionaries[i] = column.dictionary
        yield batch
