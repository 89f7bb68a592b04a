"""TREC run and qrels reading/writing: formats, ordering, float32 round trip, atomicity, errors."""

from __future__ import annotations

import gzip
import io
import json
import os
import sys

import numpy as np
import pytest

from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.run_files import (
    RunWriter,
    format_score,
    iter_qrels,
    iter_run,
    read_qrels,
    read_run,
    sort_trec,
)


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------------- reading


def test_trec_run_rank_column_is_not_trusted(tmp_path):
    # Ranks from 0 (PyTerrier, ir_datasets) and nonsense ranks both read; the order is the score's.
    path = write(tmp_path, "run.trec", "q1 Q0 d1 0 1.5 bm25\nq1 Q0 d2 1 2.5 bm25\nq2 Q0 d3 7 0.1 bm25\n")
    run = read_run(path)
    assert list(run) == ["q1", "q2"]
    assert run["q1"] == [("d1", 1.5), ("d2", 2.5)]
    docnos, scores = zip(*run["q1"], strict=True)
    assert [docnos[i] for i in sort_trec(docnos, scores)] == ["d2", "d1"]


def test_trec_run_qids_in_first_appearance_order_and_interleaved(tmp_path):
    path = write(tmp_path, "run.trec", "b Q0 x 1 3 t\na Q0 y 1 2 t\nb Q0 z 2 1 t\n")
    run = read_run(path)
    assert list(run) == ["b", "a"]
    assert run["b"] == [("x", 3.0), ("z", 1.0)]


def test_msmarco_run_score_is_minus_rank(tmp_path):
    path = write(tmp_path, "run.tsv", "1\t7\t1\n1\t3\t2\n2\t9\t1\n")
    run = read_run(path)
    assert run == {"1": [("7", -1.0), ("3", -2.0)], "2": [("9", -1.0)]}


def test_colbert_run_uses_score_column(tmp_path):
    path = write(tmp_path, "run.tsv", "1\t7\t1\t20.5\n1\t3\t2\t30.25\n")
    rows = list(iter_run(path))
    assert [(r.qid, r.docno, r.rank, r.score, r.line) for r in rows] == [
        ("1", "7", 1, 20.5, 1),
        ("1", "3", 2, 30.25, 2),
    ]


def test_gzip_run_and_blank_lines_and_crlf(tmp_path):
    path = tmp_path / "run.trec.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("q1 Q0 d1 1 2 t\r\n\nq1 Q0 d2 2 1 t\r\n")
    assert read_run(str(path)) == {"q1": [("d1", 2.0), ("d2", 1.0)]}
    # gzip is recognised by its magic bytes, not by the name
    os.rename(path, tmp_path / "plain-name")
    assert read_run(str(tmp_path / "plain-name"))["q1"][1] == ("d2", 1.0)


