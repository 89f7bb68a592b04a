"""`maxsim merge` and `maxsim_cli.merge`: partial runs merge into exactly the full run."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.merge import merge_runs
from maxsim_cli.runs import RunWriter, read_run, sort_trec
from maxsim_cli.shards import open_corpus

runner = CliRunner()
SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"


def write_topk(path: Path, qids, docnos, scores: np.ndarray, doc_indices, k: int) -> None:
    """The top-k run of the documents `doc_indices` only, as one part of a corpus would produce it."""
    with RunWriter(str(path)) as writer:
        for qi, qid in enumerate(qids):
            names = [docnos[j] for j in doc_indices]
            values = [float(scores[qi, j]) for j in doc_indices]
            best = sort_trec(names, values)[:k]
            writer.write_query(qid, [names[i] for i in best], [values[i] for i in best])


@pytest.mark.parametrize("num_parts", [2, 3, 5])
def test_merge_of_partial_runs_equals_full_run(tmp_path, num_parts):
    rng = np.random.default_rng(num_parts)
    qids = [f"q{i}" for i in range(7)]
    docnos = [f"doc{j:03d}" for j in range(120)]
    # Scores on a coarse float32 grid: many ties, including across the top-k boundary and across parts.
    scores = (rng.integers(0, 40, size=(len(qids), len(docnos))) / 8).astype(np.float32)
    k = 10
    write_topk(tmp_path / "full.trec", qids, docnos, scores, range(len(docnos)), k)
    parts = np.array_split(rng.permutation(len(docnos)), num_parts)
    paths = []
    for p, indices in enumerate(parts):
        paths.append(str(tmp_path / f"part-{p}.trec"))
        write_topk(Path(paths[-1]), qids, docnos, scores, sorted(indices), k)
    out = tmp_path / "merged.trec"
    stats = merge_runs(paths, k, str(out))
    assert out.read_bytes() == (tmp_path / "full.trec").read_bytes()
    assert (stats.inputs, stats.queries, stats.rows_read, stats.rows_written) == (
        num_parts,
        len(qids),
        num_parts * len(qids) * k,
        len(qids) * k,
    )
    # the CLI gives the same bytes, on stdout
    result = runner.invoke(app, ["merge", *paths, "-k", str(k)])
    assert result.exit_code == 0, result.output
    assert result.stdout == (tmp_path / "full.trec").read_text()
    assert f"merged {num_parts} runs: {len(qids)} queries" in result.stderr


def test_merge_sample_candidates_split_by_shard(tmp_path):
    # The sample BM25 run split by the shard each document lives in merges back to the same bytes.
    with open_corpus([SAMPLE / "corpus"]) as corpus:
        shard_of = {docno: shard for docno, (shard, _) in corpus.id_index().items()}
    parts = [tmp_path / "a.trec.gz", tmp_path / "b.trec"]
    lines = (SAMPLE / "candidates.trec").read_text().splitlines(keepends=True)
    parts[0].write_bytes(gzip.compress("".join(x for x in lines if shard_of[x.split()[2]] == 0).encode()))
    parts[1].write_text("".join(x for x in lines if shard_of[x.split()[2]] == 1))
    out = tmp_path / "merged.trec"
    result = runner.invoke(
        app, ["merge", str(parts[1]), str(parts[0]), "-k", "100", "--tag", "bm25", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    # query order: first appearance across inputs, here the same as the original file's
    assert out.read_bytes() == (SAMPLE / "candidates.trec").read_bytes()


def test_query_order_is_first_appearance_across_inputs(tmp_path):
    a = tmp_path / "a.trec"
    b = tmp_path / "b.tsv"
    a.write_text("q2 Q0 x 1 1.0 t\n")
    b.write_text("q1\ty\t1\t5.0\nq2\tz\t1\t3.0\n")  # ColBERT TSV
    out = tmp_path / "o.trec"
    merge_runs([str(a), str(b)], 5, str(out), tag="m")
    assert out.read_text() == "q2 Q0 z 1 3 m\nq2 Q0 x 2 1 m\nq1 Q0 y 1 5 m\n"


def test_duplicate_with_equal_score_is_kept_once(tmp_path):
    a = tmp_path / "a.trec"
    b = tmp_path / "b.trec"
    a.write_text("q1 Q0 x 1 0.1 t\nq1 Q0 y 2 0.05 t\n")
    # the same float32 score written with more digits than float32 holds: still equal
    b.write_text("q1 Q0 x 1 0.10000000149 t\n")
    out = tmp_path / "o.trec"
    stats = merge_runs([str(a), str(b)], 10, str(out), tag="m")
    assert out.read_text() == "q1 Q0 x 1 0.1 m\nq1 Q0 y 2 0.05 m\n"
    assert stats.duplicates == 1


def test_duplicate_with_different_score_is_an_error(tmp_path):
    a = tmp_path / "a.trec"
    b = tmp_path / "b.trec"
    a.write_text("q1 Q0 x 1 0.5 t\n")
    b.write_text("q1 Q0 x 1 0.25 t\n")
    out = tmp_path / "o.trec"
    with pytest.raises(InputError, match=rf"{b}: query 'q1' docno 'x' has score 0.25 here but 0.5 in {a}"):
        merge_runs([str(a), str(b)], 10, str(out))
    result = runner.invoke(app, ["merge", str(a), str(b), "-o", str(out)])
    assert result.exit_code == 1
    assert "docno 'x' has score 0.25 here but 0.5" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["a.trec", "b.trec"]


def test_stdin_input_and_usage_errors(tmp_path):
    a = tmp_path / "a.trec"
    a.write_text("q1 Q0 x 1 2 t\n")
    result = runner.invoke(app, ["merge", "-", str(a), "-k", "1", "--tag", "m"], input="q1 Q0 y 1 3 t\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == "q1 Q0 y 1 3 m\n"
    result = runner.invoke(app, ["merge", "-", "-"], input="q1 Q0 y 1 3 t\n")
    assert result.exit_code == 2
    assert "'-' (standard input) can be given only once" in result.stderr
    result = runner.invoke(app, ["merge", str(a), "-k", "0"])
    assert result.exit_code == 2
    with pytest.raises(UsageError):
        merge_runs([], 10)


def test_bad_input_line_names_file_and_line(tmp_path):
    a = tmp_path / "a.trec"
    a.write_text("q1 Q0 x 1 2 t\nq1 Q0 y 2 two t\n")
    result = runner.invoke(app, ["merge", str(a)])
    assert result.exit_code == 1
    assert f"{a}:2: score (column 5) 'two' is not a number" in result.stderr
    assert result.stdout == ""


def test_jsonl_output(tmp_path):
    a = tmp_path / "a.trec"
    a.write_text("q1 Q0 x 1 2 t\nq1 Q0 y 2 3 t\n")
    result = runner.invoke(app, ["merge", str(a), "--format", "jsonl", "-k", "1"])
    assert result.exit_code == 0, result.output
    assert result.stdout == '{"qid":"q1","results":[{"docno":"y","rank":1,"score":3}]}\n'
    assert read_run(str(a))["q1"] == [("x", 2.0), ("y", 3.0)]


def test_merge_of_per_shard_score_runs_equals_the_corpus_run(tmp_path):
    # End to end on the sample data: `maxsim score` on each shard alone, merged, gives the bytes of
    # `maxsim score` on the whole corpus.
    queries = str(SAMPLE / "queries.safetensors")
    shards = sorted(str(p) for p in (SAMPLE / "corpus").glob("*.safetensors"))
    common = ["-k", "20", "--device", "cpu", "--quiet"]
    full = tmp_path / "full.trec"
    result = runner.invoke(app, ["score", queries, str(SAMPLE / "corpus"), *common, "-o", str(full)])
    assert result.exit_code == 0, result.output
    parts = []
    for i, shard in enumerate(shards):
        parts.append(str(tmp_path / f"part-{i}.trec"))
        result = runner.invoke(app, ["score", queries, shard, *common, "-o", parts[-1]])
        assert result.exit_code == 0, result.output
    merged = tmp_path / "merged.trec"
    result = runner.invoke(app, ["merge", *parts, "-k", "20", "-o", str(merged)])
    assert result.exit_code == 0, result.output
    assert merged.read_bytes() == full.read_bytes()


def test_queries_file_sets_the_order_and_refuses_strangers(tmp_path):
    # Partial runs in which the first appearance differs from the query file's order (a part with no
    # results for the first queries): --queries restores the order `maxsim score` writes.
    queries = str(SAMPLE / "queries.safetensors")
    with open_corpus([queries]) as qfile:
        qids = list(qfile.shards[0].ids)
    a = tmp_path / "a.trec"
    b = tmp_path / "b.trec"
    a.write_text(f"{qids[2]} Q0 x 1 1 t\n{qids[0]} Q0 y 1 2 t\n")
    b.write_text(f"{qids[1]} Q0 z 1 3 t\n{qids[0]} Q0 w 1 4 t\n")
    out = tmp_path / "o.trec"
    result = runner.invoke(app, ["merge", str(a), str(b), "--queries", queries, "--tag", "m", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == (
        f"{qids[0]} Q0 w 1 4 m\n{qids[0]} Q0 y 2 2 m\n{qids[1]} Q0 z 1 3 m\n{qids[2]} Q0 x 1 1 m\n"
    )
    b.write_text("stranger Q0 z 1 3 t\n")
    result = runner.invoke(app, ["merge", str(a), str(b), "--queries", queries, "-o", str(out)])
    assert result.exit_code == 1
    assert f"{b}: query 'stranger' is not in the query file {queries}" in result.stderr
