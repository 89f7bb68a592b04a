"""TREC runs and qrels: readers that name `file:line` in every error, and an atomic run writer.

Run formats read (detected from the first data line, then required of every line):

- TREC, six columns ``qid Q0 docno rank score tag`` separated by whitespace. The rank column is never
  trusted (Anserini writes ranks from 1, PyTerrier and ir_datasets from 0, some tools garbage): the
  order is the score's.
- MS MARCO, three tab-separated columns ``qid pid rank``. There is no score, so ``score = -rank``, which
  keeps the file's ranking under "score descending".
- ColBERT, four tab-separated columns ``qid pid rank score``; the rank is ignored.

Any of them may be gzip-compressed (recognised by its magic bytes, whatever the name) and ``-`` reads
standard input; ``irds:<dataset-id>`` reads an ir_datasets dataset's scoreddocs or qrels instead
(`maxsim_cli.irds`). Blank lines are skipped. In tab-separated lines a field must be non-empty and contain no
whitespace (a space inside a tab-separated id would silently become two ids for trec_eval).

Order written (trec_eval's own): score descending, ties broken by docno descending, both compared exactly
as they are printed. A score is printed as the shortest decimal that reads back as the same float32 (Arrow's
float-to-string cast, e.g. ``0.8125``, ``31.97153``, ``1e-7``), so it round-trips exactly; a fixed six
decimals would create ties that the scores do not have. Because the order key is the float32 value, the
rank column always agrees with the order in which trec_eval re-sorts the file. Lines are assembled by
Arrow compute functions, not by Python string formatting: 512K lines take ~0.1 s instead of ~0.6 s.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import sys
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, NamedTuple

import numpy as np

from maxsim_cli import irds
from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.lifeline import commit_point
from maxsim_cli.shards import (
    ID_FORBIDDEN,
    ID_FORBIDDEN_NOT_SPACE,
    ID_RULE,
    has_forbidden_chars,
    id_problem,
    string_bytes,
)
from maxsim_cli.shards.files import OutputFile, write_error

__all__ = [
    "Qrel",
    "RunRow",
    "RankedSink",
    "RunWriter",
    "format_score",
    "format_scores",
    "iter_qrels",
    "iter_run",
    "read_qrels",
    "read_run",
    "read_run_and_format",
    "sort_trec",
]

_GZIP_MAGIC = b"\x1f\x8b"
# Rows per part when write_ranked formats a block on several threads (512K rows: 15 parts on 16 cores).
_PARALLEL_ROWS = 32768
_WHITESPACE = ID_FORBIDDEN  # what a TREC field cannot hold: whitespace, control and zero-width characters
RUN_FORMATS = ("trec", "msmarco", "colbert")
_COLUMNS = {6: "trec", 3: "msmarco", 4: "colbert"}
_FORMAT_DESCRIPTION = {
    "trec": "TREC 'qid Q0 docno rank score tag' (6 columns)",
    "msmarco": "MS MARCO 'qid<TAB>pid<TAB>rank' (3 columns)",
    "colbert": "ColBERT 'qid<TAB>pid<TAB>rank<TAB>score' (4 columns)",
}


class RunRow(NamedTuple):
    """One line of a run. ``rank`` is what the file says (never used for ordering); ``line`` is 1-based."""

    qid: str
    docno: str
    rank: int | None
    score: float
    line: int


class Qrel(NamedTuple):
    """One judgement of a TREC qrels file ``qid iteration docno relevance``; ``line`` is 1-based."""

    qid: str
    docno: str
    relevance: int
    line: int


# --------------------------------------------------------------------------------------------------
# reading


def _display_name(path: str | os.PathLike[str]) -> str:
    return "<stdin>" if str(path) == "-" else str(path)


def _open_binary(path: str | os.PathLike[str], what: str) -> IO[bytes]:
    """Open a path or ``-`` for binary reading, transparently gunzipping gzip data."""
    name = _display_name(path)
    if str(path) == "-":
        if sys.stdin is None or not hasattr(sys.stdin, "buffer"):
            raise InputError(f"{name}: no standard input to read the {what} from; give a file instead of '-'")
        raw: IO[bytes] = sys.stdin.buffer
    else:
        try:
            raw = open(path, "rb")  # noqa: SIM115 - closed by the caller through the returned object
        except FileNotFoundError:
            raise InputError(f"{name}: {what} file not found; check the path") from None
        except IsADirectoryError:
            raise InputError(f"{name}: is a directory, expected a {what} file") from None
        except OSError as exc:
            raise InputError(f"{name}: cannot open {what} file: {exc.strerror}") from None
    buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)  # type: ignore[arg-type]
    if buffered.peek(2)[:2] == _GZIP_MAGIC:
        return gzip.GzipFile(fileobj=buffered, mode="rb")  # type: ignore[return-value]
    return buffered


def _iter_lines(path: str | os.PathLike[str], what: str) -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, text)`` for each non-blank line, decoded as UTF-8, newline stripped."""
    name = _display_name(path)
    stream = _open_binary(path, what)
    lineno = 0
    try:
        while True:
            try:
                raw = stream.readline()
            except (OSError, EOFError, zlib.error) as exc:
                raise InputError(
                    f"{name}:{lineno + 1}: corrupt or truncated gzip data ({exc}); re-create the file"
                ) from None
            if not raw:
                break
            lineno += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(
                    f"{name}:{lineno}: not valid UTF-8 at byte {exc.start} of the line; "
                    "ids must be UTF-8 text"
                ) from None
            text = text.rstrip("\r\n")
            if lineno == 1 and text.startswith("\ufeff"):
                text = text[1:]  # a byte-order mark written by some editors
            if not text.strip():
                continue
            yield lineno, text
    finally:
        if str(path) != "-":
            stream.close()


