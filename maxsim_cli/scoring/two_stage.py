"""The two-stage search (`maxsim score COMPRESSED --exact-from CORPUS`, ``search(..., exact_from=...)``):
the compressed tier (int8, or the codes of `maxsim quantize --bits 4/2`) is scanned for each query's
top ``depth``, then those candidates are scored exactly from CORPUS, the corpus the tier was quantized
from, by the engine's rerank path (which reads only the candidates' rows), and the top k written with
their exact scores. `maxsim_cli.scoring.dispatch` plans and runs it (the ``two-stage`` path); this
module holds its parts: the two stages' requests, the check that both tiers hold the same documents,
the stats of the whole, and the opening of its inputs for `maxsim score`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from maxsim_cli.codecs import CODE_QUANTIZATIONS, check_same_documents, ids_sha256
from maxsim_cli.errors import EXACT_FROM, InputError
from maxsim_cli.queries import read_queries
from maxsim_cli.run_files import RunWriter
from maxsim_cli.scoring.engine import Logger
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.resources import corpus_name
from maxsim_cli.scoring.stats import ScoreStats
from maxsim_cli.shards import Corpus, check_same_dim, input_notes, open_corpus, report_notes
from maxsim_cli.shards.files import check_output

TwoStageRunner = Callable[..., ScoreStats]


def tier_names(request: ScoreRequest, compressed: Corpus, exact: Corpus) -> tuple[str, str]:
    """The two tiers as messages name them: the paths given, or an in-memory corpus's name."""
    scan_name = corpus_name(request.corpus) if compressed.paths else compressed.name
    assert request.exact_from is not None
    exact_name = corpus_name(request.exact_from) if exact.paths else exact.name
    return scan_name, exact_name


def stage_requests(
    request: ScoreRequest, compressed: Corpus, scan_name: str
) -> tuple[ScoreRequest, ScoreRequest]:
    """The requests of the two stages: the compressed scan keeps each query's top ``depth``; the exact
    stage reranks those candidates from ``exact_from`` and keeps ``top_k``."""
    assert request.exact_from is not None
    depth = request.search_depth(compressed.quantization)
    scan = dataclasses.replace(request, top_k=depth, exact_from=None, depth=None)
    exact = dataclasses.replace(
        request,
        corpus=request.exact_from,
        candidates=f"the top {depth} of {scan_name}",
        exact_from=None,
        depth=None,
    )
    return scan, exact


class ScanCandidates:
    """The compressed scan's sink (`dispatch.run_two_stage`): each query's top ``depth``, kept as corpus
    ordinals where the scan hands them over so (``write_ordinals``: an exhaustive pass, resident or
    streamed), else as the docnos it writes (``write_ranked``, ``write_query``: a filter's few documents
    scored as candidates, a pass over several devices). `candidates` is the exact stage's run: with
    ordinals, rows that carry them (`DocnoRows.ordinals`), so that the exact stage looks no docno up. The
    tiers hold the same documents in one order (`check_tiers`, made before the scan)."""

    def __init__(self, qids: Sequence[str]) -> None:
        self.qids = list(qids)
        self._ordinals: list[np.ndarray] = []  # [queries, m] blocks in query order
        self._rows: dict[str, list[tuple[str, float]]] = {}

    def write_ordinals(self, scores: np.ndarray, ordinals: np.ndarray) -> None:
        self._ordinals.append(np.asarray(ordinals, dtype=np.int64))

    def write_ranked(self, qids: Sequence[str], docnos: Any, scores: np.ndarray, **_checked: Any) -> None:
        m = scores.shape[1] if scores.ndim == 2 else 0
        listed = docnos.to_pylist()
        for i, qid in enumerate(qids):
            self.write_query(qid, listed[i * m : (i + 1) * m], scores[i].tolist())

    def write_query(self, qid: str, docnos: Sequence[str], scores: Sequence[float]) -> None:
        self._rows[qid] = list(zip(docnos, scores, strict=True))

    def candidates(self, corpus: Corpus) -> dict[str, Any]:
        """Each query's candidates, as `rerank` takes them (``corpus``: the scanned tier, for the ids)."""
        if not self._ordinals:
            return self._rows
        from maxsim_cli.arrays import values_array
        from maxsim_cli.scoring.results import DocnoRows, ids_by_ordinal

        ordinals = np.concatenate(self._ordinals, axis=0) if len(self._ordinals) > 1 else self._ordinals[0]
        m = ordinals.shape[1]
        docnos = ids_by_ordinal(corpus).take(values_array(ordinals.reshape(-1))).to_pylist()
        return {
            qid: DocnoRows(docnos[i * m : (i + 1) * m], ordinals=ordinals[i])
            for i, qid in enumerate(self.qids[: ordinals.shape[0]])
            if m
        }


def exact_on_scan_device(exact_request: ScoreRequest, exact: Corpus, scan_device: str) -> ScoreRequest:
    """The exact stage's request once the scan has run on ``scan_device``: with ``device="auto"``, an
    exact tier resident in host memory (``exact.to("cpu")``) is scored on the GPU the scan ran on, its
    candidates' rows staged there (`maxsim_cli.scoring.host_rows`), not by the CPU; any other request as
    it is (a tier resident on a GPU is scored there, one on disk where ``auto`` resolves)."""
    residency = exact.residency
    if exact_request.device.strip().lower() != "auto" or not scan_device.startswith("cuda"):
        return exact_request
    if residency is None or exact.placement is not None or residency.device.type != "cpu":
        return exact_request
    return dataclasses.replace(exact_request, device=scan_device)


