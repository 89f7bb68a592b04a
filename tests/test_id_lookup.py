"""A rerank's candidates are looked up in an id lookup built once per corpus (`Corpus.id_lookup`,
`maxsim_cli.shards.lookup`): every id found at its ordinal and nothing else, whatever the hashes, in
16 bytes a document; the candidates located as a dict of every id locates them (so the runs are those
of before, bit for bit); and a rerank through the API, the engine of `maxsim score` or `maxsim serve`
touches its candidates only, never every id of the corpus."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from test_score import make_corpus, make_queries

import maxsim_cli
from maxsim_cli import open_corpus, rerank
from maxsim_cli.errors import InputError
from maxsim_cli.scoring import direct
from maxsim_cli.scoring.engine import locate_candidates
from maxsim_cli.scoring.results import DocnoRows
from maxsim_cli.shards import Corpus, Shard, lookup, write_shard
from maxsim_cli.shards import corpus as shard_corpus
from maxsim_cli.shards import format as shard_format


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup") / "corpus"
    make_corpus(root, dtype="float32", seed=7)  # three shards (safetensors, arrow), docnos shuffled
    # ids of every length and script, in a shard of their own
    odd = ["x", "中文", "a" * 300, "é", "x0", "\u00e9t\u00e9"]
    write_shard(root / "shard3.parquet", odd, [torch.ones(1, 16)] * len(odd), dtype="float32")
    return str(root)


@pytest.fixture(scope="module")
def queries(tmp_path_factory):
    path = tmp_path_factory.mktemp("lookup-q") / "queries.safetensors"
    make_queries(path, n=5, dtype="float32", seed=9)
    return maxsim_cli.read_queries(path)


def _python_hash(data: bytes) -> int:
    """`lookup.hash_utf8` of one string, in Python integers: the definition."""
    mask = (1 << 64) - 1
    h = sum(b * pow(lookup._MULTIPLIER, j, 1 << 64) for j, b in enumerate(data)) & mask
    h ^= (len(data) * int(lookup._LENGTH_MIX)) & mask
    h ^= h >> 30
    h = (h * int(lookup._MIX_1)) & mask
    h ^= h >> 27
    h = (h * int(lookup._MIX_2)) & mask
    return h ^ (h >> 31)


def test_the_hash_is_its_definition_whatever_the_pieces(monkeypatch) -> None:
    words = ["", "a", "ab", "中文", "z" * 1000, "doc123", "\x00", "\x00\x00"] * 2
    data, offsets = lookup.encode_docnos(words)
    want = [_python_hash(w.encode()) for w in words]
    for piece in (1, 7, 1 << 18):  # one id a piece, several, all of them (an id longer than a piece too)
        monkeypatch.setattr(lookup, "HASH_CHUNK_BYTES", piece)
        monkeypatch.setattr(lookup, "_tables", (np.ones(1, np.uint64), np.ones(1, np.uint64)))
        assert lookup.hash_utf8(data, offsets).tolist() == want, piece


def test_every_id_is_found_at_its_ordinal_and_nothing_else(corpus_path) -> None:
    with open_corpus(corpus_path) as corpus:
        ids = corpus.ids
        found = corpus.id_lookup()
        assert corpus.id_lookup() is found  # built once, kept with the corpus
        asked = [*ids, "missing", ids[3], "\ud800", "", "中", ids[0] + " "]
        assert found.ordinals_of(asked).tolist() == [*range(len(ids)), -1, 3, -1, -1, -1, -1]
        assert found.ordinals_of([]).tolist() == []
        # 16 bytes a document at most: the hash, the ordinal, the directory
        assert found.nbytes <= 16 * len(ids) + 64
        # `candidate_index` answers through it
        index = corpus.candidate_index(["missing", ids[-1], ids[0]])
        last = len(corpus.shards) - 1
        assert index == {ids[-1]: (last, corpus.shards[last].num_docs - 1), ids[0]: (0, 0)}


@pytest.mark.parametrize(
    "weaken",
    [
        0x3,  # four hashes for every id: a bucket over the directory's width, binary search
        0xFF00_0000_0000_0000,  # 256 hashes, equal runs inside the directory's buckets
    ],
)
def test_ids_that_share_a_hash_are_told_apart(corpus_path, monkeypatch, weaken) -> None:
    real = lookup.hash_utf8
    monkeypatch.setattr(lookup, "hash_utf8", lambda data, offsets: real(data, offsets) & np.uint64(weaken))
    with open_corpus(corpus_path) as corpus:
        ids = corpus.ids
        asked = [*reversed(ids), "missing", "doc9999", ids[5]]
        got = corpus.id_lookup().ordinals_of(asked)
        assert got.tolist() == [*reversed(range(len(ids))), -1, -1, 5]
        assert (corpus.id_lookup().width > lookup.MAX_BUCKET_WIDTH) == (weaken == 0x3)


def _located_through_every_id(corpus, run, qids):
    """What `locate_candidates` gave when it looked candidates up in a dict of every id: the pairs in
    (run order of the queries, run order of each query's candidates), found docnos per query, and the
    missing ones (count, first three distinct)."""
    every = corpus.id_index()
    qindex = {q: i for i, q in enumerate(qids)}
    pair_query, pair_doc, docnos_of, missing = [], [], {}, []
    for qid, cands in run.items():
        kept = []
        for docno, _ in cands:
            where = every.get(docno)
            if where is None:
                missing.append(docno)
                continue
            pair_query.append(qindex[qid])
            pair_doc.append(int(corpus.doc_starts[where[0]]) + where[1])
            kept.append(docno)
        docnos_of[qindex[qid]] = kept
    return pair_query, pair_doc, docnos_of, missing


def test_candidates_are_located_as_a_dict_of_every_id_locates_them(corpus_path, queries) -> None:
    """The pairs handed to the kernels and the docnos of each query, hence the scores and the run's
    bytes, are those of the lookup in a dict of every id; so are the warning and the strict error."""
    with open_corpus(corpus_path) as corpus:
        ids, qids = corpus.ids, list(queries.ids)
        rng = np.random.default_rng(3)
        run = {
            qids[3]: [(ids[i], 0.0) for i in rng.choice(len(ids), 20, replace=False)] + [("gone-1", 0.0)],
            qids[0]: [("gone-2", 1.0), (ids[-1], 0.5), ("gone-1", 0.2), ("gone-3", 0.1), ("gone-4", 0.0)],
            qids[4]: [],
            qids[1]: [(ids[i], 0.0) for i in range(len(ids) - 1, -1, -7)],
        }
        notes: list[str] = []
        got = locate_candidates(corpus, run, qids, "queries", "run.trec", False, corpus.paths, notes.append)
        pair_query, pair_doc, docnos_of, missing = _located_through_every_id(corpus, run, qids)
        assert got.pair_query.tolist() == pair_query and got.pair_doc.tolist() == pair_doc
        assert got.pair_query.dtype == got.pair_doc.dtype == np.int64
        assert got.docnos_of == docnos_of and got.missing == len(missing) == 5
        assert notes == [
            "warning: run.trec: 5 candidates are not in the corpus, e.g. 'gone-1', 'gone-2', 'gone-3'; "
            "they are left out (--strict makes this an error)"
        ]
        with pytest.raises(
            InputError, match=r"5 candidates are not in the corpus \(.*\), e\.g\. 'gone-1', 'gone-2'"
        ):
            locate_candidates(corpus, run, qids, "queries", "run.trec", True, corpus.paths, notes.append)
        whole = {qids[2]: [(d, 0.0) for d in ids]}
        got = locate_candidates(corpus, whole, qids, "queries", "run.trec", True, corpus.paths, notes.append)
        assert got.pair_doc.tolist() == list(range(len(ids))) and got.missing == 0


def _never(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"a rerank touched every id of the corpus ({what})")

    return fail


class _IdList(list):
    """A shard's id list that may be sliced (a batch's ids) but not gone through whole."""

    def _whole(self, *args, **kwargs):
        raise AssertionError("a rerank touched every id of the corpus (a shard's id list, whole)")

    __iter__ = __contains__ = __reversed__ = index = count = copy = _whole


def _untouchable_ids(corpus, monkeypatch) -> list[int]:
    """From now on, going through a list of every id of the corpus fails, and the ids hashed are
    counted."""
    hashed: list[int] = []
    real = lookup.hash_utf8

    def counted(data, offsets):
        hashed.append(len(offsets) - 1)
        return real(data, offsets)

    monkeypatch.setattr(lookup, "hash_utf8", counted)
    monkeypatch.setattr(pa.compute, "index_in", _never("Arrow's index_in"))
    for module in (shard_format, shard_corpus):
        monkeypatch.setattr(module, "concat_ids", _never("concat_ids"))
        monkeypatch.setattr(module, "sorted_id_order", _never("sorted_id_order"))
    for shard in corpus.shards:
        monkeypatch.setattr(shard, "_ids", _IdList(shard.ids))
    monkeypatch.setattr(Shard, "id_array", property(_never("Shard.id_array")))
    monkeypatch.setattr(Corpus, "ids", property(_never("Corpus.ids")))
    for name in ("id_index", "ordinal_index", "id_order"):
        monkeypatch.setattr(Corpus, name, _never(f"Corpus.{name}"))
    return hashed


@pytest.mark.parametrize("path", ["api-resident", "api-streamed", "serve"])
def test_a_rerank_touches_its_candidates_not_every_id(corpus_path, queries, monkeypatch, path) -> None:
    """After the first call (which builds the lookup), a rerank hashes no more ids than it has
    candidates and reads no list of every id: its cost does not grow with the corpus."""
    from maxsim_cli.service.batching import Job, Scorer
    from maxsim_cli.service.schema import Parsed

    with open_corpus(corpus_path) as corpus:
        ids = corpus.ids
        if path != "api-streamed":
            corpus.to("cpu")
        rng = np.random.default_rng(11)
        cands = {q: [ids[i] for i in rng.choice(len(ids), 9, replace=False)] for q in queries.ids[:3]}
        cands[queries.ids[0]].append("missing")
        asked = sum(len(c) for c in cands.values())

        def call():
            if path == "serve":
                answers = Scorer(corpus, device="cpu").score([Job("rerank", Parsed(queries, None, cands))])[0]
                return [(qid, list(hits), missing) for qid, hits, missing in answers]
            with pytest.warns(maxsim_cli.MaxsimWarning, match="1 candidates are not in the corpus"):
                run = rerank(queries, corpus, cands, device="cpu")
            assert run.stats.extra.get("direct") is (True if path == "api-resident" else None)
            return run.to_dict()

        expected = call()
        if path == "serve":
            corpus.rank_of_ordinal()  # made once for a served corpus (the tie-break of its answers)
        hashed = _untouchable_ids(corpus, monkeypatch)
        assert call() == expected
        assert 0 < sum(hashed) <= asked


def test_the_api_rerank_goes_through_the_servers_launcher(corpus_path, queries, monkeypatch) -> None:
    """On CUDA a float corpus's small rerank is scored by the residency's reused launcher
    (`ResidentCandidates`), as `maxsim serve` scores it: here on the CPU under Triton's interpreter, its
    run is the engine's (the generic Triton launch) bit for bit."""
    monkeypatch.setattr(direct, "_staged", lambda corpus, residency, backend: backend == "triton")
    with open_corpus(corpus_path) as corpus:
        corpus.to("cpu")
        ids = corpus.ids
        cands = {q: ids[i::5][:6] for i, q in enumerate(queries.ids)}
        run = rerank(queries, corpus, cands, backend="triton")
        assert run.stats.extra.get("direct") is True and corpus.residency.candidates is not None
        with monkeypatch.context() as patch:
            patch.setattr(direct, "eligible", lambda *args: None)
            engine_run = rerank(queries, corpus, cands, backend="triton")
        assert engine_run.stats.extra.get("direct") is None
        assert run.to_dict() == engine_run.to_dict() and len(run) == sum(map(len, cands.values()))


