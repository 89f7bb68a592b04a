"""`maxsim merge` and `maxsim_cli.merge`: partial runs merge into exactly the full run."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.errors import InputError, MaxsimWarning, UsageError
from maxsim_cli.merge import merge_runs
from maxsim_cli.run_files import RunWriter, read_run, sort_trec
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
        app, ["merge", str(parts[1]), str(parts[0]), "-k", "100", "--run-tag", "bm25", "-o", str(out)]
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
    with pytest.warns(MaxsimWarning, match=r"a\.trec lacks 1 \(e\.g\. 'q1'\)"):  # a has no q1
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
    result = runner.invoke(app, ["merge", "-", str(a), "-k", "1", "--run-tag", "m"], input="q1 Q0 y 1 3 t\n")
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
    result = runner.invoke(
        app, ["merge", str(a), str(b), "--queries", queries, "--run-tag", "m", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert out.read_text() == (
        f"{qids[0]} Q0 w 1 4 m\n{qids[0]} Q0 y 2 2 m\n{qids[1]} Q0 z 1 3 m\n{qids[2]} Q0 x 1 1 m\n"
    )
    b.write_text("stranger Q0 z 1 3 t\n")
    result = runner.invoke(app, ["merge", str(a), str(b), "--queries", queries, "-o", str(out)])
    assert result.exit_code == 1
    assert f"{b}: query 'stranger' is not in the query file {queries}" in result.stderr


# --------------------------------------------------------------------------------------------------
# runs without scores, --by-rank, query sets, --run-tag


def test_scoreless_run_with_scored_runs_is_refused(tmp_path):
    # MS MARCO's three columns carry ranks, not scores: -rank against real scores would be a wrong run.
    scored = tmp_path / "scored.trec"
    scored.write_text("q1 Q0 d1 1 12.5 t\nq1 Q0 d2 2 11.0 t\n")
    ranked = tmp_path / "ranked.tsv"
    ranked.write_text("q1\td3\t1\nq1\td4\t2\n")
    out = tmp_path / "o.trec"
    out.write_text("previous\n")
    for order in ([scored, ranked], [ranked, scored]):
        with pytest.raises(
            InputError, match=rf"^{ranked}: a run without scores .* of {scored}; pass --by-rank"
        ):
            merge_runs([str(p) for p in order], 10, str(out))
        result = runner.invoke(app, ["merge", *map(str, order), "-o", str(out)])
        assert result.exit_code == 1
        assert result.stderr.startswith(f"maxsim: error: {ranked}: a run without scores")
        assert "--by-rank" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert out.read_text() == "previous\n"
    assert sorted(os.listdir(tmp_path)) == ["o.trec", "ranked.tsv", "scored.trec"]
    # runs that all lack scores merge by their ranks (-rank), as one of them read alone is ordered
    other = tmp_path / "other.tsv"
    other.write_text("q1\td5\t1\n")
    merge_runs([str(ranked), str(other)], 10, str(out), tag="m")
    assert out.read_text() == "q1 Q0 d5 1 -1 m\nq1 Q0 d3 2 -1 m\nq1 Q0 d4 3 -2 m\n"


def test_by_rank_scores_each_input_by_reciprocal_position(tmp_path):
    scored = tmp_path / "scored.trec"
    # the file's rank column is not trusted: the order is its scores' (ties by docno descending)
    scored.write_text("q1 Q0 a 9 1.0 t\nq1 Q0 b 9 3.0 t\nq1 Q0 c 9 3.0 t\nq2 Q0 x 1 7 t\n")
    ranked = tmp_path / "ranked.tsv"
    ranked.write_text("q1\tm\t2\nq1\tn\t1\nq1\tb\t3\nq2\ty\t1\n")  # b again: kept at its best place
    out = tmp_path / "o.trec"
    stats = merge_runs([str(scored), str(ranked)], 10, str(out), tag="m", by_rank=True)
    assert out.read_text() == (
        "q1 Q0 n 1 1 m\n"  # first places of both inputs (1/1), ties by docno descending
        "q1 Q0 c 2 1 m\n"
        "q1 Q0 m 3 0.5 m\n"  # second places
        "q1 Q0 b 4 0.5 m\n"
        "q1 Q0 a 5 0.33333334 m\n"
        "q2 Q0 y 1 1 m\n"
        "q2 Q0 x 2 1 m\n"
    )
    assert (stats.by_rank, stats.duplicates, stats.rows_read, stats.rows_written) == (True, 1, 8, 7)
    result = runner.invoke(app, ["merge", str(scored), str(ranked), "--by-rank", "-k", "2", "--run-tag", "m"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "q1 Q0 n 1 1 m\nq1 Q0 c 2 1 m\nq2 Q0 y 1 1 m\nq2 Q0 x 2 1 m\n"
    assert "merged 2 runs by rank: 2 queries" in result.stderr
    assert "1 rows found in two inputs, kept at their best rank" in result.stderr


def test_different_query_sets_warn_and_strict_refuses(tmp_path):
    a = tmp_path / "a.trec"
    b = tmp_path / "b.trec"
    a.write_text("q1 Q0 x 1 2 t\nq2 Q0 y 1 2 t\nq3 Q0 z 1 2 t\n")
    b.write_text("q1 Q0 w 1 1 t\n")
    out = tmp_path / "o.trec"
    with pytest.warns(
        MaxsimWarning, match=r"of the 3 queries of all the runs, .*b\.trec lacks 2 \(e\.g\. 'q2'\)"
    ):
        merge_runs([str(a), str(b)], 10, str(out))
    assert read_run(str(out))["q1"] == [("x", 2.0), ("w", 1.0)]
    seen: list[str] = []
    merge_runs([str(b), str(a)], 10, str(out), warn=seen.append)  # a caller's handler instead
    assert len(seen) == 1 and f"{b} lacks 2" in seen[0]
    result = runner.invoke(app, ["merge", str(a), str(b), "-o", str(out)])
    assert result.exit_code == 0, result.output
    warning, summary = result.stderr.strip().splitlines()
    assert warning.startswith("maxsim: warning: the runs hold different queries")
    assert "--strict makes this an error" in warning
    assert summary.startswith("merged 2 runs: 3 queries")
    out.write_text("previous\n")
    with pytest.raises(InputError, match=rf"{b} lacks 2 .*; merge runs of the same queries"):
        merge_runs([str(a), str(b)], 10, str(out), strict=True)
    result = runner.invoke(app, ["merge", str(a), str(b), "--strict", "-o", str(out)])
    assert result.exit_code == 1
    assert result.stderr.startswith("maxsim: error: the runs hold different queries")
    assert len(result.stderr.strip().splitlines()) == 1
    assert out.read_text() == "previous\n"
    assert sorted(os.listdir(tmp_path)) == ["a.trec", "b.trec", "o.trec"]
    # the same queries everywhere: no warning, and --strict changes nothing
    b.write_text("q3 Q0 w 1 1 t\nq2 Q0 v 1 1 t\nq1 Q0 u 1 1 t\n")
    result = runner.invoke(app, ["merge", str(a), str(b), "--strict", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr


def test_query_sets_are_compared_with_the_query_file(tmp_path):
    queries = str(SAMPLE / "queries.safetensors")
    with open_corpus([queries]) as qfile:
        qids = list(qfile.shards[0].ids)
    a = tmp_path / "a.trec"
    a.write_text("".join(f"{q} Q0 x 1 1 t\n" for q in qids[1:]))  # every query but the first
    result = runner.invoke(app, ["merge", str(a), "--queries", queries, "--strict"])
    assert result.exit_code == 1
    assert f"of the {len(qids)} queries of the query file, {a} lacks 1 (e.g. {qids[0]!r})" in result.stderr
    assert result.stdout == ""


def test_tag_is_a_hidden_alias_of_run_tag(tmp_path):
    a = tmp_path / "a.trec"
    a.write_text("q1 Q0 x 1 2 t\n")
    for option in ("--run-tag", "--tag"):
        result = runner.invoke(app, ["merge", str(a), option, "mine"])
        assert result.exit_code == 0, result.output
        assert result.stdout == "q1 Q0 x 1 2 mine\n"
    help_text = runner.invoke(app, ["merge", "--help"]).stdout
    assert "--run-tag" in help_text and "--tag " not in help_text
    result = runner.invoke(app, ["merge", str(a), "--tag", "a", "--run-tag", "b"])
    assert result.exit_code == 2
    assert "--tag a and --run-tag b disagree" in result.stderr
    result = runner.invoke(app, ["merge", str(a), "--run-tag", "two words"])
    assert result.exit_code == 2
    assert "run tag 'two words' contains whitespace" in result.stderr


def test_ids_with_control_or_zero_width_characters_are_refused(tmp_path):
    a = tmp_path / "a.trec"
    a.write_text("q1 Q0 d\u200b1 1 2 t\n")
    result = runner.invoke(app, ["merge", str(a)])
    assert result.exit_code == 1
    assert f"{a}:1: column 3 'd\\u200b1' contains an invisible zero-width character, U+200B" in result.stderr
    a.write_text("q\x001\td1\t1\t2.5\n")
    result = runner.invoke(app, ["merge", str(a)])
    assert result.exit_code == 1
    assert f"{a}:1: column 1 'q\\x001' contains a control character, U+0000" in result.stderr
