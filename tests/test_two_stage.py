"""The two-stage search: a compressed tier scanned for each query's top depth, those candidates scored
exactly from the corpus it was quantized from (`maxsim score --exact-from`, ``search(exact_from=)``)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tierlib import quantize
from typer.testing import CliRunner

from maxsim_cli import search
from maxsim_cli.cli import app
from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.scoring.request import default_depth
from maxsim_cli.shards import write_shard

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "sample_data")
QUERIES = os.path.join(SAMPLE, "queries.safetensors")
CORPUS = os.path.join(SAMPLE, "corpus")


@pytest.fixture(scope="module")
def tiers(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """sample_data's corpus quantized to int8, 4-bit and 2-bit codes."""
    root = tmp_path_factory.mktemp("tiers")
    folders = {}
    for bits in (8, 4, 2):
        folders[bits] = str(root / f"bits{bits}")
        quantize(CORPUS, folders[bits], bits)
    return folders


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """Random ragged float32 data (dim 24, 1-40 tokens a document, 2 shards) and its 4-bit codes."""
    root = tmp_path_factory.mktemp("ragged")
    gen = torch.Generator().manual_seed(7)
    corpus = root / "corpus"
    corpus.mkdir()
    for s in range(2):
        docs = [torch.randn(int(n), 24, generator=gen) for n in torch.randint(1, 41, (60,), generator=gen)]
        write_shard(str(corpus / f"s{s}.safetensors"), [f"s{s}d{i}" for i in range(60)], docs)
    queries = str(root / "queries.safetensors")
    write_shard(queries, [f"q{i}" for i in range(6)], [torch.randn(5, 24, generator=gen) for _ in range(6)])
    codes = str(root / "codes")
    quantize(str(corpus), codes, 4)
    return queries, str(corpus), codes


def _score(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["score", *args, "--device", "cpu"])
    return result.exit_code, result.output


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_two_stage_run_is_bitwise_the_exact_run(tiers, bits, tmp_path):
    exact, two = tmp_path / "exact.trec", tmp_path / "two.trec"
    code, out = _score(QUERIES, CORPUS, "-k", "10", "-o", str(exact), "-q")
    assert code == 0, out
    code, out = _score(QUERIES, tiers[bits], "-k", "10", "--exact-from", CORPUS, "-o", str(two), "-q")
    assert code == 0, out
    assert two.read_bytes() == exact.read_bytes()


def test_scores_are_the_exact_ones_of_the_same_documents_at_a_small_depth(ragged):
    """At a depth where the compressed tier misses some of the exact top k (depth = k: 25 of the 30
    exact top-5 rows found), every row returned still carries the exact score of its document, bit for
    bit."""
    queries, corpus, codes = ragged
    everything = search(queries, corpus, k=120, device="cpu").to_dict()
    top5 = {q: {d for d, _ in rows[:5]} for q, rows in everything.items()}
    two = search(queries, codes, k=5, exact_from=corpus, depth=5, device="cpu")
    assert sum(len(top5[q] & {d for d, _ in rows}) for q, rows in two.to_dict().items()) < 30
    assert two.stats.mode == "two-stage" and two.stats.extra["scores"] == "exact"
    for qid, rows in two.to_dict().items():
        exact = dict(everything[qid])
        assert len(rows) == 5
        for docno, score in rows:
            assert torch.tensor(score).float().item() == torch.tensor(exact[docno]).float().item()


def test_recall_of_the_exact_top_k_at_the_default_depth_on_sample_data(tiers):
    exact = search(QUERIES, CORPUS, k=100, device="cpu").to_dict()
    for bits in (4, 2):
        two = search(QUERIES, tiers[bits], k=100, exact_from=CORPUS, device="cpu").to_dict()
        for k in (10, 100):
            hits = [len({d for d, _ in exact[q][:k]} & {d for d, _ in two[q][:k]}) / k for q in exact]
            assert sum(hits) / len(hits) >= 0.99, (bits, k)
    assert default_depth("int4-per-token", 100) >= 400  # above the corpus: every document found