def test_run_from_stdin(monkeypatch):
    data = gzip.compress(b"q1 Q0 d1 1 2 t\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert read_run("-") == {"q1": [("d1", 2.0)]}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("q1 Q0 d1 1 2 t\nq1 Q0 d2 1 t\n", "run.txt:2: 5 columns, but the file started as TREC"),
        ("q1 Q0 d1 1 high t\n", "run.txt:1: score (column 5) 'high' is not a number"),
        ("q1 Q0 d1 1 nan t\n", "run.txt:1: score (column 5) is 'nan'; scores must be finite"),
        ("q1 Q0 d1 1 2 t\n\nq1 Q0 d1 2 1 t\n", "run.txt:3: docno 'd1' appears twice for query 'q1'"),
        ("q1 d1 1 2 t\n", "run.txt:1: 5 columns; expected a run in TREC"),
        ("q 1\td1\t1\n", "run.txt:1: column 1 'q 1' contains whitespace"),
        ("q1 Q0 d\x001 1 2 t\n", "run.txt:1: column 3 'd\\x001' contains a control character, U+0000"),
        ("q1\td\u200b1\t1\n", "run.txt:1: column 2 'd\\u200b1' contains an invisible zero-width character"),
        ("q1\td1\x7f\t1\t2\n", "run.txt:1: column 2 'd1\\x7f' contains a control character, U+007F"),
        ("q1\t\td1\t1\n", "run.txt:1: column 2 is empty"),
        ("q1\td1\tfirst\n", "run.txt:1: rank (column 3) 'first' is not an integer"),
        ("", "run.txt: the run is empty"),
        ("\n  \n", "run.txt: the run is empty"),
    ],
)
def test_run_errors_name_file_and_line(tmp_path, text, message):
    path = write(tmp_path, "run.txt", text)
    with pytest.raises(InputError) as info:
        read_run(path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(InputError) as info:
        list(iter_run(path))
    assert message in str(info.value)


def test_run_from_missing_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(InputError, match=r"<stdin>: no standard input to read the run from"):
        read_run("-")


def test_run_invalid_utf8_and_missing_file(tmp_path):
    path = tmp_path / "run.txt"
    path.write_bytes(b"q1 Q0 d1 1 2 t\nq1 Q0 d\xff 2 1 t\n")
    with pytest.raises(InputError, match=r"run.txt:2: not valid UTF-8"):
        read_run(str(path))
    with pytest.raises(InputError, match=r"nope.trec: run file not found"):
        read_run(str(tmp_path / "nope.trec"))


def test_truncated_gzip(tmp_path):
    path = tmp_path / "run.gz"
    data = "".join(f"q1 Q0 d{i} {i} {-i} t\n" for i in range(1000)).encode()
    path.write_bytes(gzip.compress(data)[:200])
    with pytest.raises(InputError, match=r"run.gz:\d+: corrupt or truncated gzip"):
        read_run(str(path))


def test_qrels(tmp_path):
    path = tmp_path / "qrels.gz"
    path.write_bytes(gzip.compress(b"q1 0 d1 1\nq1 0 d2 0\nq2 0 d1 2\n"))
    assert read_qrels(str(path)) == {"q1": {"d1": 1, "d2": 0}, "q2": {"d1": 2}}
    assert [q.line for q in iter_qrels(str(path))] == [1, 2, 3]
    bad = write(tmp_path, "qrels.txt", "q1 0 d1 1\nq1 0 d1 2\n")
    with pytest.raises(InputError, match=r"qrels.txt:2: query 'q1' judges docno 'd1' twice"):
        read_qrels(bad)
    bad = write(tmp_path, "qrels.txt", "q1 0 d1 yes\n")
    with pytest.raises(InputError, match=r"qrels.txt:1: relevance \(column 4\) 'yes' is not an integer"):
        read_qrels(bad)
    bad = write(tmp_path, "qrels.txt", "q1 d1 1\n")
    with pytest.raises(InputError, match=r"qrels.txt:1: 3 columns; expected TREC qrels"):
        read_qrels(bad)
    bad = write(tmp_path, "qrels.txt", "q1 0 d1 1\nq1 0 \ufeffd2 1\n")  # a BOM is allowed on line 1 only
    with pytest.raises(InputError, match=r"qrels.txt:2: column 3 '\\ufeffd2' contains an invisible"):
        read_qrels(bad)


# ------------------------------------------------------------------------------------ ordering, format


def test_format_score_round_trips_float32():
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 5000),
            np.array([0.1, 1 / 3, 2**-149, 3.4028235e38, 123456789.0], dtype=np.float32),
        ]
    ).astype(np.float32)
    for v in values:
        assert np.float32(float(format_score(float(v)))) == v
    assert format_score(-0.0) == "0"
    # Scores that differ only below float32 resolution print (and sort) as equal.
    assert format_score(1.0) == format_score(1.0 + 1e-12) == "1"
    # the shortest decimal that reads back as the float32: no digits beyond what it takes
    assert [format_score(v) for v in (0.1, 31.97153, 1e-7, -2.5)] == ["0.1", "31.97153", "1e-7", "-2.5"]
    digits = [format_score(float(v)).lstrip("-").split("e")[0].replace(".", "").strip("0") for v in values]
    assert max(len(d) for d in digits) <= 9  # never more significant digits than '.9g' prints


def test_sort_trec_ties_by_docno_descending_on_float32_value():
    docnos = ["a", "c", "b", "d", "e"]
    scores = [1.0, 2.0, 1.0 + 1e-12, 2.0, 0.5]  # 1.0 + 1e-12 is 1.0 in float32: a tie with "a"
    assert [docnos[i] for i in sort_trec(docnos, scores)] == ["d", "c", "b", "a", "e"]