@pytest.mark.parametrize(
    "words",
    [
        ["d1", "doc22", "", "x"],
        ["a\x1fb", "c", "\x1f", ""],  # the separator inside docnos: measured one by one
        ["中文", "é", "a\x1f中", "z" * 300],
        ["only"],
        [],
    ],
)
def test_docnos_are_encoded_as_their_utf8_bytes_one_after_another(words) -> None:
    data, offsets = lookup.encode_docnos(words)
    encoded = [w.encode() for w in words]
    assert bytes(data) == b"".join(encoded)
    assert offsets.tolist() == np.cumsum([0, *map(len, encoded)]).tolist()


def test_a_docno_of_an_ids_length_and_hash_but_other_bytes_is_not_found(corpus_path, monkeypatch) -> None:
    # every hash equal: each docno's first entry is some id of the corpus, compared byte for byte
    monkeypatch.setattr(lookup, "hash_utf8", lambda data, offsets: np.zeros(len(offsets) - 1, np.uint64))
    with open_corpus(corpus_path) as corpus:
        ids = corpus.ids
        first = corpus.id_lookup().ordinals[0]
        twin = "".join(chr(ord(c) ^ 1) for c in ids[first])  # same length, other bytes
        assert twin not in ids
        assert corpus.id_lookup().ordinals_of([ids[first], twin]).tolist() == [int(first), -1]