def test_recall_at_a_measured_depth_below_the_corpus_size(tiers):
    """2-bit codes of sample_data: the exact top 10 within the compressed top 50 (docs/two-stage.md)."""
    exact = search(QUERIES, CORPUS, k=10, device="cpu").to_dict()
    approx = search(QUERIES, tiers[2], k=50, device="cpu").to_dict()
    hits = [len({d for d, _ in exact[q]} & {d for d, _ in approx[q]}) / 10 for q in exact]
    assert sum(hits) / len(hits) >= 0.99


def test_compressed_run_says_its_scores_are_approximate(tiers, tmp_path):
    stats = tmp_path / "stats.json"
    result = CliRunner().invoke(
        app, ["score", QUERIES, tiers[2], "-k", "5", "-o", str(tmp_path / "r"), "--stats-json", str(stats)]
    )
    assert result.exit_code == 0, result.output
    assert "approximate" in result.output and "--exact-from" in result.output
    report = json.loads(stats.read_text())
    assert report["scores"] == "approximate" and report["quantization"] == "residual2-kmeans"
    code, out = _score(QUERIES, tiers[2], "-k", "5", "--exact-from", CORPUS, "-o", str(tmp_path / "e"))
    assert code == 0 and "the scores are exact" in out


def test_another_corpus_is_refused_in_one_line_naming_both(tiers, tmp_path):
    half = tmp_path / "half"
    quantize(os.path.join(CORPUS, "shard-00000.safetensors"), str(half), 4)
    out = tmp_path / "run.trec"
    code, text = _score(QUERIES, str(half), "-k", "5", "--exact-from", CORPUS, "-o", str(out))
    assert code == 1
    line = text.strip()
    assert "\n" not in line and str(half) in line and CORPUS in line and "quantized from" in line
    assert not out.exists()
    # a float corpus is no compressed tier: it records no source
    code, text = _score(QUERIES, os.path.join(SAMPLE, "corpus.arrow"), "--exact-from", CORPUS, "-o", str(out))
    assert code == 1 and "records no single source corpus" in text and "\n" not in text.strip()
    assert not out.exists()


def test_exact_tier_of_codes_is_refused(tiers, tmp_path):
    code, text = _score(QUERIES, tiers[4], "--exact-from", tiers[2], "-o", str(tmp_path / "r"))
    assert code == 1 and "codes" in text and "\n" not in text.strip()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["-k", "10", "--depth", "5"], "below --top-k 10"),
        (["--depth", "0"], "at least 1"),
        (["--candidates", os.path.join(SAMPLE, "candidates.trec")], "reranked without it"),
        (["--devices", "cpu:2"], "one device"),
    ],
)
def test_usage_errors_exit_2_and_write_nothing(tiers, tmp_path, extra, needle):
    out = tmp_path / "run.trec"
    code, text = _score(QUERIES, tiers[4], "--exact-from", CORPUS, *extra, "-o", str(out))
    assert code == 2, text
    assert needle in text and "\n" not in text.strip()
    assert not out.exists()


def test_depth_without_exact_from_is_a_usage_error(tiers, tmp_path):
    code, text = _score(QUERIES, tiers[4], "--depth", "50", "-o", str(tmp_path / "r"))
    assert code == 2 and "--exact-from" in text


def test_api_names_its_keywords(tiers):
    with pytest.raises(UsageError, match=r"depth=3 is below k=5"):
        search(QUERIES, tiers[4], k=5, exact_from=CORPUS, depth=3, device="cpu")
    with pytest.raises(UsageError, match=r"depth=3 goes with exact_from"):
        search(QUERIES, tiers[4], k=5, depth=3, device="cpu")
    with pytest.raises(InputError, match="records no single source corpus"):
        search(QUERIES, CORPUS, k=5, exact_from=CORPUS, device="cpu")


