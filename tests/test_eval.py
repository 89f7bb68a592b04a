"""`maxsim eval` and `maxsim_cli.evaluate`: values checked against hand-computed measures."""

from __future__ import annotations

import gzip
import json
import math
import sys

import pytest
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.errors import MaxsimError, UsageError
from maxsim_cli.evaluate import evaluate_run, parse_measures

pytest.importorskip("ir_measures")

runner = CliRunner()

QRELS = "q1 0 d1 1\nq2 0 d2 1\nq3 0 a 1\nq3 0 b 0\n"
# q1: relevant at rank 1; q2: relevant at rank 2; q3: a tie at 1.0 that trec_eval breaks by docno
# descending, so "b" (non-relevant) comes before "a" -> reciprocal rank 1/2.
RUN = (
    "q1 Q0 d1 0 2.0 t\nq1 Q0 d3 1 1.0 t\n"
    "q2 Q0 d3 0 3.0 t\nq2 Q0 d2 1 1.0 t\n"
    "q3 Q0 a 0 1.0 t\nq3 Q0 b 1 1.0 t\n"
)
EXPECTED = {
    "nDCG@10": (1.0 + 1 / math.log2(3) + 1 / math.log2(3)) / 3,
    "RR@10": (1.0 + 0.5 + 0.5) / 3,
    "R@100": 1.0,
}


@pytest.fixture()
def files(tmp_path):
    run = tmp_path / "run.trec"
    run.write_text(RUN)
    qrels = tmp_path / "qrels.txt.gz"
    qrels.write_bytes(gzip.compress(QRELS.encode()))
    return str(run), str(qrels)


def test_evaluate_run_defaults(files):
    result = evaluate_run(*files)
    assert list(result.values) == ["nDCG@10", "RR@10", "R@100"]
    for name, value in EXPECTED.items():
        assert result.values[name] == pytest.approx(value, abs=1e-12)
    assert (result.run_queries, result.judged_queries, result.missing_queries) == (3, 3, 0)


def test_missing_queries_count_as_zero(tmp_path, files):
    run = tmp_path / "part.tsv"
    run.write_text("q1\td1\t1\nq9\td1\t1\n")  # MS MARCO format; q2, q3 absent, q9 unjudged
    result = evaluate_run(str(run), files[1], ["RR@10"])
    assert result.values == {"RR@10": pytest.approx(1 / 3)}
    assert (result.missing_queries, result.unjudged_queries) == (2, 1)


def test_parse_measures():
    assert [name for name, _ in parse_measures(["nDCG@10", "ndcg_cut_10", "P@5", "AP"])] == [
        "nDCG@10",
        "P@5",
        "AP",
    ]
    with pytest.raises(UsageError, match="unknown measure 'nDCG@x'"):
        parse_measures(["nDCG@x"])


def test_cli_table_and_counts(files):
    result = runner.invoke(app, ["eval", *files])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["nDCG@10", "RR@10", "R@100"]
    assert float(lines[0].split()[1]) == pytest.approx(EXPECTED["nDCG@10"], abs=5e-5)
    assert "3 judged queries, 3 in the run" in result.stderr


def test_cli_json_and_measures(files):
    result = runner.invoke(app, ["eval", *files, "-m", "RR@10", "--measure", "P@1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"RR@10": pytest.approx(2 / 3), "P@1": pytest.approx(1 / 3)}


def test_cli_run_from_stdin(files):
    result = runner.invoke(app, ["eval", "-", files[1], "-m", "R@100", "--json"], input=RUN)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"R@100": 1.0}


def test_cli_bad_measure_is_usage_error(files):
    result = runner.invoke(app, ["eval", *files, "-m", "nDCG@x"])
    assert result.exit_code == 2
    assert "unknown measure 'nDCG@x'" in result.stderr
    assert result.stdout == ""


def test_cli_bad_run_line(tmp_path, files):
    bad = tmp_path / "bad.trec"
    bad.write_text("q1 Q0 d1 0 2.0 t\nq1 Q0 d2 x\n")
    result = runner.invoke(app, ["eval", str(bad), files[1]])
    assert result.exit_code == 1
    assert f"maxsim: error: {bad}:2: 4 columns" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_disjoint_query_ids(tmp_path, files):
    run = tmp_path / "other.trec"
    run.write_text("x1 Q0 d1 0 2.0 t\n")
    result = runner.invoke(app, ["eval", str(run), files[1]])
    assert result.exit_code == 1
    assert "none of its 1 query ids appears in" in result.stderr


def test_both_stdin_is_usage_error():
    with pytest.raises(UsageError, match="cannot both be '-'"):
        evaluate_run("-", "-")


def test_missing_ir_measures(monkeypatch, files):
    monkeypatch.setitem(sys.modules, "ir_measures", None)  # makes `import ir_measures` fail
    with pytest.raises(MaxsimError, match=r"pip install 'maxsim\[eval\]'"):
        evaluate_run(*files)
    result = runner.invoke(app, ["eval", *files])
    assert result.exit_code == 1
    assert "pip install 'maxsim[eval]'" in result.stderr
