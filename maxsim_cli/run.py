"""`Run`: ranked results in memory, in trec_eval's order, as `search` and `rerank` return them.

A run holds, for each query in the order the queries were given, its documents best first: float32
score descending, ties broken by docno descending (trec_eval's own order, `maxsim_cli.run_files.sort_trec`).
Results are kept as the engine hands them over (Arrow string arrays and float32 blocks), so a run of
512 queries x 1000 documents costs no Python object per result until one is asked for; `Run.to_trec`
writes the same bytes as `maxsim score` for the same inputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from maxsim_cli.errors import OUTPUT, in_python_terms
from maxsim_cli.run_files import RankedSink, RunWriter, read_run

if TYPE_CHECKING:
    import pandas


class Result(NamedTuple):
    """One row of a run: ``rank`` counts from 1 in trec_eval's order."""

    qid: str
    docno: str
    rank: int
    score: float


@dataclass
class _Block:
    """Queries whose rows arrived together: query i holds rows ``offsets[i]:offsets[i + 1]`` of
    ``docnos`` (an Arrow large_string array) and ``scores`` (float32), best first."""

    qids: list[str]
    docnos: Any
    scores: np.ndarray
    offsets: np.ndarray

    def uniform(self) -> int | None:
        """Rows per query when every query has the same number, else None."""
        lengths = np.diff(self.offsets)
        return int(lengths[0]) if len(lengths) and bool((lengths == lengths[0]).all()) else None


class RunCollector(RankedSink):
    """A sink for the engine that keeps the ranked rows in memory (see `Run`)."""

    def __init__(self, name: str = "run") -> None:
        super().__init__(name)
        self.blocks: list[_Block] = []

    def __enter__(self) -> RunCollector:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def _take_query(self, qid: str, docnos: list[str], keys: np.ndarray) -> None:
        from maxsim_cli.arrays import strings_array

        offsets = np.array([0, len(docnos)], dtype=np.int64)
        self.blocks.append(_Block([qid], strings_array(docnos), keys, offsets))
        self.num_queries += 1
        self.num_rows += len(docnos)

    def _take_block(self, qids: Sequence[str], m: int, docnos, keys: np.ndarray) -> None:  # noqa: ANN001
        offsets = np.arange(len(qids) + 1, dtype=np.int64) * m
        self.blocks.append(_Block(list(qids), docnos, keys.reshape(-1).astype(np.float32), offsets))
        self.num_queries += len(qids)
        self.num_rows += len(qids) * m

    def run(self, stats: object = None, inputs: Sequence[str] = ()) -> Run:
        """The rows taken so far as a `Run`; ``inputs``: the files it was made from (`Run.to_trec`
        refuses to overwrite them)."""
        return Run._from_blocks(self.blocks, stats, inputs)