# -------------------------------------------------------------------------------------------- writing


def test_run_writer_trec(tmp_path):
    out = tmp_path / "out.trec"
    with RunWriter(str(out), tag="exp1") as writer:
        writer.write_query("q2", ["d1", "d3", "d2"], [0.5, 0.75, 0.75])
        writer.write_query("q1", ["x"], [np.float32(0.1)])
    assert out.read_text() == (
        "q2 Q0 d3 1 0.75 exp1\nq2 Q0 d2 2 0.75 exp1\nq2 Q0 d1 3 0.5 exp1\nq1 Q0 x 1 0.1 exp1\n"
    )
    assert (writer.num_queries, writer.num_rows) == (2, 4)
    # what was written reads back to the same ranking and float32 scores
    run = read_run(str(out))
    assert list(run) == ["q2", "q1"]
    assert np.float32(run["q1"][0][1]) == np.float32(0.1)


def test_run_writer_rows_match_format_score_in_either_order_path(tmp_path):
    """Sorted input (no sort needed) and unsorted input give the rows format_score and sort_trec say, and
    ids or tags holding '%' come out literally."""
    rng = np.random.default_rng(5)
    scores = rng.standard_normal(300).astype(np.float32)
    scores[[3, 7]] = -0.0
    docnos = [f"d%{i}s" for i in range(300)]
    by_score = np.argsort(-scores, kind="stable")
    distinct = np.unique(scores)[::-1]  # strictly descending: the writer's no-sort path
    cases = {
        "shuffled": (docnos, scores.tolist()),
        "sorted with a tie": ([docnos[i] for i in by_score], scores[by_score]),
        "strictly descending": (docnos[: len(distinct)], distinct),
    }
    for name, (ids, values) in cases.items():
        out = tmp_path / f"{name}.trec"
        with RunWriter(str(out), tag="run%d") as writer:
            writer.write_query("q%s", ids, values)
        order = sort_trec(ids, values)
        expected = "".join(
            f"q%s Q0 {ids[i]} {rank} {format_score(values[i])} run%d\n" for rank, i in enumerate(order, 1)
        )
        assert out.read_text() == expected, name


