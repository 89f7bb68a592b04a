"""`maxsim verify QUERIES COMPRESSED --exact-from CORPUS`: a compressed tier's recall of the exact top k at
the default depth and over a range of depths, and its score error against the exact FP32 scores, with a
verdict. sample_data's corpus quantized to 4-bit and 2-bit codes (small codebooks, on the CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
from tierlib import quantize
from typer.testing import CliRunner

from maxsim_cli import search
from maxsim_cli.cli import app
from maxsim_cli.verify.tiers import recall_at, score_errors

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data"
QUERIES = str(SAMPLE / "queries.safetensors")
CORPUS = str(SAMPLE / "corpus")
runner = CliRunner()


def _verify(*args: str):
    return runner.invoke(app, ["verify", QUERIES, *args, "--device", "cpu", "-q"])


def _benchmark():
    """benchmarks/two_stage_recall.py, whose `recall_rows` the figures of docs/two-stage.md come from."""
    path = ROOT / "benchmarks" / "two_stage_recall.py"
    spec = importlib.util.spec_from_file_location("two_stage_recall", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bits", [4, 2])
def test_the_report_agrees_with_the_benchmarks_recall(tiers, bits) -> None:
    result = _verify(tiers[bits], "--exact-from", CORPUS, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] is True and report["mode"] == "compressed-tier"
    details = report["details"]
    assert details["setup"]["quantization"] == {4: "int4-per-token", 2: "residual2-kmeans"}[bits]
    assert details["default_depth"] == {"10": 400, "100": 400}  # 1000 and 2000 capped at 400 documents
    assert report["recall_at_default_depth"] == {"10": 1.0, "100": 1.0}
    assert [c["name"] for c in report["checks"]] == ["recall@10", "recall@100"]
    # the benchmark's recall, from the library's runs: the same figure for every (k, depth)
    exact = search(QUERIES, CORPUS, k=100, device="cpu").to_dict()
    approx = search(QUERIES, tiers[bits], k=400, device="cpu").to_dict()
    rows = {(r["k"], r["depth"]): (r["mean"], r["min"]) for r in details["recall"]}
    assert {depth for k, depth in rows if k == 10} == {100, 200, 400}
    expected = _benchmark().recall_rows(exact, approx, [10, 100], sorted({d for _, d in rows}))
    assert {(k, depth): (mean, worst) for k, depth, mean, worst in expected} == pytest.approx(rows)
    # the score error: of the codes, against the exact scores; relative to each query's score scale
    errors = details["score_errors"]
    assert errors["count"] == 200 * 400 and errors["nonfinite_mismatches"] == 0
    assert 0 < errors["mean_abs"] <= errors["p99_abs"] <= errors["max_abs"] == report["max_abs_error"]
    assert 0 < errors["mean_rel"] <= errors["max_rel"] < 1


def test_the_text_report(tiers) -> None:
    result = _verify(tiers[2], "--exact-from", CORPUS)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "compressed tier" in out and "residual2-kmeans" in out and "recall@10" in out
    assert "400*: 1.0000" in out and "PASS  recall@100" in out and "verdict: PASS" in out


def test_a_recall_below_the_rule_fails_with_exit_3(tiers, monkeypatch) -> None:
    """At a default depth of 12, the 2-bit tier misses some of the exact top 10: the verdict fails."""
    monkeypatch.setattr("maxsim_cli.scoring.request.default_depth", lambda quantization, k: max(12, k))
    result = _verify(tiers[2], "--exact-from", CORPUS, "--json", "--min-recall", "0.999")
    assert result.exit_code == 3, result.output
    report = json.loads(result.stdout)
    assert report["passed"] is False and report["checks"][0]["passed"] is False
    assert report["recall_at_default_depth"]["10"] < 0.999


def test_codes_without_exact_from_say_what_verify_needs(tiers) -> None:
    result = _verify(tiers[4])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "add --exact-from CORPUS" in result.stderr
    assert tiers[4] in result.stderr


def test_a_mismatched_pair_is_one_line(tiers, tmp_path) -> None:
    half = tmp_path / "half"
    quantize(os.path.join(CORPUS, "shard-00000.safetensors"), str(half), 4)
    result = _verify(str(half), "--exact-from", CORPUS)
    assert result.exit_code == 1
    line = result.stderr.strip()
    assert "\n" not in line and str(half) in line and CORPUS in line and "quantized from" in line
    assert result.stdout == ""


@pytest.mark.parametrize(
    "extra", [["--sample-docs", "10"], ["--grad"], ["--atol", "0.1"], ["--reference-corpus", CORPUS]]
)
def test_options_of_the_kernel_check_are_usage_errors_with_exact_from(tiers, extra) -> None:
    result = _verify(tiers[4], "--exact-from", CORPUS, *extra)
    assert result.exit_code == 2 and "does not apply with --exact-from" in result.stderr


def test_min_recall_goes_with_exact_from() -> None:
    result = _verify(CORPUS, "--min-recall", "0.9")
    assert result.exit_code == 2 and "--exact-from" in result.stderr


def test_recall_and_errors_on_a_small_case() -> None:
    # 2 queries x 4 documents: exact order [0, 1, 2, 3] and [3, 2, 1, 0]
    exact_order = np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
    compressed_rank = np.array([[0, 2, 1, 3], [0, 1, 2, 3]])  # document -> rank by the codes
    assert recall_at(exact_order, compressed_rank, 2, 2).tolist() == [0.5, 0.0]
    assert recall_at(exact_order, compressed_rank, 2, 3).tolist() == [1.0, 0.5]
    exact = np.array([[4.0, 2.0], [-1.0, 0.5]], dtype=np.float32)
    approx = np.array([[3.0, 2.0], [-1.0, 1.0]], dtype=np.float32)
    stats = score_errors(approx, exact)
    assert (stats.max_abs, stats.mean_abs) == (1.0, 0.375)
    assert (stats.max_rel, stats.mean_rel) == (0.5, (0.25 + 0.5) / 4)
