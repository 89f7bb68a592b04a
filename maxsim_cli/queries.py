"""`Queries`: query embeddings in memory, packed, checked by the rules a query shard follows.

Queries come from a query shard (``read_queries``: a file, a folder of query shards, or ``-`` for an
Arrow IPC stream on stdin) or straight from an encoder (`Queries.from_embeddings`): a list of
``[len, dim]`` arrays or tensors (PyLate, stanford ColBERT) or a padded ``[n, L, dim]`` tensor with an
``[n, L]`` mask (colpali-engine). Either way they are held packed, never padded: query i is rows
``offsets[i]:offsets[i + 1]`` of ``embeddings``. Ids become strings (an int id 7 is the qid ``"7"``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from maxsim_cli.shards import DocBatch

# What error messages call queries that came from memory rather than a file.
IN_MEMORY_NAME = "queries"


class Queries:
    """Packed query embeddings: ``ids`` (str), ``embeddings`` ``[T, dim]`` (CPU tensor), ``offsets``
    int64 ``[n + 1]``, and for int8 query shards per-token ``scales``.

    >>> import numpy as np
    >>> q = Queries.from_embeddings(["q1", 2], [np.ones((3, 4), np.float32), np.ones((1, 4), np.float32)])
    >>> len(q), q.ids, q.dim, q.offsets.tolist()
    (2, ['q1', '2'], 4, [0, 3, 4])
    """

    def __init__(self, batch: DocBatch, name: str = IN_MEMORY_NAME, path: str | None = None) -> None:
        self.batch = batch
        self.name = name  # the file they came from, for messages
        self.path = path  # that file (None for queries from memory or stdin)

    @property
    def ids(self) -> list[str]:
        return list(self.batch.ids)

    @property
    def embeddings(self) -> torch.Tensor:
        return self.batch.embeddings

    @property
    def offsets(self) -> torch.Tensor:
        return self.batch.offsets

    @property
    def scales(self) -> torch.Tensor | None:
        return self.batch.scales

    @property
    def dim(self) -> int:
        return int(self.batch.embeddings.shape[1])

    @property
    def dtype(self) -> str:
        return str(self.batch.embeddings.dtype).removeprefix("torch.")

    def __len__(self) -> int:
        return self.batch.num_docs

    def __repr__(self) -> str:
        return (
            f"Queries({len(self):,} queries, {self.batch.num_tokens:,} tokens, dim {self.dim}, {self.dtype})"
        )

    @classmethod
    def from_embeddings(
        cls, ids: Sequence[str | int], embeddings: Any, mask: Any = None, *, name: str = IN_MEMORY_NAME
    ) -> Queries:
        """Queries from an encoder's output.

        ``embeddings``: a list of ``[len, dim]`` arrays/tensors, one per query, or a padded ``[n, L, dim]``
        array/tensor; ``mask`` (optional) ``[n, L]`` (or one ``[len]`` per listed query) marks the real
        tokens with True/1, and masked tokens are left out exactly. float64 becomes float32; float16,
        bfloat16 and float32 are kept. Ids must be unique, non-empty, without whitespace. Raises
        `InputError` naming the query for a bad shape, an empty query, a dim mismatch or NaN/Inf.
        """
        from maxsim_cli.shards.format import DocBatch
        from maxsim_cli.shards.memory import QUERY_WORDS, pack_embeddings

        packed = pack_embeddings(ids, embeddings, mask, name=name, words=QUERY_WORDS)
        return cls(DocBatch(packed.ids, packed.values, packed.offsets, None), name)


def as_query_ids(ids: Sequence[str | int], name: str) -> list[str]:
    """Query ids as strings (`maxsim_cli.shards.memory.as_ids`)."""
    from maxsim_cli.shards.memory import QUERY_WORDS, as_ids

    return as_ids(ids, name, QUERY_WORDS)


def check_query_lengths(qids: list[str], lengths: Sequence[int], name: str) -> None:
    """Every query holds at least one token (`maxsim_cli.shards.memory.check_lengths`)."""
    from maxsim_cli.shards.memory import QUERY_WORDS, check_lengths

    check_lengths(qids, lengths, name, QUERY_WORDS)


def read_queries(path: str | os.PathLike[str]) -> Queries:
    """Queries from a query shard file (safetensors, Arrow, Parquet), a folder of query shards (as
    ``maxsim pack`` writes them; ids unique across its shards), or ``"-"`` for an Arrow IPC stream on
    standard input."""
    from maxsim_cli.shards import open_corpus
    from maxsim_cli.shards import read_queries as read_query_file

    name = os.fspath(path)
    if name == "-":
        return Queries(read_query_file(name), "<stdin>")
    if not os.path.isdir(name):
        return Queries(read_query_file(name), name, name)
    import torch

    from maxsim_cli.shards.format import DocBatch

    with open_corpus([name]) as folder:
        parts = [shard.read_docs(0, shard.num_docs) for shard in folder.shards]
    ids = [qid for part in parts for qid in part.ids]
    embeddings = torch.cat([p.embeddings for p in parts])
    lengths = torch.cat([p.lengths() for p in parts])
    offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    scales = torch.cat([p.scales for p in parts]) if parts[0].scales is not None else None
    batch = DocBatch(ids, embeddings, offsets, scales, encoder=folder.encoder, normalized=folder.normalized)
    return Queries(batch, name, name)


def read_query_ids(path: str | os.PathLike[str]) -> list[str]:
    """The query ids of a query shard file or a folder of them, in order, without reading the embeddings."""
    from maxsim_cli.shards import open_corpus, open_shard

    name = os.fspath(path)
    if os.path.isdir(name):
        with open_corpus([name]) as folder:
            return [qid for shard in folder.shards for qid in shard.ids]
    with open_shard(name) as shard:
        return list(shard.ids)
