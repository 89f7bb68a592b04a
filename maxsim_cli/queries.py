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

import numpy as np

from maxsim_cli.errors import InputError

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
        import torch

        from maxsim_cli.shards.format import DocBatch, _check_ids, _check_values
        from maxsim_cli.shards.writers import _as_tensor, _mask_rows

        qids = _as_ids(ids, name)

        def query(i: int) -> str:  # the i-th query, as messages name it
            return f"query {qids[i]!r} (index {i})" if i < len(qids) else f"query at index {i}"

        if isinstance(embeddings, (torch.Tensor, np.ndarray)) and embeddings.ndim == 3:
            padded = _as_tensor(embeddings, f"{name}: embeddings")
            if padded.shape[0] != len(qids):
                raise InputError(f"{name}: {len(qids)} ids but {padded.shape[0]} padded queries")
            if mask is None:
                keep = torch.ones(padded.shape[:2], dtype=torch.bool)
            else:
                keep = _mask_rows(mask, f"{name}: mask")
                if tuple(keep.shape) != tuple(padded.shape[:2]):
                    raise InputError(
                        f"{name}: mask has shape {tuple(keep.shape)}; expected {tuple(padded.shape[:2])} "
                        "([queries, tokens]) for embeddings of shape " + str(tuple(padded.shape))
                    )
            lengths = keep.sum(dim=1).to(torch.int64)
            _check_lengths(qids, lengths.tolist(), name)
            packed = padded[keep]
        elif isinstance(embeddings, (torch.Tensor, np.ndarray)):
            raise InputError(
                f"{name}: embeddings of shape {tuple(embeddings.shape)}; pass a list of [tokens, dim] "
                "arrays, one per query, or a padded [queries, tokens, dim] array with a mask"
            )
        else:
            docs = [_as_tensor(e, f"{name}: {query(i)}") for i, e in enumerate(embeddings)]
            if len(docs) != len(qids):
                raise InputError(f"{name}: {len(qids)} ids but {len(docs)} embedding arrays")
            for i, d in enumerate(docs):
                if d.ndim != 2:
                    raise InputError(f"{name}: {query(i)} has shape {tuple(d.shape)}; expected [tokens, dim]")
            if mask is not None:
                masks = [
                    _mask_rows(m, f"{name}: the mask of {query(i)}").reshape(-1) for i, m in enumerate(mask)
                ]
                if len(masks) != len(docs):
                    raise InputError(f"{name}: {len(masks)} masks for {len(docs)} queries")
                for i, (d, m) in enumerate(zip(docs, masks, strict=True)):
                    if m.shape[0] != d.shape[0]:
                        raise InputError(
                            f"{name}: the mask of query {qids[i]!r} (index {i}) has {m.shape[0]} entries "
                            f"for {d.shape[0]} tokens"
                        )
                docs = [d[m] for d, m in zip(docs, masks, strict=True)]
            _check_lengths(qids, [d.shape[0] for d in docs], name)
            dims = {d.shape[1] for d in docs}
            if len(dims) > 1:
                i = next(i for i, d in enumerate(docs) if d.shape[1] != docs[0].shape[1])
                raise InputError(
                    f"{name}: query {qids[i]!r} (index {i}) has vectors of {docs[i].shape[1]} values but "
                    f"query {qids[0]!r} has {docs[0].shape[1]}; encode all queries with one model"
                )
            lengths = torch.tensor([d.shape[0] for d in docs], dtype=torch.int64)
            packed = torch.cat([d.to(docs[0].dtype) for d in docs]) if docs else torch.zeros(0, 0)
        if packed.dtype == torch.int8:
            raise InputError(f"{name}: int8 query embeddings carry no scales; pass the float embeddings")
        if packed.dtype == torch.float64 or not packed.is_floating_point():
            packed = packed.to(torch.float32)
        packed = packed.contiguous()
        offsets = torch.zeros(len(qids) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        _check_ids(name, qids, what="query id")
        _check_values(name, packed, None, offsets.numpy(), qids, 0, what="query")
        return cls(DocBatch(qids, packed, offsets, None), name)


def _as_ids(ids: Sequence[str | int], name: str) -> list[str]:
    out = []
    for i, qid in enumerate(ids):
        if isinstance(qid, (bool, np.bool_)) or not isinstance(qid, (str, int, np.integer)):
            raise InputError(f"{name}: query id at index {i} is {type(qid).__name__}; ids must be str or int")
        out.append(str(qid) if not isinstance(qid, str) else qid)
    return out


def _check_lengths(qids: list[str], lengths: Sequence[int], name: str) -> None:
    for i, n in enumerate(lengths):
        if n < 1:
            raise InputError(
                f"{name}: query {qids[i]!r} (index {i}) has no tokens (after its mask); every query needs "
                "at least one"
            )


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
