"""`maxsim score` end to end through the CLI, against a float64 ranking computed here with plain torch.

Most corpora hold *dyadic* values (multiples of 1/4 in [-1, 1]): every product is a multiple of 1/16 and
every score a multiple of 1/16 below 2^11/16, so float16, bfloat16 and float32 store the values exactly
and any float32 accumulation gives the float64 score exactly. The runs are therefore compared exactly,
scores and order, and the many exact ties exercise the docno-descending tie-break. One test uses
Gaussian values, where scores are compared with a tolerance (float32 accumulation of 16 products of
fp32 inputs: |error| <= 16 * 2^-24 * sum |products| per token, far below the 1e-4 used) and the order
only where the reference's gap exceeds it.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.shards import write_shard

runner = CliRunner()
DIM = 16
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# --------------------------------------------------------------------------------------------------
# data and the independent reference


def _dyadic(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(-4, 5, (n, DIM), generator=gen).to(torch.float64) / 4


def _gaussian(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randn(n, DIM, generator=gen, dtype=torch.float64)


def make_corpus(
    root,
    dtype: str = "float16",
    layout=(("safetensors", 30), ("arrow", 25), ("safetensors", 20)),
    seed: int = 0,
    values=_dyadic,
    extra: dict[int, dict[str, torch.Tensor]] | None = None,
) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Shards under ``root`` and {docno: float64 [len, DIM] as stored}. Docnos are shuffled across
    shards so that shard order and docno order differ; ``extra`` adds given documents to shard i."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(n for _, n in layout)
    names = [f"doc{int(i):03d}" for i in torch.randperm(total, generator=gen)]
    os.makedirs(root, exist_ok=True)
    paths, docs, used = [], {}, 0
    for s, (fmt, n) in enumerate(layout):
        ids = names[used : used + n]
        used += n
        embs = [values(gen, int(torch.randint(1, 9, (1,), generator=gen))) for _ in ids]
        for docno, emb in (extra or {}).get(s, {}).items():
            ids.append(docno)
            embs.append(emb)
        stored = [e.to(TORCH_DTYPES[dtype]) for e in embs]
        path = os.path.join(root, f"shard{s}.{fmt}")
        write_shard(path, ids, stored, dtype=dtype)
        paths.append(path)
        docs.update({d: e.to(torch.float64) for d, e in zip(ids, stored, strict=True)})
    return paths, docs


def make_queries(
    path, n: int = 6, dtype: str = "float16", seed: int = 100, values=_dyadic, dim: int = DIM
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qids = [f"q{i}" for i in range(n)]
    embs = [values(gen, int(torch.randint(1, 6, (1,), generator=gen)))[:, :dim].contiguous() for _ in qids]
    if dim > DIM:
        embs = [torch.cat([e, torch.zeros(e.shape[0], dim - DIM, dtype=e.dtype)], 1) for e in embs]
    stored = [e.to(TORCH_DTYPES[dtype]) for e in embs]
    write_shard(str(path), qids, stored, dtype=dtype)
    return {q: e.to(torch.float64) for q, e in zip(qids, stored, strict=True)}


def reference_scores(
    queries: dict[str, torch.Tensor], docs: dict[str, torch.Tensor]
) -> dict[str, dict[str, float]]:
    """MaxSim in float64: sum over query tokens of the max over document tokens of the dot product."""
    names = list(docs)
    packed = torch.cat([docs[d] for d in names]).to(torch.float64)
    owner = torch.repeat_interleave(torch.arange(len(names)), torch.tensor([docs[d].shape[0] for d in names]))
    out = {}
    for qid, q in queries.items():
        sim = q.to(torch.float64) @ packed.T  # [query tokens, all document tokens]
        best = torch.full((q.shape[0], len(names)), -torch.inf, dtype=torch.float64)
        best.scatter_reduce_(1, owner.expand(q.shape[0], -1), sim, reduce="amax")
        out[qid] = dict(zip(names, best.sum(dim=0).tolist(), strict=True))
    return out


def reference_run(scores: dict[str, dict[str, float]], k: int) -> dict[str, list[tuple[str, float]]]:
    """Top k per query: score descending, ties by docno descending (trec_eval's order)."""
    return {
        qid: sorted(per_doc.items(), key=lambda item: (item[1], item[0]), reverse=True)[:k]
        for qid, per_doc in scores.items()
    }


def parse_run(text: str) -> dict[str, list[tuple[str, float]]]:
    run: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        qid, q0, docno, rank, score, tag = line.split(" ")
        assert q0 == "Q0" and tag
        rows = run.setdefault(qid, [])
        assert int(rank) == len(rows) + 1
        rows.append((docno, float(score)))
    return run


def invoke(*args: str, input: bytes | str | None = None):
    """`maxsim score ARGS` on the CPU (a later --device wins)."""
    return runner.invoke(app, ["score", *args], input=input)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """One fp16 corpus of three shards (safetensors, Arrow, safetensors) and six queries."""
    root = tmp_path_factory.mktemp("data")
    paths, docs = make_corpus(root / "corpus")
    queries = make_queries(root / "queries.safetensors")
    return {
        "root": root,
        "paths": paths,
        "queries": str(root / "queries.safetensors"),
        "ref": reference_scores(queries, docs),
        "docs": docs,
    }


# --------------------------------------------------------------------------------------------------
# exhaustive mode


@pytest.mark.parametrize(
    "dtype, layout",
    [
        ("float16", (("safetensors", 30), ("arrow", 25), ("safetensors", 20))),
        ("bfloat16", (("arrow", 20), ("safetensors", 30), ("parquet", 10))),
        ("float32", (("safetensors", 25), ("parquet", 15), ("arrow", 30))),
    ],
)
def test_exhaustive_matches_float64_ranking(tmp_path, dtype, layout) -> None:
    paths, docs = make_corpus(tmp_path / "c", dtype, layout, seed=len(dtype))
    queries = make_queries(tmp_path / "q.arrow", dtype=dtype)
    out = tmp_path / "run.trec"
    result = invoke(str(tmp_path / "q.arrow"), str(tmp_path / "c"), "-k", "9", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert parse_run(out.read_text()) == reference_run(reference_scores(queries, docs), 9)
    summary = result.stderr.strip().splitlines()
    assert len(summary) == 1 and "pairs/s" in summary[0]
    assert f"scored 6 queries x {len(docs)} documents = {6 * len(docs)} pairs" in summary[0]


def test_exhaustive_to_stdout_with_default_k_keeps_every_document(data) -> None:
    result = invoke(data["queries"], *data["paths"], "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    run = parse_run(result.stdout)
    assert run == reference_run(data["ref"], 1000)
    assert all(len(rows) == len(data["docs"]) for rows in run.values())


def test_same_bytes_whatever_memory_budget_batching_and_shard_order(data, tmp_path) -> None:
    base = [data["queries"], "-k", "11", "--quiet"]
    outputs = []
    variants = [
        [*data["paths"]],
        [*reversed(data["paths"])],
        [*data["paths"], "--max-memory", "40KB"],  # forces many document batches and query batches
        [
            data["paths"][1],
            data["paths"][0],
            data["paths"][2],
            "--max-memory",
            "6KiB",
            "--batch-queries",
            "4",
        ],
        [*data["paths"], "--batch-queries", "1"],
    ]
    for i, variant in enumerate(variants):
        out = tmp_path / f"run{i}.trec"
        stats = tmp_path / f"stats{i}.json"
        result = invoke(*base, *variant, "-o", str(out), "--stats-json", str(stats))
        assert result.exit_code == 0, result.output
        outputs.append(out.read_bytes())
        info = json.loads(stats.read_text())
        if "--max-memory" in variant:
            assert info["doc_batches"] >= 2 * info["query_batches"]
        if "--batch-queries" in variant:
            assert info["query_batches"] == -(-6 // int(variant[variant.index("--batch-queries") + 1]))
    assert all(o == outputs[0] for o in outputs[1:])
    assert parse_run(outputs[0].decode()) == reference_run(data["ref"], 11)


def test_exact_ties_across_shards_are_ordered_by_docno_descending(tmp_path) -> None:
    strong = torch.ones(2, DIM, dtype=torch.float64)  # the best document of every positive query
    extra = {
        0: {"tie-b": strong, "tie-z": strong},
        1: {"tie-y": strong},
        2: {"tie-a": strong, "tie-c": strong},
    }
    paths, docs = make_corpus(tmp_path / "c", "float32", extra=extra)
    gen = torch.Generator().manual_seed(5)
    qembs = [
        (torch.rand(3, DIM, generator=gen, dtype=torch.float64) * 4).round() / 4 + 0.25 for _ in range(3)
    ]
    write_shard(str(tmp_path / "q.safetensors"), ["qa", "qb", "qc"], [e.float() for e in qembs])
    queries = {q: e.float().double() for q, e in zip(["qa", "qb", "qc"], qembs, strict=True)}
    for order in (paths, paths[::-1]):
        result = invoke(str(tmp_path / "q.safetensors"), *order, "-k", "3", "--quiet")
        assert result.exit_code == 0, result.output
        run = parse_run(result.stdout)
        for qid in queries:
            assert [d for d, _ in run[qid]] == ["tie-z", "tie-y", "tie-c"]
        assert run == reference_run(reference_scores(queries, docs), 3)


def test_gaussian_values_agree_with_float64_within_tolerance(tmp_path) -> None:
    paths, docs = make_corpus(tmp_path / "c", "float32", seed=7, values=_gaussian)
    queries = make_queries(tmp_path / "q.safetensors", dtype="float32", values=_gaussian)
    result = invoke(str(tmp_path / "q.safetensors"), *paths, "-k", "20", "--quiet")
    assert result.exit_code == 0, result.output
    run = parse_run(result.stdout)
    ref = reference_scores(queries, docs)
    expected = reference_run(ref, 20)
    tol = 1e-4
    for qid, rows in run.items():
        assert len(rows) == 20
        for docno, score in rows:
            assert abs(score - ref[qid][docno]) <= tol
        # the k-th reference score bounds what may be in the top k
        kth = expected[qid][-1][1]
        assert all(ref[qid][d] >= kth - 2 * tol for d, _ in rows)
        ref_order = [ref[qid][d] for d, _ in rows]
        assert all(a >= b - 2 * tol for a, b in zip(ref_order, ref_order[1:], strict=False))


def test_jsonl_format_and_stats_json(data, tmp_path) -> None:
    out, stats = tmp_path / "run.jsonl", tmp_path / "stats.json"
    result = invoke(
        data["queries"],
        *data["paths"],
        "-k",
        "4",
        "--format",
        "jsonl",
        "--run-tag",
        "exp1",
        "-o",
        str(out),
        "--stats-json",
        str(stats),
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    expected = reference_run(data["ref"], 4)
    assert [obj["qid"] for obj in lines] == list(expected)
    for obj in lines:
        assert [(r["docno"], r["score"]) for r in obj["results"]] == expected[obj["qid"]]
        assert [r["rank"] for r in obj["results"]] == [1, 2, 3, 4]
    info = json.loads(stats.read_text())
    assert info["mode"] == "exhaustive" and info["queries"] == 6 and info["documents"] == len(data["docs"])
    assert info["tokens"] == sum(d.shape[0] for d in data["docs"].values())
    for key in ("wall_s", "read_s", "copy_s", "score_s", "docs_per_s", "tokens_per_s", "peak_host_bytes"):
        assert key in info
    assert info["peak_gpu_bytes"] is None and info["device"] == "cpu"


def test_gzip_output(data, tmp_path) -> None:
    out = tmp_path / "run.trec.gz"
    result = invoke(data["queries"], *data["paths"], "-k", "3", "--quiet", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert parse_run(gzip.decompress(out.read_bytes()).decode()) == reference_run(data["ref"], 3)


# --------------------------------------------------------------------------------------------------
# sample_data: real embeddings, both modes, the runs read back by ir_measures

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data"


def _sample_reference() -> dict[str, dict[str, float]]:
    """float64 MaxSim of every sample query against every sample document (the shards read directly)."""
    from safetensors.numpy import load_file

    def packed(path: Path) -> dict[str, torch.Tensor]:
        t = load_file(str(path))
        ids_raw, id_off, off = t["ids"].tobytes(), t["id_offsets"], t["offsets"]
        emb = torch.from_numpy(t["embeddings"].astype(np.float64))
        return {
            ids_raw[id_off[i] : id_off[i + 1]].decode(): emb[off[i] : off[i + 1]] for i in range(len(off) - 1)
        }

    docs: dict[str, torch.Tensor] = {}
    for shard in sorted((SAMPLE / "corpus").glob("*.safetensors")):
        docs.update(packed(shard))
    return reference_scores(packed(SAMPLE / "queries.safetensors"), docs)


def test_sample_data_both_modes_agree_with_float64_and_read_back_with_ir_measures(tmp_path) -> None:
    ir_measures = pytest.importorskip("ir_measures")
    ref = _sample_reference()
    exhaustive, rerank = tmp_path / "run.trec", tmp_path / "rerank.trec"
    queries, corpus = str(SAMPLE / "queries.safetensors"), str(SAMPLE / "corpus")
    result = invoke(queries, corpus, "-k", "100", "-o", str(exhaustive), "--quiet")
    assert result.exit_code == 0, result.output
    result = invoke(
        queries, corpus, "--candidates", str(SAMPLE / "candidates.trec"), "-o", str(rerank), "--quiet"
    )
    assert result.exit_code == 0, result.output
    # fp16 inputs, fp32 accumulation over 384-dim products of unit vectors: |error| well below 1e-4 per score
    tol = 1e-4
    qrels = list(ir_measures.read_trec_qrels(str(SAMPLE / "qrels.txt")))
    for path in (exhaustive, rerank):
        rows = list(ir_measures.read_trec_run(str(path)))
        assert len({r.query_id for r in rows}) == 200
        for row in rows:
            assert abs(row.score - ref[row.query_id][row.doc_id]) <= tol
        by_query: dict[str, list] = {}
        for row in rows:
            by_query.setdefault(row.query_id, []).append(row.score)
        assert all(a >= b for scores in by_query.values() for a, b in zip(scores, scores[1:], strict=False))
        ndcg = ir_measures.calc_aggregate([ir_measures.nDCG @ 10], qrels, rows)[ir_measures.nDCG @ 10]
        assert 0.3 < ndcg <= 1.0
    # exhaustive: the top 100 are the reference's top 100 up to scores closer than the tolerance
    run = parse_run(exhaustive.read_text())
    for qid, per_doc in ref.items():
        kth = sorted(per_doc.values(), reverse=True)[99]
        assert len(run[qid]) == 100
        assert all(per_doc[d] >= kth - 2 * tol for d, _ in run[qid])


# --------------------------------------------------------------------------------------------------
# rerank mode


def _write_candidates(path, data, missing: bool = True, fmt: str = "trec") -> dict[str, list[str]]:
    """A first-stage run: for each query some corpus docnos (in a scrambled order, ranks from 0) and,
    optionally, some docnos absent from the corpus."""
    docnos = sorted(data["docs"])
    cands: dict[str, list[str]] = {}
    lines = []
    for i, qid in enumerate(data["ref"]):
        chosen = docnos[i * 7 : i * 7 + 12][::-1]
        if missing and i % 2 == 0:
            chosen = chosen[:5] + [f"gone{i}"] + chosen[5:]
        cands[qid] = chosen
        for rank, docno in enumerate(chosen):
            if fmt == "trec":
                lines.append(f"{qid} Q0 {docno} {rank} {100 - rank} bm25")
            else:
                lines.append(f"{qid}\t{docno}\t{rank + 1}")
    text = "\n".join(lines) + "\n"
    if str(path).endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return cands


def _expected_rerank(data, cands, k: int = 1000) -> dict[str, list[tuple[str, float]]]:
    out = {}
    for qid, docnos in cands.items():
        found = {d: data["ref"][qid][d] for d in docnos if d in data["docs"]}
        out[qid] = sorted(found.items(), key=lambda item: (item[1], item[0]), reverse=True)[:k]
    return out


@pytest.mark.parametrize("name, fmt", [("cands.trec", "trec"), ("cands.tsv.gz", "msmarco")])
def test_rerank_scores_exactly_the_candidates_and_warns_on_missing(data, tmp_path, name, fmt) -> None:
    cands = _write_candidates(tmp_path / name, data, fmt=fmt)
    out = tmp_path / "run.trec"
    result = invoke(data["queries"], *data["paths"], "--candidates", str(tmp_path / name), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert parse_run(out.read_text()) == _expected_rerank(data, cands)
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1
    assert "3 candidates are not in the corpus" in warning[0] and "'gone0'" in warning[0]
    assert "--strict" in warning[0]


def test_rerank_top_k_and_memory_budget_give_the_same_run(data, tmp_path) -> None:
    cands = _write_candidates(tmp_path / "c.trec", data, missing=False)
    outs = []
    for extra in ([], ["--max-memory", "4KiB"], [*reversed(data["paths"])]):
        paths = [] if extra and extra[0] != "--max-memory" else data["paths"]
        result = invoke(
            data["queries"], *paths, *extra, "--candidates", str(tmp_path / "c.trec"), "-k", "5", "--quiet"
        )
        assert result.exit_code == 0, result.output
        assert result.stderr == ""
        outs.append(result.stdout)
    assert outs[0] == outs[1] == outs[2]
    assert parse_run(outs[0]) == _expected_rerank(data, cands, 5)


def test_rerank_candidates_from_stdin(data, tmp_path) -> None:
    cands = _write_candidates(tmp_path / "c.trec", data, missing=False)
    result = invoke(
        data["queries"],
        *data["paths"],
        "--candidates",
        "-",
        "--quiet",
        input=(tmp_path / "c.trec").read_bytes(),
    )
    assert result.exit_code == 0, result.output
    assert parse_run(result.stdout) == _expected_rerank(data, cands)


def test_rerank_strict_missing_is_an_error_and_leaves_no_output(data, tmp_path) -> None:
    _write_candidates(tmp_path / "c.trec", data)
    out = tmp_path / "run.trec"
    result = invoke(
        data["queries"], *data["paths"], "--candidates", str(tmp_path / "c.trec"), "--strict", "-o", str(out)
    )
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "c.trec" in lines[0] and "3 candidates are not in the corpus" in lines[0] and "'gone0'" in lines[0]
    assert not out.exists() and os.listdir(tmp_path) == ["c.trec"]


def test_rerank_query_without_embedding_is_an_error(data, tmp_path) -> None:
    (tmp_path / "c.trec").write_text("q1 Q0 doc001 1 3.0 x\nq77 Q0 doc002 1 2.0 x\n")
    out = tmp_path / "run.trec"
    result = invoke(data["queries"], *data["paths"], "--candidates", str(tmp_path / "c.trec"), "-o", str(out))
    assert result.exit_code == 1
    assert "'q77'" in result.stderr and "queries.safetensors" in result.stderr and "c.trec" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# stdin, errors


def _arrow_stream_bytes(path) -> bytes:
    """The Arrow IPC *file* at ``path`` re-encoded as an IPC *stream* (what an encoder would pipe)."""
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def test_queries_from_stdin(data, tmp_path) -> None:
    gen = torch.Generator().manual_seed(100)
    del gen
    make_queries(tmp_path / "q.arrow")  # the same queries as data["queries"] (same seed), as Arrow
    stream = _arrow_stream_bytes(tmp_path / "q.arrow")
    result = invoke("-", *data["paths"], "-k", "6", "--quiet", input=stream)
    assert result.exit_code == 0, result.output
    assert parse_run(result.stdout) == reference_run(data["ref"], 6)


def test_two_stdin_inputs_is_a_usage_error(data, tmp_path) -> None:
    out = tmp_path / "run.trec"
    result = invoke("-", *data["paths"], "--candidates", "-", "-o", str(out))
    assert result.exit_code == 2
    assert "at most one input can be stdin" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_dimension_mismatch_names_both_files(data, tmp_path) -> None:
    make_queries(tmp_path / "wide.safetensors", dim=DIM * 2)
    out = tmp_path / "run.trec"
    result = invoke(str(tmp_path / "wide.safetensors"), *data["paths"], "-o", str(out))
    assert result.exit_code == 1
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1
    assert "wide.safetensors" in message and data["paths"][0] in message
    assert f"dim {DIM * 2}" in message and f"dim {DIM}" in message
    assert not out.exists()


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["-k", "0"], 2, "--top-k"),
        (["--device", "tpu"], 2, "--device tpu"),
        (["--backend", "cuda"], 2, "--backend cuda"),
        (["--max-memory", "lots"], 2, "--max-memory"),
        (["--format", "csv"], 2, "--format"),
        (["--run-tag", "two words"], 2, "run tag"),
    ],
)
def test_bad_options(data, tmp_path, args, code, text) -> None:
    out = tmp_path / "run.trec"
    result = invoke(data["queries"], *data["paths"], *args, "-o", str(out))
    assert result.exit_code == code, result.output
    assert text in result.output
    assert not out.exists()


def test_triton_backend_on_cpu_needs_the_interpreter(data, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = invoke(data["queries"], *data["paths"], "--backend", "triton")
    assert result.exit_code == 2
    assert "TRITON_INTERPRET=1" in result.stderr


def test_help_ends_with_an_example() -> None:
    result = runner.invoke(app, ["score", "--help"])
    assert result.exit_code == 0
    assert "Example: maxsim score" in result.stdout


# --------------------------------------------------------------------------------------------------
# real processes: pipelines and the Triton interpreter


def _maxsim(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "maxsim_cli", *args], capture_output=True, **kwargs)


def test_pipeline_stdin_to_stdout_and_head_exits_quietly(tmp_path) -> None:
    paths, docs = make_corpus(tmp_path / "c", layout=(("safetensors", 300), ("arrow", 300)))
    queries = make_queries(tmp_path / "q.arrow", n=40)
    stream = _arrow_stream_bytes(tmp_path / "q.arrow")
    # queries piped in, the run piped out to a reader that stops after 3 lines (~100 KB of output)
    script = (
        f'{sys.executable} -m maxsim_cli score - {" ".join(paths)} -k 100 --device cpu; echo "exit=$?" >&2'
    )
    proc = subprocess.run(f"({script}) | head -n 3", shell=True, input=stream, capture_output=True)
    assert proc.returncode == 0
    assert "Traceback" not in proc.stderr.decode() and "Error" not in proc.stderr.decode()
    assert "exit=0" in proc.stderr.decode()
    lines = proc.stdout.decode().splitlines()
    assert len(lines) == 3
    expected = reference_run(reference_scores({"q0": queries["q0"]}, docs), 3)["q0"]
    assert [(line.split()[2], float(line.split()[4])) for line in lines] == expected


def test_triton_backend_under_the_interpreter(tmp_path) -> None:
    pytest.importorskip("maxsim_kernels.maxsim_forward")  # the Triton kernels (imports triton)
    paths, docs = make_corpus(tmp_path / "c", "float16", layout=(("safetensors", 6), ("arrow", 5)))
    queries = make_queries(tmp_path / "q.safetensors", n=2)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = _maxsim(
        [
            "score",
            str(tmp_path / "q.safetensors"),
            *paths,
            "-k",
            "4",
            "--device",
            "cpu",
            "--backend",
            "triton",
            "--quiet",
        ],
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert parse_run(proc.stdout.decode()) == reference_run(reference_scores(queries, docs), 4)


# --------------------------------------------------------------------------------------------------
# CUDA: the same bytes as the CPU, whatever the budget (skipped without a GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_cuda_runs_equal_the_cpu_run_under_any_budget(tmp_path, dtype) -> None:
    layout = (("safetensors", 400), ("arrow", 300), ("safetensors", 200))
    paths, docs = make_corpus(tmp_path / "c", dtype, layout, seed=3)
    queries = make_queries(tmp_path / "q.safetensors", n=40, dtype=dtype)
    q = str(tmp_path / "q.safetensors")
    expected = reference_run(reference_scores(queries, docs), 50)
    runs = {}
    for name, extra in {
        "cpu": ["--device", "cpu"],
        "cuda": ["--device", "cuda"],
        "small": ["--device", "cuda", "--max-memory", "512KiB"],  # many document batches
        "resident": ["--device", "cuda", "--batch-queries", "7"],  # several passes over a resident corpus
        "reversed": ["--device", "cuda", "--max-memory", "2MiB", *reversed(paths)],
    }.items():
        stats = tmp_path / f"{name}.json"
        corpus = [] if name == "reversed" else paths
        result = invoke(q, *corpus, *extra, "-k", "50", "--quiet", "--stats-json", str(stats))
        assert result.exit_code == 0, result.output
        runs[name] = result.stdout
        info = json.loads(stats.read_text())
        if name == "small":
            assert info["peak_gpu_bytes"] <= 512 << 10, info
            assert info["doc_batches"] > info["query_batches"] or info["query_batches"] > 1, info
        if name == "resident":
            assert info["resident"] and info["query_batches"] == 6
    assert parse_run(runs["cpu"]) == expected
    assert all(text == runs["cpu"] for text in runs.values())


@pytest.mark.gpu
def test_cuda_rerank_equals_the_cpu_rerank(data, tmp_path) -> None:
    cands = _write_candidates(tmp_path / "c.trec", data, missing=False)
    outs = []
    for device in ("cpu", "cuda"):
        result = invoke(
            data["queries"], *data["paths"], "--candidates", str(tmp_path / "c.trec"), "--device", device
        )
        assert result.exit_code == 0, result.output
        outs.append(result.stdout)
    assert outs[0] == outs[1]
    assert parse_run(outs[1]) == _expected_rerank(data, cands)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("rerank", [False, True])
def test_nan_in_a_shard_is_an_error_naming_the_document(tmp_path, bad, rerank) -> None:
    # On the CPU the backend finds it from the similarities; queries with only positive components make
    # a -Inf component give -Inf similarities, which a max alone would pass over.
    docs = [torch.full((2, DIM), 0.25), torch.full((3, DIM), 0.5), torch.full((1, DIM), 0.75)]
    path = tmp_path / "bad.safetensors"
    write_shard(str(path), ["a", "b", "c"], docs, dtype="float16")
    raw = bytearray(path.read_bytes())
    pattern = np.full(DIM, 0.5, dtype=np.float16).tobytes()  # document "b", token 0
    at = raw.index(pattern)
    raw[at + 6 : at + 8] = np.array([bad], dtype=np.float16).tobytes()
    path.write_bytes(bytes(raw))
    make_queries(tmp_path / "q.safetensors", values=lambda gen, n: torch.rand(n, DIM, generator=gen) + 0.1)
    out = tmp_path / "run.trec"
    extra = []
    if rerank:
        (tmp_path / "cands.tsv").write_text("".join(f"q{i}\tb\t1\nq{i}\tc\t2\n" for i in range(6)))
        extra = ["--candidates", str(tmp_path / "cands.tsv")]
    result = invoke(str(tmp_path / "q.safetensors"), str(path), "-o", str(out), *extra)
    assert result.exit_code == 1
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1
    assert "bad.safetensors" in message and "'b'" in message and "NaN or Inf" in message
    assert not out.exists()


def test_finite_values_whose_similarities_overflow_fail_cleanly(tmp_path) -> None:
    """fp32 documents with finite values so large that the fp32 sum overflows: the CPU backend's check
    flags them, the checked reader finds the values finite, the batch is scored again without the check,
    and the run writer refuses the infinite score with its one-line error (as before the check moved)."""
    huge = torch.zeros(2, DIM)
    huge[:, :4] = 3e38
    docs = [torch.full((2, DIM), 0.25), huge, torch.full((1, DIM), 0.75)]
    write_shard(str(tmp_path / "s.safetensors"), ["a", "b", "c"], docs, dtype="float32")
    make_queries(tmp_path / "q.safetensors", dtype="float32", values=lambda gen, n: torch.ones(n, DIM))
    out = tmp_path / "run.trec"
    result = invoke(str(tmp_path / "q.safetensors"), str(tmp_path / "s.safetensors"), "-o", str(out))
    assert result.exit_code == 1
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1 and "score inf of docno 'b'" in message and "overflow" in message
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# int8 corpora: the scales travel with the documents to the kernels


def test_int8_corpus_scores_exactly_and_mixing_with_float_is_refused(tmp_path) -> None:
    """int8 codes with power-of-two scales and queries that quantize exactly (each token's largest
    |value| is 127/4 and every value a multiple of 1/4, so scale 1/4 and integer codes): the int8 MaxSim
    ``sum_i s_q[i] * max_j s_d[j] * <q8_i, d8_j>`` is then exact in float32 and equals the float64 MaxSim of
    the dequantized documents and the float queries."""
    gen = torch.Generator().manual_seed(8)
    docs: dict[str, torch.Tensor] = {}
    paths = []
    for s, fmt in enumerate(["safetensors", "arrow"]):
        ids, codes, scales = [], [], []
        for i in range(25):
            n = int(torch.randint(1, 7, (1,), generator=gen))
            c = torch.randint(-127, 128, (n, DIM), generator=gen).to(torch.int8)
            sc = 2.0 ** torch.randint(-6, -2, (n,), generator=gen).to(torch.float32)
            ids.append(f"s{s}d{i:02d}")
            codes.append(c)
            scales.append(sc)
            docs[ids[-1]] = c.to(torch.float64) * sc.to(torch.float64)[:, None]
        path = tmp_path / f"shard{s}.{fmt}"
        write_shard(str(path), ids, codes, scales=scales, dtype="int8")
        paths.append(str(path))
    queries = {}
    qembs = []
    for i in range(4):
        q = torch.randint(-127, 128, (3, DIM), generator=gen).to(torch.float32)
        q[:, 0] = 127  # the largest |code| of every token: scale 1/4 exactly
        queries[f"q{i}"] = (q / 4).double()
        qembs.append(q / 4)
    write_shard(str(tmp_path / "q.safetensors"), list(queries), qembs, dtype="float32")
    result = invoke(str(tmp_path / "q.safetensors"), *paths, "-k", "7", "--quiet")
    assert result.exit_code == 0, result.output
    ref = reference_scores(queries, docs)

    def f32(run: dict[str, list[tuple[str, float]]]) -> dict[str, list[tuple[str, float]]]:
        # scores this large print with fewer digits than they have: compare the float32 values
        return {q: [(d, float(np.float32(v))) for d, v in rows] for q, rows in run.items()}

    assert f32(parse_run(result.stdout)) == f32(reference_run(ref, 7))
    # rerank through the same kernels' candidates path
    (tmp_path / "c.trec").write_text(
        "".join(f"q1 Q0 s{s}d{i:02d} 0 1 x\n" for s in (1, 0) for i in range(0, 25, 3))
    )
    result = invoke(
        str(tmp_path / "q.safetensors"), *paths, "--candidates", str(tmp_path / "c.trec"), "--quiet"
    )
    assert result.exit_code == 0, result.output
    wanted = {f"s{s}d{i:02d}" for s in (1, 0) for i in range(0, 25, 3)}
    expected = sorted(
        ((d, v) for d, v in ref["q1"].items() if d in wanted), key=lambda x: (x[1], x[0]), reverse=True
    )
    assert f32(parse_run(result.stdout)) == f32({"q1": expected})
    # a float shard next to int8 ones is refused when the corpus is opened
    write_shard(str(tmp_path / "float.safetensors"), ["f"], [torch.ones(1, DIM)], dtype="float16")
    out = tmp_path / "run.trec"
    result = invoke(
        str(tmp_path / "q.safetensors"), *paths, str(tmp_path / "float.safetensors"), "-o", str(out)
    )
    assert result.exit_code == 1
    assert "float.safetensors" in result.stderr and "mismatch" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("mode", ["exhaustive", "rerank"])
def test_sample_data_run_bytes_do_not_depend_on_the_memory_budget(tmp_path, mode) -> None:
    """Real embeddings with short documents (7-12 tokens) and 1-17 token queries: every budget, the
    same bytes (small budgets split queries and documents into small matrix products)."""
    extra = ["--candidates", str(SAMPLE / "candidates.trec")] if mode == "rerank" else ["-k", "50"]
    outputs = []
    for budget in ([], ["--max-memory", "2MiB"]):
        out = tmp_path / f"run{len(outputs)}.trec"
        args = ["score", str(SAMPLE / "queries.safetensors"), str(SAMPLE / "corpus"), "-q", "-o", str(out)]
        result = runner.invoke(app, [*args, *extra, *budget])
        assert result.exit_code == 0, result.output
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
