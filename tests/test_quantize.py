"""`maxsim quantize` and `maxsim_cli.quantize`: round trip, streaming, atomicity, refusals, quality report."""

from __future__ import annotations

import json
import os

import maxsim_kernels
import numpy as np
import pytest
import torch
from maxsim_kernels.int8_host import quantize_per_token
from typer.testing import CliRunner

from maxsim_cli import quantize as quantize_module
from maxsim_cli.cli import app
from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.quantize import quantize_corpus
from maxsim_cli.shards import open_corpus, open_shard, write_shard

HAS_FLOAT_KERNEL = hasattr(maxsim_kernels, "maxsim_varlen")
needs_float_kernel = pytest.mark.skipif(not HAS_FLOAT_KERNEL, reason="maxsim_kernels.maxsim_varlen missing")


def make_docs(n: int, dim: int, seed: int, *, normalize: bool = True) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        x = torch.randn(int(torch.randint(1, 30, (1,), generator=gen)), dim, generator=gen)
        docs.append(torch.nn.functional.normalize(x, dim=1) if normalize else x)
    return docs


@pytest.fixture()
def corpus_dir(tmp_path):
    """Two fp16 shards (safetensors and Arrow) of L2-normalised random tokens, dim 48."""
    root = tmp_path / "corpus"
    root.mkdir()
    docs = make_docs(70, 48, 1)
    write_shard(
        root / "a.safetensors", [f"d{i}" for i in range(40)], docs[:40], dtype="float16", encoder="enc-x"
    )
    write_shard(
        root / "b.arrow", [f"d{i}" for i in range(40, 70)], docs[40:], dtype="float16", encoder="enc-x"
    )
    return root


def test_round_trip_keeps_ids_metadata_and_quantizes_per_token(corpus_dir, tmp_path) -> None:
    out = tmp_path / "int8"
    report = quantize_corpus([corpus_dir], out, sample_queries=0, batch_tokens=37)
    assert sorted(os.listdir(out)) == [
        "a.safetensors", "a.safetensors.idindex", "b.arrow", "b.arrow.idindex", "index.json"
    ]  # fmt: skip
    assert report.quality is None and report.num_docs == 70
    assert report.compression_ratio > 1.2  # fp16 dim 48: 96 -> 52 bytes a token, minus headers and ids
    source, target = open_corpus([corpus_dir]), open_corpus([out])
    assert target.dtype == "int8" and target.quantization == "int8-per-token"
    for s, t in zip(source.shards, target.shards, strict=True):
        assert os.path.basename(s.path) == os.path.basename(t.path)
        assert t.info.format == s.info.format
        assert t.ids == s.ids and np.array_equal(t.offsets, s.offsets)
        assert t.info.normalized and t.info.encoder == "enc-x"
        original, quantized = s.read_docs(0, s.num_docs), t.read_docs(0, t.num_docs)
        codes, scales = quantize_per_token(original.embeddings)
        assert torch.equal(quantized.embeddings, codes)
        assert torch.equal(quantized.scales, scales)
        error = (quantized.embeddings.float() * quantized.scales[:, None] - original.embeddings.float()).abs()
        assert (error <= quantized.scales[:, None] * (0.5 + 1e-5)).all()


def test_batch_size_does_not_change_the_bytes(corpus_dir, tmp_path) -> None:
    quantize_corpus([corpus_dir], tmp_path / "one", sample_queries=0, batch_tokens=1)
    quantize_corpus([corpus_dir], tmp_path / "all", sample_queries=0, batch_tokens=1 << 20)
    for name in ("a.safetensors", "b.arrow"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "all" / name).read_bytes()


def test_int8_input_is_refused(corpus_dir, tmp_path) -> None:
    quantize_corpus([corpus_dir], tmp_path / "int8", sample_queries=0)
    with pytest.raises(InputError, match="already int8") as info:
        quantize_corpus([tmp_path / "int8"], tmp_path / "again", sample_queries=0)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "again").exists()