class Run:
    """Ranked results per query, in trec_eval's order (score descending, ties by docno descending).

    Iterating yields `Result` rows ``(qid, docno, rank, score)`` query after query, ranks from 1.
    ``run[qid]`` is that query's ``[(docno, score), ...]``; ``len(run)`` counts rows; ``run.qids`` lists
    the queries in order. ``stats`` is what the scoring run reported (a `ScoreStats`), or None.

    >>> run = Run({"q1": [("d1", 0.5), ("d2", 0.75)], "q2": [("d3", 0.25)]})
    >>> list(run)[0]
    Result(qid='q1', docno='d2', rank=1, score=0.75)
    >>> run.to_dict()["q1"][1]
    ('d1', 0.5)
    >>> len(run), run.qids
    (3, ['q1', 'q2'])
    """

    def __init__(self, results: Mapping[str, Sequence[tuple[str, float]]] | None = None) -> None:
        collector = RunCollector()
        for qid, rows in (results or {}).items():
            collector.write_query(str(qid), [str(d) for d, _ in rows], [float(s) for _, s in rows])
        self._blocks = collector.blocks
        self._index: dict[str, tuple[_Block, int]] | None = None
        self._inputs: tuple[str, ...] = ()
        self.stats: Any = None
        # set by `search` and `rerank`: (qid, docno, the run's score or None) -> an Explanation
        self._explainer: Callable[[str, str, float | None], Any] | None = None

    def set_explainer(self, explainer: Callable[[str, str, float | None], Any]) -> None:
        """What `explain` calls: (qid, docno, the run's score or None) -> an Explanation; `search` and
        `rerank` set it to score against the queries and corpus they were given."""
        self._explainer = explainer

    @classmethod
    def _from_blocks(cls, blocks: list[_Block], stats: object = None, inputs: Sequence[str] = ()) -> Run:
        run = cls.__new__(cls)
        run._blocks = blocks
        run._index = None
        run._inputs = tuple(inputs)
        run.stats = stats
        run._explainer = None
        return run

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Run:
        """Read a run file: TREC, MS MARCO or ColBERT TSV, optionally gzipped (`maxsim_cli.run_files`).

        The rank column is never trusted: rows are re-sorted by score (MS MARCO runs, which have no
        score, rank by ``-rank``). Errors name the file and line.
        """
        return cls(read_run(path))

    # ------------------------------------------------------------------------------------- reading

    @property
    def qids(self) -> list[str]:
        """The queries, in order."""
        return [q for block in self._blocks for q in block.qids]

    def __len__(self) -> int:
        return sum(len(block.scores) for block in self._blocks)

    def _queries(self) -> Iterator[tuple[str, list[str], np.ndarray]]:
        for block in self._blocks:
            yield from _block_queries(block)

    def __iter__(self) -> Iterator[Result]:
        for qid, docnos, scores in self._queries():
            for rank, (docno, score) in enumerate(zip(docnos, scores.tolist(), strict=True), 1):
                yield Result(qid, docno, rank, score)

    def _where(self) -> dict[str, tuple[_Block, int]]:
        """Each qid's block and position in it, made on first use (one dict, not a scan per lookup)."""
        if self._index is None:
            self._index = {qid: (block, i) for block in self._blocks for i, qid in enumerate(block.qids)}
        return self._index

    def __getitem__(self, qid: str) -> list[tuple[str, float]]:
        block, i = self._where()[qid]
        a, b = int(block.offsets[i]), int(block.offsets[i + 1])
        return list(zip(block.docnos[a:b].to_pylist(), block.scores[a:b].tolist(), strict=True))

    def __contains__(self, qid: object) -> bool:
        return qid in self._where()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Run):
            return NotImplemented
        return self.qids == other.qids and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Run({len(self.qids):,} queries, {len(self):,} results)"

    def explain(self, qid: str, docno: str) -> Any:
        """Why ``docno`` scored what it did for ``qid``: per query token, the document token it matched,
        their similarity and its share of the score, as a `maxsim_cli.explain.Explanation` whose
        ``exact`` says that the similarities, added in the kernel's order, give the run's score bit for
        bit (docs/api.md, "Explanations"; typed Any here, a layer below the scoring that makes one).
        For runs that `search` or `rerank` returned, which keep their queries and corpus for it; a docno
        the run does not list for ``qid`` is explained too, scored anew.

        >>> from maxsim_cli import search
        >>> run = search("sample_data/queries.safetensors", "sample_data/corpus", k=3, device="cpu")
        >>> top = next(iter(run))
        >>> run.explain(top.qid, top.docno).exact
        True
        """
        if self._explainer is None:
            from maxsim_cli.errors import UsageError

            raise UsageError(
                "Run.explain: this run was not made by search or rerank, so it has no queries or corpus; "
                "use maxsim_cli.explain.explain(queries, corpus, qid, docno)"
            )
        qid, docno = str(qid), str(docno)
        score = None
        if qid in self:
            block, i = self._where()[qid]
            a, b = int(block.offsets[i]), int(block.offsets[i + 1])
            hits = block.docnos[a:b].to_pylist()
            if docno in hits:
                score = float(block.scores[a + hits.index(docno)])
        return self._explainer(qid, docno, score)

    # ---------------------------------------------------------------------------------- converting

    def to_dict(self) -> dict[str, list[tuple[str, float]]]:
        """``{qid: [(docno, score), ...]}`` in rank order, queries in order (scores are the float32
        values, as Python floats)."""
        return {
            qid: list(zip(docnos, scores.tolist(), strict=True)) for qid, docnos, scores in self._queries()
        }

    @in_python_terms
    def to_trec(self, path: str | os.PathLike[str], tag: str = "maxsim", *, fmt: str = "trec") -> None:
        """Write the run as ``maxsim score`` does: TREC ``qid Q0 docno rank score tag`` (or ``fmt="jsonl"``),
        atomically, ``.gz`` compressed, ``"-"`` for stdout. The same inputs give the same bytes.

        As ``maxsim score -o`` does, refuses (`UsageError`, before writing anything) a ``path`` that is
        one of the files the run was made from (the query file, a shard or the manifest of the corpus,
        the candidates' run file), a folder, or a file in a folder that does not exist."""
        from maxsim_cli.shards.files import check_output

        check_output(path, self._inputs, option=OUTPUT)
        with RunWriter(path, tag=tag, fmt=fmt) as writer:
            for block in self._blocks:
                m = block.uniform()
                if m is not None:
                    writer.write_ranked(block.qids, block.docnos, block.scores.reshape(len(block.qids), m))
                    continue
                for qid, docnos, scores in _block_queries(block):
                    writer.write_query(qid, docnos, scores.tolist())

    def to_dataframe(self) -> pandas.DataFrame:
        """A pandas DataFrame with PyTerrier's columns ``qid``, ``docno``, ``rank``, ``score``, ranks
        numbered from 0 as PyTerrier numbers them (the TREC file `to_trec` writes numbers them from 1,
        and so do the `Result` rows of iterating the run). Needs pandas (``pip install 'maxsim[pandas]'``)."""
        try:
            import pandas as pd
        except ImportError:
            from maxsim_cli.errors import UsageError

            raise UsageError("Run.to_dataframe needs pandas: pip install 'maxsim[pandas]'") from None
        qids, docnos, ranks, scores = [], [], [], []
        for block in self._blocks:
            lengths = np.diff(block.offsets)
            qids.append(np.repeat(np.asarray(block.qids, dtype=object), lengths))
            docnos.append(np.asarray(block.docnos.to_pylist(), dtype=object))
            ranks.append(np.arange(len(block.scores)) - np.repeat(block.offsets[:-1], lengths))
            scores.append(block.scores.astype(np.float64))
        if not qids:
            return pd.DataFrame({"qid": [], "docno": [], "rank": [], "score": []}).astype(
                {"qid": object, "docno": object, "rank": np.int64, "score": np.float64}
            )
        return pd.DataFrame(
            {
                "qid": np.concatenate(qids),
                "docno": np.concatenate(docnos),
                "rank": np.concatenate(ranks).astype(np.int64),
                "score": np.concatenate(scores),
            }
        )


def _block_queries(block: _Block) -> Iterator[tuple[str, list[str], np.ndarray]]:
    docnos = block.docnos.to_pylist()
    for i, qid in enumerate(block.qids):
        a, b = int(block.offsets[i]), int(block.offsets[i + 1])
        yield qid, docnos[a:b], block.scores[a:b]
