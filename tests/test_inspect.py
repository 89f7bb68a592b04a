"""`maxsim inspect`: per-shard and total counts, token-length statistics, bytes; text and JSON."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.inspect_shards import inspect_paths
from maxsim_cli.shards import write_manifest, write_shard

runner = CliRunner()


@pytest.fixture
def corpus(tmp_path):
    """Two shards with known lengths: [1, 2, 3, 10] and [4, 4] (24 tokens)."""
    rng = np.random.default_rng(0)
    a = [rng.standard_normal((k, 6)).astype(np.float32) for k in (1, 2, 3, 10)]
    b = [rng.standard_normal((k, 6)).astype(np.float32) for k in (4, 4)]
    write_shard(tmp_path / "a.safetensors", ["a0", "a1", "a2", "a3"], a, dtype="bfloat16", encoder="enc")
    write_shard(tmp_path / "b.arrow", ["b0", "b1"], b, dtype="bfloat16", encoder="enc")
    write_manifest(tmp_path)
    return tmp_path


def test_json_report(corpus):
    result = runner.invoke(app, ["inspect", str(corpus), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["num_docs"], report["num_tokens"], report["dim"], report["dtype"]) == (
        6,
        24,
        6,
        "bfloat16",
    )
    assert (report["quantization"], report["normalized"], report["encoder"]) == ("none", False, "enc")
    assert report["values_checked"] is True
    lengths = np.array([1, 2, 3, 10, 4, 4])
    assert report["token_lengths"] == {
        "min": 1,
        "mean": pytest.approx(24 / 6),
        "median": 3.5,
        "p99": pytest.approx(float(np.percentile(lengths, 99))),
        "max": 10,
    }
    a, b = report["shards"]
    assert os.path.basename(a["path"]) == "a.safetensors" and a["format"] == "safetensors"
    assert (a["num_docs"], a["num_tokens"], a["token_lengths"]["median"]) == (4, 16, 2.5)
    assert (b["num_docs"], b["num_tokens"], b["format"]) == (2, 8, "arrow")
    assert a["bytes"] == os.path.getsize(corpus / "a.safetensors")
    assert report["bytes"] == a["bytes"] + b["bytes"]


def test_text_report(corpus):
    result = runner.invoke(app, ["inspect", str(corpus / "a.safetensors"), str(corpus / "b.arrow")])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "shard",
        "docs",
        "tokens",
        "len",
        "min",
        "mean",
        "median",
        "p99",
        "max",
        "bytes",
        "normalised",
    ]
    assert lines[1].split()[:4] == [str(corpus / "a.safetensors"), "4", "16", "1"]
    assert lines[3].split()[:3] == ["total", "6", "24"]
    assert "dim 6  dtype bfloat16  quantization none  normalised no  encoder enc  values checked" in lines[4]
    assert result.stderr == ""  # no bar when stderr is not a terminal


def test_int8_and_normalized_shard(tmp_path):
    q = torch.randint(-127, 128, (5, 4), dtype=torch.int8)
    write_shard(
        tmp_path / "q.parquet", ["x", "y"], q, offsets=[0, 2, 5], scales=torch.rand(5), normalized=True
    )
    report = inspect_paths([str(tmp_path / "q.parquet")])
    assert (report.dtype, report.quantization, report.normalized) == ("int8", "int8-per-token", True)
    assert report.shards[0].format == "parquet"


def test_check_values_can_be_turned_off(corpus, monkeypatch):
    calls = []
    report = inspect_paths([str(corpus)], check_values=True, progress=lambda done, total: calls.append(done))
    assert report.values_checked and calls[-1] == 24
    calls.clear()
    report = inspect_paths([str(corpus)], check_values=False, progress=lambda done, total: calls.append(done))
    assert not report.values_checked and calls == []


def test_checksums_on_request(corpus):
    result = runner.invoke(app, ["inspect", str(corpus), "--verify-checksums", "--json"])
    assert result.exit_code == 0, result.output
    (corpus / "b.arrow").write_bytes((corpus / "b.arrow").read_bytes()[:-1] + b"\x00")
    result = runner.invoke(app, ["inspect", str(corpus), "--verify-checksums"])
    assert result.exit_code == 1 and "b.arrow: sha256" in result.stderr


def test_missing_path_and_help():
    result = runner.invoke(app, ["inspect", "no/such/dir"])
    assert result.exit_code == 1
    assert result.stderr.strip() == "maxsim: error: no/such/dir: no such file or directory"
    result = runner.invoke(app, ["inspect", "--help"])
    assert result.exit_code == 0 and "Example: maxsim inspect" in result.stdout


def test_documents_with_all_zero_token_rows_are_counted_and_warned(tmp_path):
    """Padding kept without its mask (zero rows at the end of padded documents): one warning line with
    the count and the first document, and the counts in the JSON; none without the value check."""
    rng = np.random.default_rng(3)
    docs = [rng.standard_normal((5, 8)).astype(np.float32) for _ in range(6)]
    for i in (1, 4):
        docs[i][3:] = 0.0  # a padded document: its last two rows are zeros
    with pytest.warns(UserWarning):  # `write_shard` warns too
        write_shard(tmp_path / "a.safetensors", [f"d{i}" for i in range(3)], docs[:3], dtype="float16")
        write_shard(tmp_path / "b.safetensors", [f"d{i}" for i in range(3, 6)], docs[3:], dtype="float16")
    result = runner.invoke(app, ["inspect", str(tmp_path), "--json", "-q"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["zero_row_docs"], report["first_zero_row_doc"]) == (2, "d1")
    assert [(s["zero_row_docs"], s["first_zero_row_doc"]) for s in report["shards"]] == [(1, "d1"), (1, "d4")]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maxsim: warning: the corpus: 2 documents carry all-zero")
    assert "'d1' at " in lines[0] and "a.safetensors" in lines[0]
    one = runner.invoke(app, ["inspect", str(tmp_path / "b.safetensors"), "-q"])
    assert one.exit_code == 0
    b = tmp_path / "b.safetensors"
    assert one.stderr.startswith(f"maxsim: warning: {b}: 1 document carries all-zero")
    unchecked = runner.invoke(app, ["inspect", str(tmp_path), "--json", "--no-check-values"])
    assert unchecked.exit_code == 0 and unchecked.stderr == ""
    assert json.loads(unchecked.stdout)["zero_row_docs"] is None


def test_clean_values_give_no_warning_and_zero_counts(corpus):
    result = runner.invoke(app, ["inspect", str(corpus), "--json", "-q"])
    assert result.exit_code == 0 and result.stderr == ""
    assert json.loads(result.stdout)["zero_row_docs"] == 0


@pytest.mark.parametrize("suffix", ["safetensors", "arrow"])
def test_the_value_check_streams_in_bounded_memory(tmp_path, monkeypatch, suffix):
    """The check's memory does not grow with the corpus: 48 MB of fp16 values checked 1 MiB at a time
    grow the process by much less than the corpus (the values were once read through a map, whose
    pages stayed resident: 3 GiB for a 2.5 GB corpus)."""
    from maxsim_cli import inspect_shards
    from maxsim_cli.memory import HostMeter

    tokens, dim = 3 * (1 << 16), 128
    values = torch.randn(tokens, dim, dtype=torch.float16)
    path = tmp_path / f"big.{suffix}"
    write_shard(path, [f"d{i}" for i in range(tokens // 64)], values, offsets=torch.arange(0, tokens + 1, 64))
    del values
    monkeypatch.setattr(inspect_shards, "CHECK_BATCH_TOKENS", 4096)  # 1 MiB batches
    inspect_paths([str(path)], check_values=False)  # libraries and allocator pools in place first
    with HostMeter() as meter:
        report = inspect_paths([str(path)])
        grown = meter.peak_growth()
    assert report.values_checked and report.num_tokens == tokens
    assert grown < 16 << 20, grown  # the corpus: 48 MiB
