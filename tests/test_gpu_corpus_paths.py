"""The paths of a corpus that changes and of compressed tiers, on the GPU: filters (ids, masks) and deleted
documents hidden inside the scan, streamed and resident; the two-stage search with the compressed tier
streamed and resident on the GPU, its scores bitwise those of the exact search of the same documents.

Each filtered run is checked against the unfiltered run of the same device (every document's score in a
run depends on that document alone, so a filtered score equals the unfiltered one bit for bit) and its
documents against the expected top k of the allowed documents. Needs a CUDA GPU.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from tierlib import quantize
from typer.testing import CliRunner

from maxsim_cli import open_corpus, search
from maxsim_cli.cli import app

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "sample_data")
QUERIES = os.path.join(SAMPLE, "queries.safetensors")
CORPUS = os.path.join(SAMPLE, "corpus")
ALL = 400  # every document of sample_data
DEVICE = "cuda"


def _cli(*args: str) -> None:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def full() -> dict[str, dict[str, float]]:
    """Every query's score for every document, on the GPU: {qid: {docno: score}}."""
    run = search(QUERIES, CORPUS, k=ALL, device=DEVICE).to_dict()
    return {qid: dict(rows) for qid, rows in run.items()}


@pytest.fixture(scope="module")
def tiers(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("gpu-tiers")
    folders = {}
    for bits in (8, 4, 2):
        folders[bits] = str(root / f"bits{bits}")
        quantize(CORPUS, folders[bits], bits, device=DEVICE)
    return folders


def _expected_top(full: dict, allowed: set[str], k: int) -> dict[str, list[float]]:
    """The scores of the top k of the allowed documents, descending (which of tied documents makes the cut
    is the run writer's rule, checked elsewhere)."""
    out = {}
    for qid, scores in full.items():
        out[qid] = sorted((s for d, s in scores.items() if d in allowed), reverse=True)[:k]
    return out


def _check(run: dict, full: dict, allowed: set[str], k: int) -> None:
    expected = _expected_top(full, allowed, k)
    assert set(run) == set(expected)
    for qid, rows in run.items():
        assert all(d in allowed for d, _ in rows), qid
        assert all(s == full[qid][d] for d, s in rows), qid  # bit for bit
        assert [s for _, s in rows] == expected[qid], qid


@pytest.mark.parametrize("resident", [False, True])
def test_id_filters_on_the_gpu(full, resident) -> None:
    docnos = sorted(next(iter(full.values())))
    include = docnos[::3]
    exclude = set(docnos[::5])
    with open_corpus(CORPUS) as corpus:
        if resident:
            corpus.to(DEVICE)
        run = search(QUERIES, corpus, k=10, include=include, exclude=sorted(exclude), device=DEVICE).to_dict()
    _check(run, full, set(include) - exclude, 10)


def test_a_boolean_mask_on_the_gpu(full) -> None:
    with open_corpus(CORPUS) as corpus:
        ids = list(corpus.ids)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[1::4] = True
        run = search(QUERIES, corpus, k=7, include=mask.numpy(), device=DEVICE).to_dict()
    _check(run, full, {d for d, keep in zip(ids, mask.tolist(), strict=True) if keep}, 7)


@pytest.mark.parametrize("resident", [False, True])
def test_deleted_documents_are_hidden_on_the_gpu(full, tmp_path, resident) -> None:
    corpus_dir = tmp_path / "corpus"
    shutil.copytree(CORPUS, corpus_dir)
    docnos = sorted(next(iter(full.values())))
    gone = set(docnos[::2])
    (tmp_path / "ids.txt").write_text("".join(f"{d}\n" for d in sorted(gone)))
    _cli("delete", corpus_dir, "--ids", tmp_path / "ids.txt")
    with open_corpus(str(corpus_dir)) as corpus:
        if resident:
            corpus.to(DEVICE)
        run = search(QUERIES, corpus, k=10, device=DEVICE).to_dict()
    _check(run, full, set(docnos) - gone, 10)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("resident", [False, True])
def test_two_stage_on_the_gpu_gives_the_exact_scores(full, tiers, bits, resident) -> None:
    with open_corpus(tiers[bits]) as tier:
        if resident:
            tier.to(DEVICE)
        run = search(QUERIES, tier, k=10, exact_from=CORPUS, depth=ALL, device=DEVICE).to_dict()
        # at a depth that holds every document, the exact top 10
        _check(run, full, set(next(iter(full.values()))), 10)
        small = search(QUERIES, tier, k=10, exact_from=CORPUS, depth=20, device=DEVICE).to_dict()
    for qid, rows in small.items():
        assert all(s == full[qid][d] for d, s in rows), qid


def test_two_stage_with_a_filter_on_the_gpu(full, tiers) -> None:
    docnos = sorted(next(iter(full.values())))
    include = docnos[1::2]
    run = search(QUERIES, tiers[4], k=10, exact_from=CORPUS, depth=ALL, include=include, device=DEVICE)
    _check(run.to_dict(), full, set(include), 10)
