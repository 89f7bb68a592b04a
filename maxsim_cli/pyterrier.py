"""PyTerrier transformers over a maxsim `Corpus` (the optional ``pyterrier`` extra).

- `MaxSimReranker` re-scores a result frame (``qid``, ``docno``): the first-stage candidates of each query
  scored by exact MaxSim against the corpus, re-ranked; the other columns are carried through.
- `MaxSimRetriever` scores the whole corpus for a query frame (``qid``): the exact top ``k`` per query.

Query embeddings come from a ``query_embs`` column (as pyterrier-colbert names it: per row a
``[tokens, dim]`` tensor or array, the same for every row of a query) or, with ``queries=``, from a query
shard or a `Queries` looked up by qid. Scores are the float32 values of ``maxsim score`` for the same
inputs, rows are ordered per query as trec_eval orders them (score descending, ties by docno
descending) and ``rank`` counts from 0, as PyTerrier's do. Empty frames give empty frames with the same
columns. Nothing here starts Java.

    >>> import pandas as pd
    >>> from maxsim_cli.pyterrier import MaxSimRetriever
    >>> retriever = MaxSimRetriever("sample_data/corpus", queries="sample_data/queries.safetensors", k=3,
    ...                             device="cpu")
    >>> retriever(pd.DataFrame({"qid": ["q001"], "query": ["GNU profiler"]}))[["qid", "rank"]].values.tolist()
    [['q001', 0], ['q001', 1], ['q001', 2]]
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Sequence
from typing import Any

try:
    import pandas as pd
    import pyterrier as pt
except ImportError:
    raise ImportError(
        "maxsim_cli.pyterrier needs PyTerrier and pandas; install them with: pip install 'maxsim[pyterrier]'"
    ) from None

from maxsim_cli.api import MaxsimWarning, open_corpus, rerank, search
from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.queries import Queries, read_queries
from maxsim_cli.shards import Corpus

__all__ = ["MaxSimReranker", "MaxSimRetriever"]

QUERY_EMBS = "query_embs"  # pyterrier-colbert's column name


class _MaxSimTransformer(pt.Transformer):
    """What both transformers share: the corpus, where query embeddings come from, scoring options."""

    def __init__(
        self,
        corpus: Corpus | str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        queries: Queries | str | os.PathLike[str] | None,
        *,
        device: str,
        backend: str,
        max_memory: int | str | None,
        max_host_memory: int | str | None,
    ) -> None:
        if isinstance(corpus, Corpus):
            self.corpus = corpus
        elif isinstance(corpus, (str, os.PathLike, list, tuple)):
            self.corpus = open_corpus(corpus)  # opened once here, not at every transform
        else:
            raise UsageError(
                f"corpus: got {type(corpus).__name__}; pass a Corpus (open_corpus) or shard file/folder "
                "path(s)"
            )
        if queries is None or isinstance(queries, Queries):
            self.queries = queries
        elif isinstance(queries, (str, os.PathLike)):
            self.queries = read_queries(queries)
        else:
            raise UsageError(
                f"queries: got {type(queries).__name__}; pass a query shard path, a Queries, or None to "
                f"read the {QUERY_EMBS} column"
            )
        self.device = device
        self.backend = backend
        self.max_memory = max_memory
        self.max_host_memory = max_host_memory

    def _options(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "backend": self.backend,
            "max_memory": self.max_memory,
            "max_host_memory": self.max_host_memory,
        }

    def _queries_for(self, inp: pd.DataFrame, qids: list[str], keys: list[str]) -> Queries:
        """The embeddings of ``qids`` (the frame's queries, in order): from ``queries=`` or the column."""
        if self.queries is not None:
            return _select_queries(self.queries, qids)
        return _queries_from_column(inp[QUERY_EMBS], keys)

    def _required(self) -> list[str]:
        return [] if self.queries is not None else [QUERY_EMBS]

    def close(self) -> None:
        """Close the corpus (also one passed in as a `Corpus`)."""
        self.corpus.close()

    def __repr__(self) -> str:
        queries = "query_embs column" if self.queries is None else self.queries.name
        return f"{type(self).__name__}({self.corpus!r}, queries={queries!r}, k={self.k!r})"


class MaxSimReranker(_MaxSimTransformer):
    """Re-scores each query's candidates (a result frame: ``qid``, ``docno``) by exact MaxSim.

    The output holds the input's rows and columns, with ``score`` set to the MaxSim score and ``rank``
    (from 0) to its place, rows sorted per query by score descending, ties by docno descending (the order
    of ``maxsim score --candidates`` and trec_eval), queries in the order they first appear. ``k`` keeps the
    best ``k`` per query (None: all).

    A docno that the corpus lacks raises `InputError` naming it, since a reranker is expected to return
    every row it was given; ``strict=False`` drops those rows with a `MaxsimWarning` instead. A frame with
    the same docno twice for a query is refused. Query embeddings: see the module's docstring.

    >>> import pyterrier as pt
    >>> from maxsim_cli.pyterrier import MaxSimReranker
    >>> bm25 = pt.io.read_results("sample_data/candidates.trec")
    >>> reranker = MaxSimReranker("sample_data/corpus", queries="sample_data/queries.safetensors",
    ...                           device="cpu")
    >>> reranked = reranker(bm25[bm25.qid == "q001"])
    >>> reranked[["qid", "docno", "rank"]].head(2).values.tolist()
    [['q001', 'libgprofng0', 0], ['q001', 'libgav1-1', 1]]
    """

    def __init__(
        self,
        corpus: Corpus | str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        queries: Queries | str | os.PathLike[str] | None = None,
        *,
        k: int | None = None,
        strict: bool = True,
        device: str = "auto",
        backend: str = "auto",
        max_memory: int | str | None = None,
        max_host_memory: int | str | None = None,
    ) -> None:
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise UsageError(
                f"k={k!r}: must be a whole number of at least 1, or None to keep every candidate"
            )
        super().__init__(
            corpus,
            queries,
            device=device,
            backend=backend,
            max_memory=max_memory,
            max_host_memory=max_host_memory,
        )
        self.k = k
        self.strict = strict

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        pt.validate.result_frame(inp, extra_columns=self._required(), context=self)
        columns = [*inp.columns, *(c for c in ("score", "rank") if c not in inp.columns)]
        if len(inp) == 0:
            return _rows(inp, [], columns, score=[], rank=[])
        keys = [str(q) for q in inp["qid"]]
        docnos = [str(d) for d in inp["docno"]]
        keep = self._known(keys, docnos)
        qids = list(dict.fromkeys(keys[i] for i in keep))
        if not qids:  # every row dropped (strict=False)
            return _rows(inp, [], columns, score=[], rank=[])
        queries = self._queries_for(inp.iloc[keep], qids, [keys[i] for i in keep])
        candidates = pd.DataFrame({"qid": [keys[i] for i in keep], "docno": [docnos[i] for i in keep]})
        run = rerank(
            queries, self.corpus, candidates, k=self.k, strict=True, **self._options()
        ).to_dataframe()
        where = {(keys[i], docnos[i]): i for i in keep}
        positions = [where[key] for key in zip(run["qid"], run["docno"], strict=True)]
        return _rows(inp, positions, columns, score=run["score"], rank=run["rank"] + pt.model.FIRST_RANK)

    def _known(self, keys: list[str], docnos: list[str]) -> list[int]:
        """The rows whose docno the corpus has; the others are an error, or dropped with a warning."""
        found = self.corpus.candidate_index(docnos)
        keep = [i for i, docno in enumerate(docnos) if docno in found]
        if len(keep) == len(docnos):
            return keep
        first = next(i for i, docno in enumerate(docnos) if docno not in found)
        missing = len(docnos) - len(keep)
        what = (
            f"{missing:,} of the frame's {len(docnos):,} rows have a docno that is not in the corpus "
            f"({self.corpus.name}), e.g. {docnos[first]!r} of query {keys[first]!r}"
        )
        if self.strict:
            raise InputError(
                f"MaxSimReranker: {what}; check that the first stage and the corpus match, or pass "
                "strict=False to drop those rows"
            )
        warnings.warn(f"MaxSimReranker: {what}; they are left out", MaxsimWarning, stacklevel=3)
        return keep

    def fuse_rank_cutoff(self, k: int) -> MaxSimReranker:
        """``reranker % k``: the same reranker keeping the best ``k`` (never more than it keeps now)."""
        if self.k is not None and self.k <= k:
            return self
        fused = copy.copy(self)
        fused.k = k
        return fused


class MaxSimRetriever(_MaxSimTransformer):
    """Scores the whole corpus for each query of a query frame (``qid``; ``query`` and any other columns
    are carried to every result row): the exact top ``k`` (default 1000, as PyTerrier's retrievers),
    as a result frame ``qid, docno, rank, score, ...`` ranked from 0, queries in the frame's order, rows
    in ``maxsim score``'s order (score descending, ties by docno descending). ``batch_queries`` caps the
    queries scored in one pass. Query embeddings: see the module's docstring.

    >>> import pandas as pd
    >>> from maxsim_cli.pyterrier import MaxSimRetriever
    >>> retriever = MaxSimRetriever("sample_data/corpus", queries="sample_data/queries.safetensors",
    ...                             k=10, device="cpu")
    >>> retriever(pd.DataFrame({"qid": ["q001", "q002"]})).groupby("qid").size().tolist()
    [10, 10]
    """

    def __init__(
        self,
        corpus: Corpus | str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        queries: Queries | str | os.PathLike[str] | None = None,
        *,
        k: int = 1000,
        device: str = "auto",
        backend: str = "auto",
        max_memory: int | str | None = None,
        max_host_memory: int | str | None = None,
        batch_queries: int | None = None,
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UsageError(f"k={k!r}: must be a whole number of at least 1")
        super().__init__(
            corpus,
            queries,
            device=device,
            backend=backend,
            max_memory=max_memory,
            max_host_memory=max_host_memory,
        )
        self.k = k
        self.batch_queries = batch_queries

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        pt.validate.query_frame(inp, extra_columns=self._required(), context=self)
        columns = ["qid", "docno", "rank", "score", *(c for c in inp.columns if c != "qid")]
        if len(inp) == 0:
            return _rows(inp, [], columns, docno=[], score=[], rank=[])
        keys = [str(q) for q in inp["qid"]]
        where: dict[str, int] = {}
        for i, qid in enumerate(keys):
            if where.setdefault(qid, i) != i:
                raise InputError(
                    f"MaxSimRetriever: query {qid!r} appears in rows {where[qid]} and {i} of the frame; a "
                    "query frame lists each qid once"
                )
        queries = self._queries_for(inp, keys, keys)
        run = search(
            queries, self.corpus, k=self.k, batch_queries=self.batch_queries, **self._options()
        ).to_dataframe()
        positions = [where[qid] for qid in run["qid"]]
        return _rows(
            inp,
            positions,
            columns,
            docno=run["docno"],
            score=run["score"],
            rank=run["rank"] + pt.model.FIRST_RANK,
        )

    def fuse_rank_cutoff(self, k: int) -> MaxSimRetriever:
        """``retriever % k``: the same retriever with ``k`` lowered to ``k`` (never raised)."""
        if self.k <= k:
            return self
        fused = copy.copy(self)
        fused.k = k
        return fused


# --------------------------------------------------------------------------------------------------
# frames and query embeddings


def _rows(inp: pd.DataFrame, positions: list[int], columns: list[str], **values: Any) -> pd.DataFrame:
    """The input rows at ``positions`` (repeated as needed, dtypes kept) with ``values`` set as columns."""
    out = inp.iloc[positions].reset_index(drop=True)
    dtypes = {"docno": object, "rank": "int64", "score": "float64"}
    for name, column in values.items():
        out[name] = pd.Series(list(column) if len(out) == 0 else column, dtype=dtypes[name]).to_numpy()
    return out[columns]


def _queries_from_column(column: pd.Series, keys: list[str]) -> Queries:
    """One query per distinct qid (in order of first appearance) from the ``query_embs`` column; every row
    of a qid must carry the same embeddings."""
    import numpy as np
    import torch

    first: dict[str, Any] = {}
    for row, (qid, embs) in enumerate(zip(keys, column, strict=True)):
        if not isinstance(embs, (torch.Tensor, np.ndarray)):
            raise InputError(
                f"{QUERY_EMBS}: row {row} (query {qid!r}) holds {type(embs).__name__}; expected a "
                "[tokens, dim] tensor or array of the query's token embeddings"
            )
        seen = first.setdefault(qid, embs)
        if seen is not embs and not _same_values(seen, embs):
            raise InputError(
                f"{QUERY_EMBS}: query {qid!r} has different embeddings in different rows (row {row}); a "
                "query's rows must all carry the same query_embs"
            )
    return Queries.from_embeddings(list(first), list(first.values()), name=QUERY_EMBS)


def _same_values(a: Any, b: Any) -> bool:
    import torch

    a = a.detach().cpu() if isinstance(a, torch.Tensor) else torch.as_tensor(a)
    b = b.detach().cpu() if isinstance(b, torch.Tensor) else torch.as_tensor(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _select_queries(queries: Queries, qids: list[str]) -> Queries:
    """``queries`` cut down to ``qids``, in that order (int8 scales kept); a missing qid is an error."""
    import torch

    from maxsim_cli.shards.format import DocBatch

    index = {qid: i for i, qid in enumerate(queries.ids)}
    missing = [qid for qid in qids if qid not in index]
    if missing:
        raise InputError(
            f"{queries.name}: has no query {missing[0]!r} ({len(missing):,} of the frame's {len(qids):,} "
            f"queries are missing); use the query file that matches the topics, or a {QUERY_EMBS} column"
        )
    offsets = queries.offsets
    rows = [torch.arange(int(offsets[index[q]]), int(offsets[index[q] + 1])) for q in qids]
    take = torch.cat(rows)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    new_offsets = torch.zeros(len(qids) + 1, dtype=torch.int64)
    new_offsets[1:] = torch.cumsum(lengths, 0)
    scales = None if queries.scales is None else queries.scales[take]
    return Queries(DocBatch(list(qids), queries.embeddings[take], new_offsets, scales), queries.name)
