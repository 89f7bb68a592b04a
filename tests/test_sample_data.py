"""The committed sample collection: it opens, its counts match its README, its ids agree across files,
and an independent brute-force MaxSim over it retrieves the relevant documents (nDCG@10 well above 0)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from maxsim_cli.run_files import read_qrels, read_run
from maxsim_cli.shards import open_corpus, read_queries

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"


def readme_counts() -> dict[str, int]:
    """The `| what | number |` rows of the README's table of counts."""
    text = (SAMPLE / "README.md").read_text(encoding="utf-8")
    return {
        m[1]: int(m[2].replace(",", "")) for m in re.finditer(r"^\| ([a-z ]+?) +\| +([\d,]+) +\|", text, re.M)
    }


@pytest.fixture(scope="module")
def corpus():
    with open_corpus([SAMPLE / "corpus"]) as c:
        yield c


@pytest.fixture(scope="module")
def queries():
    return read_queries(str(SAMPLE / "queries.safetensors"))


def all_docs(shards) -> tuple[list[str], list[torch.Tensor]]:
    ids, docs = [], []
    for shard in shards:
        batch = shard.read_docs(0, shard.info.num_docs)
        ids += batch.ids
        docs += [batch.embeddings[a:b] for a, b in zip(batch.offsets[:-1], batch.offsets[1:], strict=True)]
    return ids, docs


def test_counts_match_readme(corpus, queries):
    counts = readme_counts()
    assert len(corpus.shards) == counts["shards"] == 2
    assert corpus.num_docs == counts["documents"]
    assert corpus.num_tokens == counts["document tokens"]
    assert queries.num_docs == counts["queries"]
    assert queries.num_tokens == counts["query tokens"]
    assert (corpus.dim, corpus.dtype, corpus.quantization) == (384, "float16", "none")
    assert all(s.info.normalized for s in corpus.shards)
    total = sum(p.stat().st_size for p in SAMPLE.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total <= 10_000_000, f"sample_data/ is {total} bytes, over its 10 MB budget"


def test_arrow_copy_equals_safetensors(corpus):
    with open_corpus([SAMPLE / "corpus.arrow"]) as arrow:
        ids_a, docs_a = all_docs(arrow.shards)
    ids_s, docs_s = all_docs(corpus.shards)
    assert ids_a == ids_s
    assert all(torch.equal(a, s) for a, s in zip(docs_a, docs_s, strict=True))


def test_vectors_are_unit_norm(corpus, queries):
    _, docs = all_docs(corpus.shards)
    norms = torch.cat([d.double().norm(dim=1) for d in docs] + [queries.embeddings.double().norm(dim=1)])
    # float16 keeps 11 significant bits: each component is off by <= 2^-11 relative, so the norm by ~1e-3.
    assert torch.allclose(norms, torch.ones_like(norms), atol=2e-3)


def test_ids_agree_across_files(corpus, queries):
    index = corpus.id_index()
    texts = [json.loads(line) for line in (SAMPLE / "docs.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [t["docno"] for t in texts] == [docno for shard in corpus.shards for docno in shard.ids]
    query_ids = [
        line.split("\t")[0] for line in (SAMPLE / "queries.tsv").read_text(encoding="utf-8").splitlines()
    ]
    assert query_ids == queries.ids
    qrels = read_qrels(str(SAMPLE / "qrels.txt"))
    assert list(qrels) == queries.ids
    assert all(docno in index for judged in qrels.values() for docno in judged)
    candidates = read_run(str(SAMPLE / "candidates.trec"))
    assert set(candidates) <= set(queries.ids)
    assert all(docno in index and 0 < len(rows) <= 100 for rows in candidates.values() for docno, _ in rows)


def test_brute_force_maxsim_finds_relevant_documents(corpus, queries):
    ir_measures = pytest.importorskip("ir_measures")
    ids, docs = all_docs(corpus.shards)
    # float64 reference, padded with -inf so padding never wins a max.
    lengths = [d.shape[0] for d in docs]
    padded = torch.full((len(docs), max(lengths), 384), 0.0, dtype=torch.float64)
    mask = torch.zeros(len(docs), max(lengths), dtype=torch.bool)
    for i, d in enumerate(docs):
        padded[i, : d.shape[0]] = d.double()
        mask[i, : d.shape[0]] = True
    run = {}
    offsets = queries.offsets.tolist()
    for qi, qid in enumerate(queries.ids):
        q = queries.embeddings[offsets[qi] : offsets[qi + 1]].double()
        sim = torch.einsum("qk,dtk->dqt", q, padded).masked_fill(~mask[:, None, :], float("-inf"))
        scores = sim.amax(dim=2).sum(dim=1)
        run[qid] = {docno: float(s) for docno, s in zip(ids, scores.tolist(), strict=True)}
    qrels = read_qrels(str(SAMPLE / "qrels.txt"))
    measures = ir_measures.calc_aggregate([ir_measures.nDCG @ 10], qrels, run)
    ndcg = measures[ir_measures.nDCG @ 10]
    # Measured 0.590 when the data was made; all-MiniLM-L6-v2 is a single-vector model, so its token
    # vectors give a real but modest late-interaction ranking. Random ranking would give ~0.01.
    assert ndcg > 0.5, ndcg
    np.testing.assert_allclose(ndcg, 0.590, atol=0.01)