def _split_fields(name: str, lineno: int, text: str) -> list[str]:
    """Tab-separated when the line has a tab, else whitespace-separated. A field holding a character that
    ids may not hold (`maxsim_cli.shards.ID_FORBIDDEN`: a NUL, a zero-width space, ...) is an error."""
    if "\t" not in text:
        fields = text.split()
        if ID_FORBIDDEN_NOT_SPACE.search(text):
            column, field = next((c, f) for c, f in enumerate(fields, 1) if ID_FORBIDDEN_NOT_SPACE.search(f))
            raise InputError(f"{name}:{lineno}: column {column} {field!r} {id_problem(field)}; {ID_RULE}")
        return fields
    fields = text.strip(" ").split("\t")
    for column, field in enumerate(fields, 1):
        if not field:
            raise InputError(f"{name}:{lineno}: column {column} is empty (two tabs in a row?); remove it")
        if _WHITESPACE.search(field):
            if ID_FORBIDDEN_NOT_SPACE.search(field):
                raise InputError(f"{name}:{lineno}: column {column} {field!r} {id_problem(field)}; {ID_RULE}")
            raise InputError(
                f"{name}:{lineno}: column {column} {field!r} contains whitespace; "
                "ids cannot contain spaces, and columns must be separated by single tabs"
            )
    return fields


def _parse_score(name: str, lineno: int, text: str, column: int) -> float:
    try:
        score = float(text)
    except ValueError:
        raise InputError(f"{name}:{lineno}: score (column {column}) {text!r} is not a number") from None
    if not math.isfinite(score):
        raise InputError(f"{name}:{lineno}: score (column {column}) is {text!r}; scores must be finite")
    return score


def _parse_rank(name: str, lineno: int, text: str, column: int) -> int:
    try:
        return int(text)
    except ValueError:
        raise InputError(f"{name}:{lineno}: rank (column {column}) {text!r} is not an integer") from None


