"""Shard readers: `open_shard` sniffs the container (safetensors, Arrow IPC file or stream, Parquet)
and returns a `Shard` whose structure (metadata, ids, offsets, counts) is checked on open in O(N),
never touching the T x dim values; `read_docs` reads only the rows asked for and checks them for
NaN/Inf. `read_queries` reads a whole query file (or an Arrow IPC stream on stdin).

The readers themselves live in `shard` (the `Shard` base class), `safetensors_shard` and `arrow_shards`
(Arrow IPC and Parquet); their names are importable from here too.
"""

from __future__ import annotations

import os
import sys

from maxsim_cli.shards.arrow_shards import ArrowShard, ParquetShard, open_arrow, read_stream
from maxsim_cli.shards.format import SHARD_SUFFIXES, DocBatch, input_error
from maxsim_cli.shards.safetensors_shard import SafetensorsShard
from maxsim_cli.shards.shard import FileIdentity, Shard, check_unchanged, pread_into


def shard_kind(path: str) -> str:
    """A shard file's format from its first bytes: "arrow", "parquet" or "safetensors"."""
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
    kind = shard_kind(path)
    if kind == "safetensors" and os.path.splitext(path)[1].lower() != ".safetensors":
        with open(path, "rb") as f:
            head = f.read(9)
        if len(head) < 9 or head[8:9] != b"{":
            raise input_error(
                path, "not a shard: expected a safetensors, Arrow IPC or Parquet file (see docs/format.md)"
            )
    if kind == "arrow":
        return open_arrow(path)
    if kind == "parquet":
        return ParquetShard(path)
    return SafetensorsShard(path)


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


__all__ = [
    "ArrowShard",
    "FileIdentity",
    "ParquetShard",
    "SafetensorsShard",
    "Shard",
    "check_unchanged",
    "open_shard",
    "pread_into",
    "read_queries",
    "read_stream",
]