def test_default_depth_by_codec(tiers):
    assert (default_depth("int4-per-token", 10), default_depth("int4-per-token", 1000)) == (1000, 5000)
    assert (default_depth("residual2-kmeans", 10), default_depth("residual2-kmeans", 1000)) == (2000, 20000)
    run = search(QUERIES, tiers[2], k=10, exact_from=CORPUS, device="cpu")
    assert run.stats.extra["two_stage"]["depth"] == 2000


@pytest.mark.parametrize("bits", [4, 2])
def test_a_resident_compressed_tier_gives_the_streamed_runs(tiers, bits):
    """A tier resident on the device (`Corpus.to`, as `maxsim serve` keeps it) is scored in one launch by
    the direct path, the 2-bit codes with their codebook: the runs of the streamed tier, compressed
    scores and two-stage alike."""
    from maxsim_cli import open_corpus

    streamed = search(QUERIES, tiers[bits], k=20, device="cpu").to_dict()
    two = search(QUERIES, tiers[bits], k=10, exact_from=CORPUS, depth=30, device="cpu").to_dict()
    with open_corpus(tiers[bits]) as compressed:
        compressed.to("cpu")
        assert search(QUERIES, compressed, k=20, device="cpu").to_dict() == streamed
        run = search(QUERIES, compressed, k=10, exact_from=CORPUS, depth=30, device="cpu")
        assert run.to_dict() == two


def test_the_scan_hands_its_candidates_over_as_ordinals():
    """The scan's sink keeps ordinals (`ScanCandidates.write_ordinals`): the exact stage's candidates
    carry them, and locating them gives what looking their docnos up gives; docnos written otherwise
    (``write_ranked``, ``write_query``) stay docnos, looked up as any run's."""
    import numpy as np
    import pyarrow as pa

    from maxsim_cli import open_corpus
    from maxsim_cli.queries import read_queries
    from maxsim_cli.scoring.results import locate_candidates
    from maxsim_cli.scoring.two_stage import ScanCandidates

    qids = list(read_queries(QUERIES).batch.ids)[:3]
    with open_corpus(CORPUS) as corpus:
        rng = np.random.default_rng(0)
        ordinals = np.stack([rng.choice(len(corpus), 7, replace=False) for _ in qids])
        sink = ScanCandidates(qids)
        sink.write_ordinals(np.zeros((2, 7), dtype=np.float32), ordinals[:2])
        sink.write_ordinals(np.zeros((1, 7), dtype=np.float32), ordinals[2:])
        carried = sink.candidates(corpus)
        assert all(rows.ordinals is not None for rows in carried.values())
        looked_up = {qid: [(docno, 0.0) for docno, _ in rows] for qid, rows in carried.items()}

        def located(run):
            return locate_candidates(corpus, run, qids, "q", "c", False, [CORPUS], print)

        fast, slow = located(carried), located(looked_up)
        assert fast.pair_doc.tolist() == slow.pair_doc.tolist() == ordinals.reshape(-1).tolist()
        assert fast.pair_query.tolist() == slow.pair_query.tolist() and fast.docnos_of == slow.docnos_of
        assert fast.pair_docnos.to_pylist() == slow.pair_docnos.to_pylist() and fast.missing == 0

        other = ScanCandidates(qids)
        docnos = [[row[0] for row in looked_up[qid]] for qid in qids[:2]]
        other.write_ranked(qids[:2], pa.array(docnos[0] + docnos[1]), np.ones((2, 7), dtype=np.float32))
        other.write_query(qids[2], [d for d, _ in looked_up[qids[2]]], [0.5] * 7)
        assert {q: [d for d, _ in rows] for q, rows in other.candidates(corpus).items()} == {
            q: [d for d, _ in rows] for q, rows in looked_up.items()
        }