def _iter_run_rows(path: str | os.PathLike[str], formats: list[str] | None = None) -> Iterator[RunRow]:
    """Parse rows without duplicate checks (those need state the callers keep in their own shape); the
    format found on the first line is appended to ``formats`` when given."""
    name = _display_name(path)
    run_format: str | None = None
    num_columns = 0
    for lineno, text in _iter_lines(path, "run"):
        fields = _split_fields(name, lineno, text)
        if run_format is None:
            run_format = _COLUMNS.get(len(fields))
            if run_format is None:
                raise InputError(
                    f"{name}:{lineno}: {len(fields)} columns; expected a run in TREC "
                    "'qid Q0 docno rank score tag' (6 columns), MS MARCO 'qid<TAB>pid<TAB>rank' (3) "
                    "or ColBERT 'qid<TAB>pid<TAB>rank<TAB>score' (4) format"
                )
            num_columns = len(fields)
            if formats is not None:
                formats.append(run_format)
        elif len(fields) != num_columns:
            raise InputError(
                f"{name}:{lineno}: {len(fields)} columns, but the file started as "
                f"{_FORMAT_DESCRIPTION[run_format]}; every line must have the same columns"
            )
        if run_format == "trec":
            qid, _, docno, rank_text, score_text, _ = fields
            # The rank column is never trusted, so a non-integer there is kept as "unknown", not an error.
            try:
                rank: int | None = int(rank_text)
            except ValueError:
                rank = None
            score = _parse_score(name, lineno, score_text, 5)
        elif run_format == "msmarco":
            qid, docno, rank_text = fields
            rank = _parse_rank(name, lineno, rank_text, 3)
            score = -float(rank)
        else:
            qid, docno, rank_text, score_text = fields
            rank = _parse_rank(name, lineno, rank_text, 3)
            score = _parse_score(name, lineno, score_text, 4)
        yield RunRow(qid, docno, rank, score, lineno)
    if run_format is None:
        raise InputError(f"{name}: the run is empty (no lines); expected at least one result")


def iter_run(path: str | os.PathLike[str]) -> Iterator[RunRow]:
    """Yield the rows of a run file (TREC / MS MARCO / ColBERT, optionally gzipped, ``-`` = stdin).

    Raises `InputError` naming ``file:line`` for a wrong column count, a non-numeric score, invalid
    UTF-8, whitespace inside a tab-separated field, a docno repeated within one query, or an empty file.
    """
    if irds.is_irds(path):
        for qid, docno, score, number in irds.iter_scoreddocs(str(path)):
            yield RunRow(qid, docno, None, score, number)
        return
    name = _display_name(path)
    seen: dict[str, set[str]] = {}
    for row in _iter_run_rows(path):
        docs = seen.setdefault(row.qid, set())
        if row.docno in docs:
            raise _duplicate_error(name, row)
        docs.add(row.docno)
        yield row


def _duplicate_error(name: str, row: RunRow) -> InputError:
    return InputError(
        f"{name}:{row.line}: docno {row.docno!r} appears twice for query {row.qid!r}; "
        "a run lists each document at most once per query"
    )


def read_run(path: str | os.PathLike[str]) -> dict[str, list[tuple[str, float]]]:
    """Read a whole run: ``qid -> [(docno, score), ...]`` in file order, qids in first-appearance order.

    The score is the file's score (``-rank`` for MS MARCO runs); sort with `sort_trec` for the ranking.
    ``irds:<dataset-id>`` reads the scoreddocs of an ir_datasets dataset (`maxsim_cli.irds`).
    """
    return read_run_and_format(path)[0]


def read_run_and_format(path: str | os.PathLike[str]) -> tuple[dict[str, list[tuple[str, float]]], str]:
    """`read_run` and the format the file was read as: ``"trec"``, ``"colbert"``, ``"msmarco"`` (no score
    column: the scores are ``-rank``) or ``"irds"`` (an ir_datasets dataset's scoreddocs)."""
    if irds.is_irds(path):
        return irds.read_run(str(path)), "irds"
    name = _display_name(path)
    by_query: dict[str, dict[str, float]] = {}
    formats: list[str] = []
    for row in _iter_run_rows(path, formats):
        docs = by_query.setdefault(row.qid, {})
        if row.docno in docs:
            raise _duplicate_error(name, row)
        docs[row.docno] = row.score
    return {qid: list(docs.items()) for qid, docs in by_query.items()}, formats[0]