@pytest.mark.parametrize("part_rows", [32768, 60])  # one part, or parts formatted side by side
def test_write_ranked_block_equals_write_query_per_query(tmp_path, monkeypatch, part_rows):
    """The whole-block path (Arrow) writes the bytes that write_query writes for the same rows, ties and
    -0 included; a block with a bad row goes through write_query, which names it."""
    import pyarrow as pa

    from maxsim_cli import run_files as runs

    monkeypatch.setattr(runs, "_PARALLEL_ROWS", part_rows)
    monkeypatch.setattr(runs.os, "cpu_count", lambda: 4)
    rng = np.random.default_rng(8)
    nq, m = 7, 50
    scores = np.round(rng.standard_normal((nq, m)), 1).astype(np.float32)  # many ties
    scores[0, :3] = -0.0
    docnos = np.array([f"doc{i:03d}" for i in range(400)])
    rows = []
    for q in range(nq):
        picked = rng.choice(len(docnos), m, replace=False)
        order = sort_trec(list(docnos[picked]), scores[q].tolist())
        rows.append((picked[order], scores[q][order]))
    block_scores = np.stack([r[1] for r in rows])
    block_docnos = pa.array(np.concatenate([docnos[r[0]] for r in rows]).tolist())
    qids = [f"q{q}" for q in range(nq)]
    a, b = tmp_path / "block.trec", tmp_path / "each.trec"
    with RunWriter(str(a), tag="t") as writer:
        writer.write_ranked(qids, block_docnos, block_scores)
    assert (writer.num_queries, writer.num_rows) == (nq, nq * m)
    with RunWriter(str(b), tag="t") as writer:
        for q in range(nq):
            writer.write_query(qids[q], list(docnos[rows[q][0]]), rows[q][1].tolist())
    assert a.read_bytes() == b.read_bytes()
    # a tie handed over in the wrong docno order is sorted as write_query sorts it
    tied = np.argwhere(block_scores[:, :-1] == block_scores[:, 1:])
    q, j = int(tied[0][0]), int(tied[0][1])
    swapped = block_docnos.to_pylist()
    swapped[q * m + j], swapped[q * m + j + 1] = swapped[q * m + j + 1], swapped[q * m + j]
    c = tmp_path / "swapped.trec"
    with RunWriter(str(c), tag="t") as writer:
        writer.write_ranked(qids, pa.array(swapped), block_scores)
    assert c.read_bytes() == b.read_bytes()
    # corpus ids (checked when their shards were read) skip the id checks, never the order's
    with RunWriter(str(c), tag="t") as writer:
        writer.write_ranked(qids, pa.array(swapped), block_scores, corpus_ids=True)
    assert c.read_bytes() == b.read_bytes()
    bad = block_scores.copy()
    bad[3, 5] = np.inf
    with pytest.raises(InputError, match=r"score inf of docno '.*' for query 'q3' is not finite"):
        with RunWriter(str(tmp_path / "bad.trec")) as writer:
            writer.write_ranked(qids, block_docnos, bad)
    assert not (tmp_path / "bad.trec").exists()
    spaced = pa.array(["a b"] + block_docnos.to_pylist()[1:])
    with pytest.raises(InputError, match="docno 'a b' .*whitespace"):
        with RunWriter(str(tmp_path / "bad.trec")) as writer:
            writer.write_ranked(qids, spaced, block_scores)
    # every character an id may not hold (Python's \s, control and zero-width characters) is caught on
    # the Arrow path too (RE2's \s is ASCII only)
    import pyarrow.compute as pc

    from maxsim_cli.shards import ID_FORBIDDEN, ID_FORBIDDEN_RE2, has_forbidden_chars

    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    forbidden = [c for c in chars if ID_FORBIDDEN.match(c)]
    assert {"\x00", "\x7f", "\u200b", "\u200d", "\u2060", "\ufeff", "\u3000"} <= set(forbidden)
    found = pc.match_substring_regex(pa.array([f"d{c}x" for c in forbidden]), ID_FORBIDDEN_RE2)
    assert all(found.to_pylist())
    assert all(has_forbidden_chars(pa.array([f"d{c}x"])) for c in forbidden)  # ASCII: the byte table
    assert not has_forbidden_chars(pa.array([f"d{c}x" for c in chars if not ID_FORBIDDEN.match(c)]))
    with pytest.raises(InputError, match=r"docno 'a\\x00b' .*contains a control character, U\+0000"):
        with RunWriter(str(tmp_path / "bad.trec")) as writer:
            writer.write_ranked(qids, pa.array(["a\x00b"] + block_docnos.to_pylist()[1:]), block_scores)
    with pytest.raises(InputError, match="whitespace"):
        with RunWriter(str(tmp_path / "bad.trec")) as writer:
            writer.write_ranked(qids, pa.array(["a\u3000b"] + block_docnos.to_pylist()[1:]), block_scores)


def test_run_writer_jsonl_and_gzip(tmp_path):
    out = tmp_path / "out.jsonl.gz"
    with RunWriter(str(out), fmt="jsonl") as writer:
        writer.write_query("q1", ["d1", "d2"], [1.0, 3.0])
    lines = gzip.decompress(out.read_bytes()).decode().splitlines()
    assert [json.loads(line) for line in lines] == [
        {
            "qid": "q1",
            "results": [{"docno": "d2", "rank": 1, "score": 3}, {"docno": "d1", "rank": 2, "score": 1}],
        }
    ]


def test_run_writer_gzip_is_deterministic_and_readable(tmp_path):
    blobs = []
    for name in ("a.trec.gz", "b.trec.gz"):
        with RunWriter(str(tmp_path / name)) as writer:
            writer.write_query("q1", ["d1", "d2"], [1.0, 2.0])
        blobs.append((tmp_path / name).read_bytes())
    assert blobs[0] == blobs[1]
    assert read_run(str(tmp_path / "a.trec.gz")) == {"q1": [("d2", 2.0), ("d1", 1.0)]}


