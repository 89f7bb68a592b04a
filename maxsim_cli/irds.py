"""Qrels and first-stage runs from ir_datasets (the optional ``irds`` extra): ``irds:<dataset-id>``.

Wherever a run or qrels file is read (`maxsim_cli.run_files.read_run` / `read_qrels`: ``maxsim eval``,
``maxsim score --candidates``, ``maxsim verify --candidates``, ``rerank`` in Python), a name such as
``irds:msmarco-passage/dev/small`` reads the dataset's qrels or its scoreddocs (its first-stage run,
BM25 for most) through ``ir_datasets`` instead of a file. ir_datasets downloads and caches the data on
first use (``~/.ir_datasets``, or ``$IR_DATASETS_HOME``); this module only iterates over it, one record
at a time, so nothing but the result (the same ``qid -> ...`` dicts the file readers return) is held.

What ir_datasets hands over is taken as the dataset's own truth, not refused like a user's file: a
(query, document) pair that appears twice keeps its first record (some published runs and qrels repeat
lines). A non-finite score is still an error, since no ranking can be made from it. A name that is also
an existing file is read as the file.

A download that fails (no network) is one line naming the dataset, the cache folder ir_datasets uses
and what to do; ir_datasets' own lines about each failed attempt are left out (its other lines, such as
a download's progress, are not).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

from maxsim_cli.errors import InputError, MaxsimError, UsageError

PREFIX = "irds:"
INSTALL_HINT = "pip install 'maxsim[irds]'"


def is_irds(source: str | os.PathLike[str] | None) -> bool:
    """Whether ``source`` names an ir_datasets dataset (``irds:<id>``) rather than a file."""
    if source is None or not isinstance(source, str) or not source.startswith(PREFIX):
        return False
    return not os.path.exists(source)


def dataset_id(source: str) -> str:
    """The dataset id of ``irds:<id>``; `UsageError` when it is empty."""
    name = source[len(PREFIX) :].strip()
    if not name:
        raise UsageError(f"{source!r}: no dataset id after 'irds:'; e.g. irds:msmarco-passage/dev/small")
    return name


def _ir_datasets() -> Any:
    try:
        import ir_datasets
    except ImportError:
        raise MaxsimError(
            f"reading 'irds:' datasets needs the optional package ir-datasets; install it with {INSTALL_HINT}"
        ) from None
    return ir_datasets


def load(source: str, what: str) -> Any:
    """The ir_datasets dataset that ``source`` names, checked to provide ``what`` (``"qrels"`` or
    ``"scoreddocs"``). Raises `InputError` for an unknown id or a dataset without ``what``."""
    name = dataset_id(source)
    ir_datasets = _ir_datasets()
    try:
        dataset = ir_datasets.load(name)
    except KeyError:
        close = difflib.get_close_matches(name, list(ir_datasets.registry), n=3, cutoff=0.6)
        suggestions = ", ".join(PREFIX + c for c in close)
        hint = f"did you mean {suggestions}?" if close else "the ids are listed at https://ir-datasets.com"
        raise InputError(f"{source}: no ir_datasets dataset has the id {name!r}; {hint}") from None
    if not getattr(dataset, f"has_{what}")():
        provides = [p for p in ("docs", "queries", "qrels", "scoreddocs") if getattr(dataset, f"has_{p}")()]
        offered = ", ".join(provides) if provides else "nothing"
        raise InputError(
            f"{source}: this dataset has no {what} (it provides {offered}); choose a subset that has "
            f"{what}, e.g. a dev or test split (https://ir-datasets.com lists what each provides)"
        )
    return dataset


def _records(source: str, what: str) -> Iterator[Any]:
    """The dataset's ``what`` records, one at a time; ir_datasets' own failures (a download that cannot
    be made, a corrupt cache) become one line naming the dataset."""
    dataset = load(source, what)
    iterator = getattr(dataset, f"{what}_iter")()
    while True:
        try:
            with _quiet_failed_downloads():
                record = next(iterator)
        except StopIteration:
            return
        except MaxsimError:
            raise
        except Exception as exc:  # noqa: BLE001 - a third party's download or parse error, reported in one line
            raise _failure(source, what, exc) from None
        yield record


# How ir_datasets' lines about a failed download attempt begin (`ir_datasets.util.download`).
_FAILED_ATTEMPT = ("download error", "Download failed")


class _FailedAttempts(logging.Filter):
    """Drops ir_datasets' lines about failed download attempts logged by one thread."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread or not str(record.msg).startswith(_FAILED_ATTEMPT)


@contextlib.contextmanager
def _quiet_failed_downloads() -> Iterator[None]:
    """While inside, this thread's failed download attempts log nothing: a failure is reported once,
    by `_failure`, instead of ir_datasets' five lines and a traceback per mirror."""
    import ir_datasets

    logger = ir_datasets.log.easy().logger()  # ir_datasets' one logger, "ir_datasets"
    quiet = _FailedAttempts()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def cache_folder() -> str:
    """Where ir_datasets keeps its downloads: ``$IR_DATASETS_HOME``, else ``~/.ir_datasets``."""
    return os.environ.get("IR_DATASETS_HOME") or os.path.join(os.path.expanduser("~"), ".ir_datasets")