def iter_qrels(path: str | os.PathLike[str]) -> Iterator[Qrel]:
    """Yield the judgements of a TREC qrels file ``qid iteration docno relevance`` (.gz and ``-`` ok).

    Errors name ``file:line``: wrong column count, non-integer relevance, a (qid, docno) judged twice,
    an empty file.
    """
    if irds.is_irds(path):
        for qid, docno, relevance, number in irds.iter_qrels(str(path)):
            yield Qrel(qid, docno, relevance, number)
        return
    name = _display_name(path)
    seen: set[tuple[str, str]] = set()
    count = 0
    for lineno, text in _iter_lines(path, "qrels"):
        fields = _split_fields(name, lineno, text)
        if len(fields) != 4:
            raise InputError(
                f"{name}:{lineno}: {len(fields)} columns; expected TREC qrels 'qid 0 docno relevance' "
                "(4 columns)"
            )
        qid, _, docno, rel_text = fields
        try:
            relevance = int(rel_text)
        except ValueError:
            raise InputError(
                f"{name}:{lineno}: relevance (column 4) {rel_text!r} is not an integer"
            ) from None
        if (qid, docno) in seen:
            raise InputError(f"{name}:{lineno}: query {qid!r} judges docno {docno!r} twice; keep one line")
        seen.add((qid, docno))
        count += 1
        yield Qrel(qid, docno, relevance, lineno)
    if count == 0:
        raise InputError(f"{name}: the qrels file is empty (no lines); expected 'qid 0 docno relevance'")


def read_qrels(path: str | os.PathLike[str]) -> dict[str, dict[str, int]]:
    """Read a whole qrels file: ``qid -> {docno: relevance}``, qids in first-appearance order;
    ``irds:<dataset-id>`` reads an ir_datasets dataset's qrels (`maxsim_cli.irds`)."""
    qrels: dict[str, dict[str, int]] = {}
    for qrel in iter_qrels(path):
        qrels.setdefault(qrel.qid, {})[qrel.docno] = qrel.relevance
    return qrels


# --------------------------------------------------------------------------------------------------
# ordering and formatting