@pytest.mark.parametrize(
    ("docnos", "counts", "hashes", "repeat"),
    [
        (["a", "b", "c"], [3], None, -1),
        (["a", "b", "a", "b"], [4], None, 2),
        (["a", "b", "a", "c"], [2, 2], None, -1),  # one docno in two queries: once each
        (["a", "b", "b", "a", "a"], [2, 3], None, 4),
        # every hash equal: the docnos decide, whichever neighbours the sort gives
        (["x", "y", "x"], [3], "equal", 2),
        (["x", "y", "z"], [3], "equal", -1),
        (["x", "y", "x", "y"], [2, 2], "equal", -1),
        (["x"], [1], None, -1),
        ([], [0], None, -1),
    ],
)
def test_first_repeat_finds_the_first_docno_its_query_lists_again(docnos, counts, hashes, repeat) -> None:
    data, offsets = lookup.encode_docnos(docnos)
    h = lookup.hash_utf8(data, offsets) if hashes is None else np.zeros(len(docnos), np.uint64)
    assert lookup.first_repeat(h, np.array(counts), docnos) == repeat


def test_a_docno_listed_twice_is_one_line_naming_it_and_its_query(corpus_path) -> None:
    # the check is the lookup's (hashes), for the API's docno lists as for any other run, found or not
    with open_corpus(corpus_path) as corpus:
        ids = corpus.ids
        for lists in ({"q1": [ids[0], ids[1], ids[0]]}, {"q1": [ids[0]], "q2": [ids[2], "nope", "nope"]}):
            qid, twice = list(lists)[-1], lists[list(lists)[-1]][-1]
            for run in ({q: [(d, 0.0) for d in docnos] for q, docnos in lists.items()},
                        {q: DocnoRows(docnos, lookup.join_docnos(docnos)) for q, docnos in lists.items()}):
                with pytest.raises(InputError, match=f"docno '{twice}' appears twice for query '{qid}'"):
                    locate_candidates(corpus, run, ["q1", "q2"], "q.st", "candidates", False, [], print)


def test_docnos_given_as_str_subclasses_are_located_as_their_strings(corpus_path) -> None:
    with open_corpus(corpus_path) as corpus:
        ids = corpus.ids[:5]
        expected = corpus.id_lookup().ordinals_of(ids).tolist()
        got = corpus.id_lookup().locate([np.str_(i) for i in ids], lookup.join_docnos(ids))[0]
        assert got.tolist() == expected == list(range(5))