def _failure(source: str, what: str, exc: BaseException) -> MaxsimError:
    """ir_datasets' failure to read ``what`` as one line: for a download that could not be made, the
    folder to fill and how; otherwise its message, shortened."""
    folder = cache_folder()
    if _network_failure(exc):
        return MaxsimError(
            f"{source}: ir_datasets could not download the {what} (no network here?); its first use "
            f"downloads the dataset into {folder}: run it once on a machine with network access and copy "
            "that folder here, or set IR_DATASETS_HOME to a folder that holds the dataset"
        )
    message = " ".join(str(exc).split()) or type(exc).__name__
    if len(message) > 200:
        message = message[:197] + "..."
    return MaxsimError(
        f"{source}: ir_datasets could not read the {what}: {message}; check the cache in {folder} (a "
        "damaged download is fetched again once its folder there is removed)"
    )


# What requests' and urllib3's errors for an unreachable server are called (ConnectionError,
# ConnectTimeout, NameResolutionError, MaxRetryError, ...); an HTTP error status is not one of them.
_NETWORK_WORDS = ("Connection", "Timeout", "NameResolution", "MaxRetry")


def _network_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is, or wraps, a failure to reach a server: a connection, name lookup or timeout
    error, or requests' / urllib3's own (also inside ir_datasets' "All download sources failed")."""
    pending: list[Any] = [exc]
    seen: set[int] = set()
    while pending:
        item = pending.pop()
        if isinstance(item, (list, tuple)):
            pending.extend(item)
            continue
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (ConnectionError, TimeoutError, socket.gaierror)):
            return True
        kind = type(item)
        if kind.__module__.split(".")[0] in ("requests", "urllib3") and any(
            word in kind.__name__ for word in _NETWORK_WORDS
        ):
            return True
        pending.extend([item.__cause__, item.__context__, *item.args])
    return False


def iter_qrels(source: str) -> Iterator[tuple[str, str, int, int]]:
    """``(qid, docno, relevance, record_number)`` for each judgement of the dataset (numbered from 1),
    a repeated (qid, docno) kept at its first record."""
    seen: set[tuple[str, str]] = set()
    count = 0
    for number, qrel in enumerate(_records(source, "qrels"), 1):
        key = (str(qrel.query_id), str(qrel.doc_id))
        _check_ids(source, "judgement", number, *key)
        if key in seen:
            continue
        seen.add(key)
        count += 1
        yield key[0], key[1], int(qrel.relevance), number
    if count == 0:
        raise InputError(f"{source}: the dataset's qrels are empty; choose a split with judgements")


def iter_scoreddocs(source: str) -> Iterator[tuple[str, str, float, int]]:
    """``(qid, docno, score, record_number)`` for each scored document of the dataset's first-stage run
    (numbered from 1), a docno repeated within a query kept at its first record."""
    seen: dict[str, set[str]] = {}
    count = 0
    for number, row in enumerate(_records(source, "scoreddocs"), 1):
        qid, docno, score = str(row.query_id), str(row.doc_id), float(row.score)
        _check_ids(source, "scored document", number, qid, docno)
        docs = seen.setdefault(qid, set())
        if docno in docs:
            continue
        if not math.isfinite(score):
            raise InputError(
                f"{source}: scored document {number} (query {qid!r}, docno {docno!r}) has score {score}; "
                "scores must be finite"
            )
        docs.add(docno)
        count += 1
        yield qid, docno, score, number
    if count == 0:
        raise InputError(f"{source}: the dataset's scoreddocs are empty; choose a split with a run")


def _check_ids(source: str, what: str, number: int, qid: str, docno: str) -> None:
    """The format's id rule for a record's query id and docno, as for a run or qrels file: a NUL or a
    space in an id would reach the TREC run."""
    from maxsim_cli.shards.format import check_id

    check_id(source, qid, f"in {what} {number}", what="query id")
    check_id(source, docno, f"in {what} {number}", what="docno")


def read_qrels(source: str) -> dict[str, dict[str, int]]:
    """``qid -> {docno: relevance}``, qids in the dataset's order (as `maxsim_cli.run_files.read_qrels`)."""
    qrels: dict[str, dict[str, int]] = {}
    for qid, docno, relevance, _ in iter_qrels(source):
        qrels.setdefault(qid, {})[docno] = relevance
    return qrels


def read_run(source: str) -> dict[str, list[tuple[str, float]]]:
    """``qid -> [(docno, score), ...]`` from the dataset's scoreddocs (as `maxsim_cli.run_files.read_run`)."""
    run: dict[str, list[tuple[str, float]]] = {}
    for qid, docno, score, _ in iter_scoreddocs(source):
        run.setdefault(qid, []).append((docno, score))
    return run