def check_tiers(request: ScoreRequest, compressed: Corpus, exact: Corpus) -> None:
    """Both tiers hold the same documents (the compressed tier records the corpus it was quantized
    from), the exact one in full precision: `InputError`s naming both."""
    check_pair(compressed, exact, *tier_names(request, compressed, exact))


def check_pair(compressed: Corpus, exact: Corpus, scan_name: str, exact_name: str) -> None:
    """`check_tiers` with the tiers' names given (`maxsim serve --exact-from` checks them at start-up).
    The sha256 of the exact tier's ids is computed once per open corpus and kept (`_ids_digest`): a
    server's search checks its tiers at every request."""
    if exact.quantization in CODE_QUANTIZATIONS:
        raise InputError(
            f"{exact_name}: holds {exact.quantization} codes, not exact scores; {EXACT_FROM} takes the "
            "corpus they were quantized from"
        )
    check_same_documents(compressed, exact, scan_name, exact_name, _ids_digest(exact))


# open corpus -> (its shards when hashed, their ids' sha256): one hash of every id per corpus, not per call
_DIGESTS: weakref.WeakKeyDictionary[Corpus, tuple[tuple[int, ...], str]] = weakref.WeakKeyDictionary()


def _ids_digest(corpus: Corpus) -> str:
    """`codecs.ids_sha256` of ``corpus``'s ids, kept while its shards are the same objects."""
    shards = tuple(id(shard) for shard in corpus.shards)
    try:
        kept = _DIGESTS.get(corpus)
    except TypeError:  # a corpus that cannot be weakly referenced: hashed every time
        return ids_sha256(corpus.shards)
    if kept is not None and kept[0] == shards:
        return kept[1]
    digest = ids_sha256(corpus.shards)
    with contextlib.suppress(TypeError):
        _DIGESTS[corpus] = (shards, digest)
    return digest


def merge_stats(request: ScoreRequest, compressed: Corpus, scan: ScoreStats, exact: ScoreStats) -> ScoreStats:
    """The stats of the whole: the exact stage's, as mode ``two-stage``, with the scan's counts and times
    under ``two_stage`` and the times of both added."""
    stats = dataclasses.replace(exact, extra=dict(exact.extra))
    stats.mode = "two-stage"
    stats.output = request.output
    for name in ("wall_s", "read_s", "copy_s", "score_s", "wait_s", "setup_s", "write_s"):
        setattr(stats, name, getattr(scan, name) + getattr(exact, name))
    stats.bytes_read = scan.bytes_read + exact.bytes_read
    if scan.peak_gpu_bytes is not None:
        stats.peak_gpu_bytes = max(scan.peak_gpu_bytes, exact.peak_gpu_bytes or 0)
    stats.peak_host_bytes = max(scan.peak_host_bytes, exact.peak_host_bytes)
    stats.extra.pop("scores", None)
    stats.extra.pop("quantization", None)
    stats.extra["scores"] = "exact"
    if "filter" in scan.extra:  # the filter applies to the scan: its candidates are allowed documents
        stats.extra["filter"] = scan.extra["filter"]
    stats.extra["two_stage"] = {
        "depth": request.search_depth(compressed.quantization),
        "compressed_quantization": compressed.quantization,
        "scan_documents": scan.documents,
        "scan_tokens": scan.tokens,
        "scan_pairs": scan.pairs,
        "scan_bytes_read": scan.bytes_read,
        "scan_wall_s": scan.wall_s,
        "exact_pairs": exact.pairs,
        "exact_bytes_read": exact.bytes_read,
        "exact_wall_s": exact.wall_s,
    }
    return stats


def score_files(request: ScoreRequest, run: TwoStageRunner, *, log: Logger) -> ScoreStats:
    """`maxsim score QUERIES COMPRESSED --exact-from CORPUS`: open both tiers and the queries, and hand
    them to ``run`` (`dispatch.run_two_stage`) with the run file as the sink; both corpora are closed on
    every exit path, and nothing is written before the exact stage writes the run."""
    started = time.perf_counter()
    request.check()
    assert request.exact_from is not None
    check_output(request.output, [request.queries, *request.corpus, *request.exact_from])
    writer = RunWriter(request.output, tag=request.run_tag, fmt=request.fmt)  # opens only in the pass
    with open_corpus(list(request.corpus)) as compressed, open_corpus(list(request.exact_from)) as exact:
        queries = read_queries(request.queries).batch
        check_same_dim(queries, request.query_name, compressed)
        check_same_dim(queries, request.query_name, exact)
        notes = input_notes(compressed) + input_notes(exact, queries, request.query_name)
        report_notes(notes, strict=request.strict, log=log)
        disallowed = None
        if request.filtered:
            from maxsim_cli.scoring.files import request_filter

            # over the exact corpus, which carries the metadata columns (a tier has none) and the
            # deletions; checked to hold the tier's documents in its order before the scan uses it
            check_tiers(request, compressed, exact)
            disallowed = request_filter(request, exact, log)
        stats = run(request, compressed, exact, queries, writer, log=log, disallowed=disallowed)
    stats.wall_s = time.perf_counter() - started
    return stats


__all__ = [
    "check_pair",
    "check_tiers",
    "exact_on_scan_device",
    "ScanCandidates",
    "merge_stats",
    "score_files",
    "stage_requests",
    "tier_names",
]