def test_run_writer_is_atomic(tmp_path):
    out = tmp_path / "out.trec"
    with pytest.raises(RuntimeError), RunWriter(str(out)) as writer:
        writer.write_query("q1", ["d1"], [1.0])
        raise RuntimeError("scoring failed")
    assert os.listdir(tmp_path) == []
    # an existing file is left untouched by a failed run
    out.write_text("old\n")
    with pytest.raises(InputError), RunWriter(str(out)) as writer:
        writer.write_query("q1", ["d 1"], [1.0])
    assert out.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["out.trec"]


@pytest.mark.parametrize(
    ("qid", "docnos", "scores", "message"),
    [
        ("q 1", ["d1"], [1.0], "query id 'q 1' contains whitespace, U+0020 SPACE, at character 1"),
        ("q1", ["d\t1"], [1.0], "docno 'd\\t1' (query 'q1') contains whitespace, U+0009"),
        ("q1", ["d\u200b1"], [1.0], "docno 'd\\u200b1' (query 'q1') contains an invisible zero-width"),
        ("q\x001", ["d1"], [1.0], "query id 'q\\x001' contains a control character, U+0000"),
        ("q1", [""], [1.0], "docno '' (query 'q1') is empty"),
        ("q1", ["d1"], [float("nan")], "score nan of docno 'd1' for query 'q1' is not finite"),
        ("q1", ["d1", "d1"], [1.0, 2.0], "docno 'd1' given twice for query 'q1'"),
    ],
)
def test_run_writer_rejects_bad_rows(tmp_path, qid, docnos, scores, message):
    with pytest.raises(InputError) as info, RunWriter(str(tmp_path / "o.trec")) as writer:
        writer.write_query(qid, docnos, scores)
    assert message in str(info.value)
    assert os.listdir(tmp_path) == []


def test_run_writer_query_twice_and_bad_tag(tmp_path):
    with pytest.raises(InputError, match="query 'q1' written twice"), RunWriter(str(tmp_path / "o")) as w:
        w.write_query("q1", ["d1"], [1.0])
        w.write_query("q1", ["d2"], [1.0])
    with pytest.raises(UsageError, match="run tag 'my run'"):
        RunWriter(str(tmp_path / "o"), tag="my run")
    with pytest.raises(UsageError, match="unknown run format"):
        RunWriter(str(tmp_path / "o"), fmt="csv")
    with pytest.raises(UsageError, match="does not exist"), RunWriter(str(tmp_path / "no" / "o")):
        pass


def test_run_writer_stdout_flushes_per_query(capsys):
    with RunWriter("-", tag="t") as writer:
        writer.write_query("q1", ["d1"], [2.0])
        assert capsys.readouterr().out == "q1 Q0 d1 1 2 t\n"
        writer.write_query("q2", ["d1"], [1.0])
    assert capsys.readouterr().out == "q2 Q0 d1 1 1 t\n"


@pytest.mark.parametrize("n", [47, 48, 49, 1000])
def test_sort_trec_orders_long_lists_as_pythons_sort_does(n: int) -> None:
    """From 48 entries `sort_trec` sorts in numpy: the same order as Python's sort of (float32 score,
    docno) descending, with ties in score, non-ASCII docnos, -0.0 and repeated entries."""
    import random

    from maxsim_cli.run_files import _float32_keys, sort_trec

    rng = random.Random(n)
    for _ in range(20):
        docnos = [rng.choice(["d", "D", "é", "zz", "d1", "💡"]) + str(rng.randrange(n)) for _ in range(n)]
        scores = [rng.choice([0.5, -0.0, 0.0, 1.25, 1.0000001, rng.random()]) for _ in docnos]
        keys = _float32_keys(scores).tolist()
        expected = sorted(range(n), key=lambda i: (keys[i], docnos[i]), reverse=True)
        assert sort_trec(docnos, scores) == expected
    for _ in range(5):  # distinct scores: the scores alone decide (no docno array is built)
        docnos = [f"d{rng.randrange(n)}" for _ in range(n)]
        scores = rng.sample(range(-n, n), n)
        keys = _float32_keys(scores).tolist()
        expected = sorted(range(n), key=lambda i: (keys[i], docnos[i]), reverse=True)
        assert sort_trec(docnos, scores) == expected