def format_scores(scores: Sequence[float] | np.ndarray):  # noqa: ANN201 - a pyarrow.StringArray
    """Scores as printed in a run (an Arrow string array): the shortest decimal that reads back as the
    same float32, with -0 printed as 0."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from maxsim_cli.arrays import values_array

    values = np.asarray(scores, dtype=np.float32).reshape(-1) + np.float32(0.0)
    return pc.cast(values_array(values), pa.large_string())


def format_score(x: float) -> str:
    """One score as printed in a run (see `format_scores`)."""
    return format_scores([x])[0].as_py()


def _ties_by_docno_descending(docnos, keys: np.ndarray) -> bool:  # noqa: ANN001 - an Arrow string array
    """Whether every pair of equal neighbouring scores in the rows of ``keys`` [nq, m] has its docnos in
    descending order (trec_eval's tie-break), ``docnos`` holding the rows one after another."""
    m = keys.shape[1] if keys.ndim == 2 else 0
    if m < 2:
        return True
    import pyarrow.compute as pc

    from maxsim_cli.arrays import values_array

    row, col = np.nonzero(keys[:, :-1] == keys[:, 1:])
    if len(row) == 0:
        return True
    first = row * m + col
    # Arrow compares strings by their UTF-8 bytes, as Python's str comparison and trec_eval's strcmp do
    left, right = docnos.take(values_array(first)), docnos.take(values_array(first + 1))
    return bool(pc.all(pc.greater(left, right)).as_py())


def _none_empty(docnos) -> bool:  # noqa: ANN001 - an Arrow large_string array
    """Whether no value of ``docnos`` is the empty string (nulls aside): from its offsets."""
    if docnos.null_count:
        import pyarrow.compute as pc

        return pc.min(pc.utf8_length(docnos)).as_py() > 0
    start = docnos.offset
    offsets = np.frombuffer(docnos.buffers()[1], dtype=np.int64)[start : start + len(docnos) + 1]
    return bool((offsets[1:] > offsets[:-1]).all())


def _ranks_text(count: int):  # noqa: ANN202
    import pyarrow as pa
    import pyarrow.compute as pc

    from maxsim_cli.arrays import values_array

    return pc.cast(values_array(np.arange(1, count + 1, dtype=np.int64)), pa.large_string())


def _float32_keys(scores: Sequence[float]) -> np.ndarray:
    """float32 then float64 (+ 0.0 turns -0 into 0): the order key is exactly the printed value."""
    return np.asarray(scores, dtype=np.float32).astype(np.float64) + 0.0


def _in_trec_order(docnos: Sequence[str], keys: np.ndarray) -> bool:
    """Whether rows are in trec_eval's order already: keys non-increasing, and where two are equal the
    docnos descending (only those pairs are compared)."""
    if not bool(np.all(keys[:-1] >= keys[1:])):
        return False
    return all(docnos[i] > docnos[i + 1] for i in np.flatnonzero(keys[:-1] == keys[1:]).tolist())


def _untied(keys: np.ndarray) -> np.ndarray | None:
    """The order of ``keys`` (`_float32_keys`, or the float32 scores with -0 made 0) descending when they
    are finite and all different, else None (the docnos then decide between equal scores)."""
    order = np.argsort(-keys, kind="stable")
    ranked = keys[order]
    if np.isfinite(ranked).all() and bool(np.all(ranked[:-1] > ranked[1:])):
        return order
    return None


def sort_trec(docnos: Sequence[str], scores: Sequence[float]) -> list[int]:
    """Indices of ``docnos`` in trec_eval's order: float32 score descending, ties by docno descending.

    docnos compare as Python strings, i.e. by code point, which is the byte order of their UTF-8 (the
    ``strcmp`` trec_eval uses).
    """
    if len(docnos) != len(scores):
        raise ValueError(f"sort_trec: {len(docnos)} docnos but {len(scores)} scores")
    keys = _float32_keys(scores)
    if len(docnos) >= _NUMPY_SORT_FROM:
        # without equal scores the scores alone decide, and the docnos (an array of strings to build)
        # are not needed: 1,000 entries ~40 us against ~200 (a served rerank sorts at every request)
        order = _untied(keys)
        if order is not None:
            return order.tolist()
        # numpy's unicode strings compare by code point too; the position key keeps equal entries in
        # input order, as `sorted(..., reverse=True)` does
        position = -np.arange(len(docnos))
        return np.lexsort((position, np.asarray(docnos, dtype=str), keys))[::-1].tolist()
    key_list = keys.tolist()
    return sorted(range(len(docnos)), key=lambda i: (key_list[i], docnos[i]), reverse=True)


# From this many entries `sort_trec` sorts in numpy, the same order (tests/test_runs.py). 2-core machine,
# per sort: 32 entries 4.9 us against 4.7 for Python's sort with a tuple key, 48: 6.2 / 6.6, 1000:
# 87 / 230 us (`python benchmarks/probe_sort_trec.py`, results/host/sort-trec-cpu.json).
_NUMPY_SORT_FROM = 48


# --------------------------------------------------------------------------------------------------
# writing


def _check_id(kind: str, value: str, target: str, qid: str | None = None) -> None:
    problem = id_problem(value)
    if problem is not None:
        where = f" (query {qid!r})" if qid is not None else ""
        raise InputError(
            f"{target}: {kind} {value!r}{where} {problem}, which a TREC run cannot hold; rename it in the "
            "input"
        )


class RankedSink:
    """What every consumer of ranked results shares: the rules a run must follow, checked once.

    The engine hands results over one query at a time (`write_query`: any order, re-sorted here) or as
    blocks already in trec_eval's order (`write_ranked`). Both refuse what a TREC run cannot hold (an
    id with whitespace, a non-finite score, a docno twice in a query, a query twice), naming the
    culprit, and pass the ordered rows on to `_take_query` / `_take_block`: `RunWriter` formats them
    into a file, `maxsim_cli.run.RunCollector` keeps them in memory.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._written: set[str] = set()
        self.num_queries = 0
        self.num_rows = 0

    def _check_open(self, method: str) -> None:
        """Raise if rows cannot be taken now (a writer outside its `with` block)."""

    def _take_query(self, qid: str, docnos: list[str], keys: np.ndarray) -> None:
        raise NotImplementedError

    def _take_block(self, qids: Sequence[str], m: int, docnos, keys: np.ndarray) -> None:  # noqa: ANN001
        raise NotImplementedError

    def _raise_for_bad_row(self, qid: str, docnos: Sequence[str], keys: Sequence[float]) -> None:
        """Raise `InputError` for the first row of a query that a TREC run cannot hold."""
        seen: set[str] = set()
        for docno, key in zip(docnos, keys, strict=True):
            _check_id("docno", docno, self._name, qid)
            if not math.isfinite(key):
                raise InputError(
                    f"{self._name}: score {key} of docno {docno!r} for query {qid!r} is not finite; "
                    "check the embeddings for NaN or Inf, or for values so large that their products "
                    "overflow float32"
                )
            if docno in seen:
                raise InputError(
                    f"{self._name}: docno {docno!r} given twice for query {qid!r}; a run lists it once"
                )
            seen.add(docno)

    def write_query(self, qid: str, docnos: Sequence[str], scores: Sequence[float]) -> None:
        """Take one query's results, sorted by `sort_trec` and ranked from 1.

        Raises `InputError` for an id with whitespace, a non-finite score, a docno listed twice or a
        query written twice (each would make a run that trec_eval rejects or misreads).
        """
        self._check_open("write_query")
        if len(docnos) != len(scores):
            raise ValueError(f"write_query: {len(docnos)} docnos but {len(scores)} scores")
        _check_id("query id", qid, self._name)
        if qid in self._written:
            raise InputError(f"{self._name}: query {qid!r} written twice; each query appears once in a run")
        self._written.add(qid)
        key_array = _float32_keys(scores)
        keys = key_array.tolist()
        # whole-query checks first (one pass each in C); the per-row loop only runs to name the culprit
        if (
            _WHITESPACE.search("".join(docnos))
            or not all(docnos)
            or not np.isfinite(key_array).all()
            or len(set(docnos)) != len(docnos)
        ):
            self._raise_for_bad_row(qid, docnos, keys)
        if _in_trec_order(docnos, key_array):  # a top-k, or rows `sort_trec` ordered: nothing to sort
            self._take_query(qid, list(docnos), key_array.astype(np.float32))
            return
        order = sorted(range(len(docnos)), key=lambda i: (keys[i], docnos[i]), reverse=True)
        self._take_query(qid, [docnos[i] for i in order], key_array[order].astype(np.float32))

    def write_ranked(
        self, qids: Sequence[str], docnos, scores: np.ndarray, *, corpus_ids: bool = False  # noqa: ANN001
    ) -> None:
        """Take several queries at once whose rows are already in trec_eval's order, as a running top-k
        yields them: query i's rows are ``docnos[i * m : (i + 1) * m]`` (an Arrow string array) with
        float32 ``scores[i]`` ([len(qids), m]).

        The rows are checked as `write_query` checks them (ids, finite scores, the order); whatever fails
        goes through `write_query` query by query, which names the culprit. ``corpus_ids``: the docnos
        are ids of an open corpus, each checked as its shard was read (not empty, no forbidden
        character): those two checks are not made again; the rest is.
        """
        import pyarrow as pa

        self._check_open("write_ranked")
        nq, m = (len(qids), 0) if scores.size == 0 else scores.shape
        if len(docnos) != nq * m:
            raise ValueError(f"write_ranked: {len(docnos)} docnos for {nq} queries of {m} rows")
        if docnos.type != pa.large_string():
            docnos = docnos.cast(pa.large_string())
        keys = scores.astype(np.float32) + np.float32(0.0)
        clean = (
            len(set(qids)) == nq
            and not any(q in self._written for q in qids)
            and all(q and not _WHITESPACE.search(q) for q in qids)
            and bool(np.isfinite(keys).all())
            and bool((keys[:, :-1] >= keys[:, 1:]).all())
            and (corpus_ids or (not has_forbidden_chars(docnos) and (m == 0 or _none_empty(docnos))))
            and _ties_by_docno_descending(docnos, keys)
        )
        if not clean:
            for i, qid in enumerate(qids):
                self.write_query(qid, docnos[i * m : (i + 1) * m].to_pylist(), keys[i].tolist())
            return
        self._written.update(qids)
        self._take_block(list(qids), m, docnos, keys)


class RunWriter(RankedSink):
    """Write a run, one query at a time, atomically.

    ``RunWriter(path, tag="maxsim", fmt="trec")`` is a context manager. ``fmt="trec"`` writes
    ``qid Q0 docno rank score tag`` with single spaces, ranks from 1 in trec_eval's order;
    ``fmt="jsonl"`` writes one JSON object per query::

        {"qid": "q1", "results": [{"docno": "d7", "rank": 1, "score": 0.8125}, ...]}

    with the same order, ranks and score digits. A path ending in ``.gz`` is gzip-compressed. The file
    is written to a temporary file in the same directory and moved into place only when the ``with``
    block exits without an exception; otherwise the temporary file is removed and whatever was at the
    path stays as it was (`maxsim_cli.shards.files.OutputFile`; a FIFO or a device is written through).
    ``"-"`` writes to standard output, flushing after each query so a pipeline sees results as they come.
    A write error (a full disk, ...) is a one-line `MaxsimError` naming the path. The run in place (or
    all written to a stream) is the command's commit point (`maxsim_cli.lifeline.commit_point`).
    """

    def __init__(self, path: str | os.PathLike[str], tag: str = "maxsim", fmt: str = "trec") -> None:
        if fmt not in ("trec", "jsonl"):
            raise UsageError(f"unknown run format {fmt!r}; use 'trec' or 'jsonl'")
        if id_problem(tag) is not None:
            raise UsageError(f"run tag {tag!r} {id_problem(tag)}; pass a single word")
        self.path = str(path)
        super().__init__("<stdout>" if self.path == "-" else self.path)
        self.tag = tag
        self.fmt = fmt
        self._stream: IO[str] | None = None
        self._binary: IO[bytes] | None = None
        self._output: OutputFile | None = None

    # context management --------------------------------------------------------------------------

    def __enter__(self) -> RunWriter:
        if self.path == "-":
            self._stream = sys.stdout
            return self
        self._output = OutputFile(self.path, commits=True)  # the run is the command's output
        try:  # a signal in here (no `with` block yet, so no __exit__) must not leave the temp file
            binary = self._output.open()
            if self.path.endswith(".gz"):
                # mtime=0 and no file name: the same run gives the same bytes.
                binary = gzip.GzipFile(filename="", mode="wb", fileobj=binary, mtime=0)  # type: ignore[assignment]
                self._binary = binary
            self._stream = io.TextIOWrapper(binary, encoding="utf-8", newline="\n")
        except BaseException:
            self._output.abort()
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self.path == "-":
            if exc_type is None and self._stream is not None:
                try:
                    self._stream.flush()
                except BrokenPipeError:
                    raise
                except OSError as error:
                    raise write_error(self._name, error, nothing_written=False) from None
                with commit_point():  # the whole run is out: the command's output is complete
                    pass
            return
        assert self._stream is not None and self._output is not None
        if exc_type is not None:  # the error that ended the block is the one to report
            try:
                self._stream.close()
            except (OSError, ValueError):
                pass
            self._output.abort()
            return
        try:
            self._stream.close()  # the last buffered lines (and the gzip trailer)
            if self._binary is not None:
                self._binary.close()
        except BrokenPipeError:
            self._output.abort()
            raise
        except OSError as error:
            self._output.abort()
            raise write_error(self.path, error, nothing_written=not self._output.stream) from None
        except BaseException:
            self._output.abort()
            raise
        self._output.commit()

    # writing --------------------------------------------------------------------------------------

    def _check_open(self, method: str) -> None:
        if self._stream is None:
            raise RuntimeError(f"RunWriter.{method} called outside its `with` block")

    def _take_query(self, qid: str, docnos: list[str], keys: np.ndarray) -> None:
        from maxsim_cli.arrays import strings_array

        scores_text = format_scores(keys)
        if self.fmt == "trec":
            text = self._trec_lines([qid], len(docnos), strings_array(docnos), scores_text)
        else:
            results = ",".join(
                f'{{"docno":{json.dumps(docno, ensure_ascii=False)},"rank":{rank},"score":{score}}}'
                for rank, (docno, score) in enumerate(zip(docnos, scores_text.to_pylist(), strict=True), 1)
            )
            text = f'{{"qid":{json.dumps(qid, ensure_ascii=False)},"results":[{results}]}}\n'
        self._emit(text, 1, len(docnos))

    def _take_block(self, qids: Sequence[str], m: int, docnos, keys: np.ndarray) -> None:  # noqa: ANN001
        nq = len(qids)
        if self.fmt != "trec":
            for i, qid in enumerate(qids):
                self._take_query(qid, docnos[i * m : (i + 1) * m].to_pylist(), keys[i])
            return

        def lines(a: int, b: int) -> bytes:  # queries [a, b); Arrow releases the GIL while it works
            return self._trec_lines(qids[a:b], m, docnos[a * m : b * m], format_scores(keys[a:b]))

        # parts of >= _PARALLEL_ROWS rows formatted side by side, written in order
        parts = max(1, min(os.cpu_count() or 1, 16, nq * m // _PARALLEL_ROWS))
        cuts = [nq * i // parts for i in range(parts + 1)]
        if parts == 1:
            self._emit(lines(0, nq), nq, nq * m)
            return
        with ThreadPoolExecutor(parts, thread_name_prefix="maxsim-format") as pool:
            text = b"".join(pool.map(lines, cuts[:-1], cuts[1:]))
        self._emit(text, nq, nq * m)

    def _trec_lines(self, qids: Sequence[str], m: int, docnos, scores_text) -> bytes:  # noqa: ANN001
        """``qid Q0 docno rank score tag`` lines, ``m`` rows a query, ranked from 1."""
        import pyarrow.compute as pc

        from maxsim_cli.arrays import strings_array, values_array

        qid_column = strings_array(qids).take(values_array(np.repeat(np.arange(len(qids)), m)))
        ranks = _ranks_text(m).take(values_array(np.tile(np.arange(m), len(qids))))
        q0, tag, space = strings_array(["Q0", f"{self.tag}\n", " "])  # Arrow scalars, without pa.scalar
        lines = pc.binary_join_element_wise(qid_column, q0, docnos, ranks, scores_text, tag, space)
        return string_bytes(lines).tobytes()

    def _emit(self, text: str | bytes, queries: int, rows: int) -> None:
        assert self._stream is not None
        binary = getattr(self._stream, "buffer", None) if isinstance(text, bytes) else None
        try:
            if binary is not None:  # UTF-8 bytes as Arrow built them, past the text layer
                self._stream.flush()
                binary.write(text)
            else:
                self._stream.write(text.decode("utf-8") if isinstance(text, bytes) else text)
            if self.path == "-":
                self._stream.flush()
                if binary is not None:
                    binary.flush()
        except BrokenPipeError:
            raise
        except OSError as error:  # a full disk, a quota, ...: one line naming the output
            streamed = self.path == "-" or (self._output is not None and self._output.stream)
            raise write_error(self._name, error, nothing_written=not streamed) from None
        self.num_queries += queries
        self.num_rows += rows
