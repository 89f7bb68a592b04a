"""`maxsim pack`: every source layout and dtype round-trips through `maxsim inspect --json` exactly."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.pack import pack
from maxsim_cli.shards import open_corpus

runner = CliRunner()
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def make_docs(n: int = 30, dim: int = 8, seed: int = 0) -> tuple[list[str], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 25, n)
    return [f"d{seed}-{i}" for i in range(n)], [
        rng.standard_normal((k, dim)).astype(np.float32) for k in lengths
    ]


def embedding_array(docs: list[np.ndarray], layout: str) -> pa.Array:
    dim = docs[0].shape[1]
    inner = pa.list_(pa.float32(), dim) if layout.endswith("fixed") else pa.list_(pa.float32())
    outer = pa.large_list(inner) if layout.startswith("large") else pa.list_(inner)
    return pa.array([d.tolist() for d in docs], outer)


def write_source(tmp_path, kind: str, ids, docs, layout: str = "list") -> str:
    if kind == "npy":
        src = tmp_path / "npy"
        src.mkdir()
        for doc_id, doc in zip(ids, docs, strict=True):
            np.save(src / f"{doc_id}.npy", doc)
        return str(src)
    table = pa.table({"pid": ids, "colbert": embedding_array(docs, layout)})
    if kind == "parquet":
        pq.write_table(table, tmp_path / "src.parquet", row_group_size=7)
        return str(tmp_path / "src.parquet")
    with pa.ipc.new_file(str(tmp_path / "src.arrow"), table.schema) as out:
        for batch in table.to_batches(max_chunksize=11):
            out.write_batch(batch)
    return str(tmp_path / "src.arrow")


def inspect_json(*paths) -> dict:
    result = runner.invoke(app, ["inspect", "--json", *map(str, paths)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("kind", ["parquet", "arrow", "npy"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_pack_then_inspect_counts_are_exact(tmp_path, kind, dtype):
    ids, docs = make_docs(seed=1)
    src = write_source(tmp_path, kind, ids, docs)
    args = ["pack", src, "-o", str(tmp_path / "out"), "--dtype", dtype, "--shard-tokens", "100"]
    result = runner.invoke(app, [*args, "--id-column", "pid", "--embedding-column", "colbert"])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # data only on stdout: pack prints its summary on stderr
    assert f"packed 30 documents, {sum(len(d) for d in docs)} tokens" in result.stderr
    report = inspect_json(tmp_path / "out")
    assert (report["num_docs"], report["num_tokens"]) == (30, sum(len(d) for d in docs))
    assert (report["dim"], report["dtype"]) == (8, dtype)
    assert len(report["shards"]) > 1 and all(s["num_tokens"] <= 100 for s in report["shards"])
    assert sum(s["num_docs"] for s in report["shards"]) == 30
    with open_corpus([tmp_path / "out"], verify_checksums=True) as corpus:
        got_ids = [i for s in corpus.shards for i in s.ids]
        values = torch.cat([s.read_docs(0, s.num_docs).embeddings for s in corpus.shards])
    order = sorted(range(30), key=lambda i: ids[i]) if kind == "npy" else range(30)  # npy: files by name
    assert got_ids == [ids[i] for i in order]
    expected = torch.cat([torch.from_numpy(docs[i]) for i in order]).to(TORCH[dtype])
    assert torch.equal(values, expected)  # the cast is the only change


@pytest.mark.parametrize("layout", ["list", "fixed", "large", "large_fixed"])
def test_pack_accepts_every_list_layout(tmp_path, layout):
    ids, docs = make_docs(n=12, seed=2)
    src = write_source(tmp_path, "parquet", ids, docs, layout)
    result = pack([src], str(tmp_path / "out"), id_column="pid", embedding_column="colbert", dtype="float32")
    assert (result.num_docs, result.dim) == (12, 8)
    with open_corpus([result.outdir]) as corpus:
        batch = corpus.shards[0].read_docs(0, 12)
    assert torch.equal(batch.embeddings, torch.from_numpy(np.concatenate(docs)))


def test_pack_arrow_stream_and_integer_ids_into_arrow_shards(tmp_path):
    _, docs = make_docs(n=9, seed=3)
    table = pa.table(
        {"id": pa.array(range(100, 109), pa.int64()), "embedding": embedding_array(docs, "list")}
    )
    with pa.ipc.new_stream(str(tmp_path / "data-00000-of-00001.arrow"), table.schema) as out:
        out.write_table(table)
    result = pack([str(tmp_path / "data-00000-of-00001.arrow")], str(tmp_path / "out"), format="arrow")
    assert [os.path.basename(s.path) for s in result.shards] == ["shard-00000.arrow"]
    with open_corpus([result.outdir]) as corpus:
        assert corpus.shards[0].ids == [str(i) for i in range(100, 109)]
        assert corpus.shards[0].info.format == "arrow"


def test_pack_normalize_and_encoder(tmp_path):
    ids, docs = make_docs(n=10, seed=4)
    src = write_source(tmp_path, "npy", ids, docs)
    result = pack([src], str(tmp_path / "out"), dtype="float32", normalize=True, encoder="colbert-test")
    assert result.normalized
    with open_corpus([result.outdir]) as corpus:
        assert corpus.normalized and corpus.encoder == "colbert-test"
        values = corpus.shards[0].read_docs(0, 10).embeddings
    norms = values.double().norm(dim=1)
    # float32 division by a float32 norm: within a few ulps of 1
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-6, rtol=0)
    unnormalized = pack([src], str(tmp_path / "raw"), dtype="float32")
    assert not unnormalized.normalized


def test_pack_several_sources_and_existing_empty_outdir(tmp_path):
    ids_a, docs_a = make_docs(n=5, seed=5)
    ids_b, docs_b = make_docs(n=7, seed=6)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    src_a = write_source(tmp_path / "a", "parquet", ids_a, docs_a)
    src_b = write_source(tmp_path / "b", "arrow", ids_b, docs_b)
    out = tmp_path / "out"
    out.mkdir()
    (out / "README").write_text("kept")
    result = pack([src_a, src_b], str(out), id_column="pid", embedding_column="colbert")
    assert sorted(os.listdir(out)) == ["README", "index.json", "shard-00000.safetensors"]
    assert result.num_docs == 12
    with open_corpus([out]) as corpus:
        assert corpus.shards[0].ids == ids_a + ids_b


def test_pack_duplicate_across_sources_names_both(tmp_path):
    ids, docs = make_docs(n=4, seed=7)
    src = write_source(tmp_path, "parquet", ids, docs)
    result = runner.invoke(
        app,
        [
            "pack",
            src,
            src,
            "-o",
            str(tmp_path / "out"),
            "--id-column",
            "pid",
            "--embedding-column",
            "colbert",
        ],
    )
    assert result.exit_code == 1
    assert f"src.parquet row 0: duplicate id 'd7-0' (first at {src} row 0)" in result.stderr
    assert not (tmp_path / "out").exists()


def test_pack_float16_overflow_is_named(tmp_path):
    ids, docs = make_docs(n=3, seed=8)
    docs[2][1, 0] = 1e6
    src = write_source(tmp_path, "npy", ids, docs)
    result = runner.invoke(app, ["pack", src, "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert (
        "d8-2.npy: document 'd8-2' has NaN or Inf values at token 1 after conversion to float16"
        in result.stderr
    )
    assert sorted(os.listdir(tmp_path)) == ["npy"]


def test_pack_help_ends_with_example():
    result = runner.invoke(app, ["pack", "--help"])
    assert result.exit_code == 0
    assert "Example: maxsim pack" in result.stdout