def test_mixed_corpus_is_refused(corpus_dir, tmp_path) -> None:
    quantize_corpus([corpus_dir / "a.safetensors"], tmp_path / "int8", sample_queries=0)
    with pytest.raises(InputError, match="dtype mismatch"):
        quantize_corpus(
            [tmp_path / "int8" / "a.safetensors", corpus_dir / "b.arrow"], tmp_path / "x", sample_queries=0
        )


def test_existing_output_is_refused(corpus_dir, tmp_path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(UsageError, match="already exists and is not empty; .* or pass --overwrite"):
        quantize_corpus([corpus_dir], tmp_path / "busy", sample_queries=0)
    assert os.listdir(tmp_path / "busy") == ["keep.txt"]


def test_overwrite_replaces_the_shards_and_keeps_other_files(corpus_dir, tmp_path) -> None:
    out = tmp_path / "int8"
    first = quantize_corpus([corpus_dir], out, sample_queries=0)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    (out / "notes.txt").write_text("mine")
    (out / "old-shard.arrow").write_bytes(b"a shard of an earlier corpus")
    again = quantize_corpus([corpus_dir], out, sample_queries=0, overwrite=True)
    assert sorted(os.listdir(out)) == sorted([*before, "notes.txt"])  # the old shard went, notes stayed
    assert {name: (out / name).read_bytes() for name in before} == before  # the same bytes again
    assert (out / "notes.txt").read_text() == "mine" and again.num_docs == first.num_docs
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging folder left


def test_overwrite_that_fails_keeps_the_old_corpus(corpus_dir, tmp_path, monkeypatch) -> None:
    out = tmp_path / "int8"
    quantize_corpus([corpus_dir], out, sample_queries=0)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    real_replace = os.replace
    calls = []

    def failing_replace(src, dst):  # the second new file to move into OUTDIR fails
        if os.path.dirname(dst) == str(out):
            calls.append(dst)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(quantize_module.os, "replace", failing_replace)
    with pytest.raises(Exception, match="int8: cannot write: no space left on device"):
        quantize_corpus([corpus_dir], out, sample_queries=0, overwrite=True)
    monkeypatch.undo()
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_cli_overwrite_and_quiet(corpus_dir, tmp_path) -> None:
    out = str(tmp_path / "int8")
    args = ["quantize", str(corpus_dir), "-o", out, "--sample-queries", "0", "--device", "cpu"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert first.stderr.startswith("quantized 70 documents (") and " tokens, dim 48)" in first.stderr
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "pass --overwrite" in refused.stderr
    again = CliRunner().invoke(app, [*args, "--overwrite", "--quiet"])
    assert again.exit_code == 0, again.output
    assert again.stderr == "" and again.stdout == ""


def test_progress_is_told_every_batch(corpus_dir, tmp_path) -> None:
    seen: list[tuple[int, int]] = []
    report = quantize_corpus(
        [corpus_dir], tmp_path / "q", sample_queries=0, batch_tokens=100, progress=lambda *a: seen.append(a)
    )
    assert len(seen) > 2 and seen[-1] == (report.num_tokens, report.num_tokens)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)


def test_failure_leaves_nothing(corpus_dir, tmp_path, monkeypatch) -> None:
    calls = {"n": 0}
    real = quantize_module._quantize_batch

    def failing(batch, device):
        calls["n"] += 1
        if calls["n"] == 3:
            raise InputError("disk full")
        return real(batch, device)

    monkeypatch.setattr(quantize_module, "_quantize_batch", failing)
    before = set(os.listdir(tmp_path))
    with pytest.raises(InputError, match="disk full"):
        quantize_corpus([corpus_dir], tmp_path / "out", sample_queries=0, batch_tokens=200)
    assert set(os.listdir(tmp_path)) == before  # no OUTDIR, no staging directory


def test_clashing_names_are_refused(corpus_dir, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    write_shard(other / "a.safetensors", ["z1"], [torch.ones(2, 48)], dtype="float16")
    with pytest.raises(UsageError, match="clashes"):
        quantize_corpus([corpus_dir, other], tmp_path / "out", sample_queries=0)


# -- CLI ---------------------------------------------------------------------------------------------------


def test_cli_refuses_int8_input_with_one_line(corpus_dir, tmp_path) -> None:
    runner = CliRunner()
    first = runner.invoke(
        app, ["quantize", str(corpus_dir), "-o", str(tmp_path / "q"), "--sample-queries", "0"]
    )
    assert first.exit_code == 0, first.output
    result = runner.invoke(
        app, ["quantize", str(tmp_path / "q"), "-o", str(tmp_path / "q2"), "--sample-queries", "0"]
    )
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "already int8" in lines[0] and "a.safetensors" in lines[0]
    assert not (tmp_path / "q2").exists()


def test_cli_mixed_corpus_exit_1(corpus_dir, tmp_path) -> None:
    runner = CliRunner()
    runner.invoke(
        app, ["quantize", str(corpus_dir / "b.arrow"), "-o", str(tmp_path / "q"), "--sample-queries", "0"]
    )
    args = [
        "quantize",
        str(corpus_dir / "a.safetensors"),
        str(tmp_path / "q" / "b.arrow"),
        "-o",
        str(tmp_path / "x"),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "mismatch" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_existing_output_exit_2(corpus_dir, tmp_path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    result = CliRunner().invoke(app, ["quantize", str(corpus_dir), "-o", str(tmp_path / "busy")])
    assert result.exit_code == 2 and "already exists and is not empty" in result.stderr


def test_cli_help_has_example() -> None:
    result = CliRunner().invoke(app, ["quantize", "--help"])
    assert result.exit_code == 0
    assert "maxsim quantize" in result.stdout and "--sample-queries" in result.stdout


@needs_float_kernel
def test_cli_reports_ratio_and_quality(corpus_dir, tmp_path) -> None:
    args = [
        "quantize",
        str(corpus_dir),
        "-o",
        str(tmp_path / "q"),
        "--sample-queries",
        "8",
        "--sample-docs",
        "50",
    ]
    result = CliRunner().invoke(app, [*args, "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["num_docs"] == 70 and report["compression_ratio"] > 1.2
    quality = report["quality"]
    assert quality["queries"] == 8 and quality["docs"] == 50 and quality["pseudo_queries"]
    # Pseudo-queries of 1-29 normalised random tokens: int8 keeps every top-10 on this easy sample.
    assert quality["top10_overlap_mean"] >= 0.95 and quality["kendall_tau_mean"] > 0.9
    assert "compression ratio" in result.stderr and "top-10 overlap" in result.stderr


@needs_float_kernel
def test_quality_with_a_query_file_is_seeded(corpus_dir, tmp_path) -> None:
    write_shard(tmp_path / "queries.safetensors", ["q1", "q2", "q3"], make_docs(3, 48, 5), dtype="float32")
    kwargs = dict(
        sample_queries=2, sample_docs=30, seed=3, queries_path=str(tmp_path / "queries.safetensors")
    )
    first = quantize_corpus([corpus_dir], tmp_path / "one", device="cpu", **kwargs).quality
    second = quantize_corpus([corpus_dir], tmp_path / "two", device="cpu", **kwargs).quality
    assert first == second and first.queries == 2 and not first.pseudo_queries
    with open_shard(tmp_path / "one" / "a.safetensors") as shard:
        assert shard.info.dtype == "int8"


def test_quantize_keeps_the_patch_grid(tmp_path) -> None:
    (tmp_path / "in").mkdir()
    write_shard(tmp_path / "in" / "pages.safetensors", ["p1"], [torch.randn(6, 8)], patch_grid=(2, 2),
                patch_start=2)  # fmt: skip
    quantize_corpus([tmp_path / "in"], tmp_path / "out", sample_queries=0)
    with open_corpus([tmp_path / "out"]) as corpus:
        assert (corpus.shards[0].info.patch_grid, corpus.shards[0].info.patch_start) == ((2, 2), 2)
