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


def test_pack_records_the_patch_grid(tmp_path):
    ids, docs = make_docs(n=6, seed=5)
    src = write_source(tmp_path, "parquet", ids, docs)
    out = tmp_path / "pages"
    options = "--id-column pid --embedding-column colbert --patch-grid 2x3 --patch-start 1 --shard-tokens 40"
    result = runner.invoke(app, ["pack", src, "-o", str(out), *options.split()])
    assert result.exit_code == 0, result.output
    with open_corpus([out]) as corpus:
        assert len(corpus.shards) > 1
        assert {(s.info.patch_grid, s.info.patch_start) for s in corpus.shards} == {((2, 3), 1)}
    bad = runner.invoke(app, ["pack", src, "-o", str(tmp_path / "bad"), "--patch-grid", "2 by 3"])
    assert bad.exit_code == 2 and "--patch-grid: patch_grid '2 by 3' is not ROWSxCOLS" in bad.output
    alone = runner.invoke(app, ["pack", src, "-o", str(tmp_path / "bad"), "--patch-start", "2"])
    assert alone.exit_code == 2 and "patch_start without patch_grid" in alone.output
    assert not (tmp_path / "bad").exists()


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
    assert sorted(os.listdir(out)) == [
        "README", "index.json", "shard-00000.safetensors", "shard-00000.safetensors.idindex"
    ]  # fmt: skip
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


# --------------------------------------------------------------------------------------------------
# Hugging Face layouts: a folder of Parquet / Arrow files, a save_to_disk folder, a Dataset


def hf_table(ids, docs, mask_pad: int = 0) -> pa.Table:
    """`docs` padded with `mask_pad` zero rows each, and the attention mask that marks them."""
    dim = docs[0].shape[1]
    padded = [np.concatenate([d, np.zeros((mask_pad, dim), np.float32)]) for d in docs]
    return pa.table(
        {
            "id": ids,
            "embedding": embedding_array(padded, "list"),
            "attention_mask": pa.array([[1] * len(d) + [0] * mask_pad for d in docs], pa.list_(pa.int64())),
        }
    )


def corpus_contents(outdir) -> tuple[list[str], torch.Tensor]:
    with open_corpus([outdir], verify_checksums=True) as corpus:
        ids = [i for s in corpus.shards for i in s.ids]
        values = torch.cat([s.read_docs(0, s.num_docs).embeddings for s in corpus.shards])
    return ids, values


@pytest.mark.parametrize("give", ["data", "repo"])
def test_pack_a_hub_data_folder_in_file_order(tmp_path, give):
    ids, docs = make_docs(n=9, seed=10)
    data = tmp_path / "repo" / "data"
    data.mkdir(parents=True)
    pq.write_table(hf_table(ids[5:], docs[5:]), data / "train-00001-of-00002.parquet")
    pq.write_table(hf_table(ids[:5], docs[:5]), data / "train-00000-of-00002.parquet")
    (data / "README.md").write_text("not data")
    src = data if give == "data" else tmp_path / "repo"
    result = runner.invoke(app, ["pack", str(src), "-o", str(tmp_path / "out"), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    got_ids, values = corpus_contents(tmp_path / "out")
    assert got_ids == ids and torch.equal(values, torch.from_numpy(np.concatenate(docs)))


def test_pack_refuses_a_folder_of_several_splits(tmp_path):
    ids, docs = make_docs(n=4, seed=11)
    pq.write_table(hf_table(ids[:2], docs[:2]), tmp_path / "train-00000-of-00001.parquet")
    pq.write_table(hf_table(ids[2:], docs[2:]), tmp_path / "test-00000-of-00001.parquet")
    result = runner.invoke(app, ["pack", str(tmp_path), "-o", str(tmp_path.parent / "out-splits")])
    assert result.exit_code == 2
    assert "holds the files of several splits (test, train); pack one split's files, e.g. maxsim pack" in (
        result.stderr
    )
    assert "-*.parquet -o corpus/" in result.stderr


def test_pack_a_folder_of_arrow_files_and_the_duplicate_names_its_file(tmp_path):
    ids, docs = make_docs(n=6, seed=12)
    for k, part in enumerate((slice(0, 4), slice(4, 6))):
        table = hf_table(ids[part], docs[part])
        with pa.ipc.new_file(str(tmp_path / f"part-{k}.arrow"), table.schema) as out:
            out.write_table(table)
    result = pack([str(tmp_path)], str(tmp_path.parent / "out-arrow"), dtype="float32")
    assert corpus_contents(result.outdir)[0] == ids
    table = hf_table(ids[:1], docs[:1])
    with pa.ipc.new_file(str(tmp_path / "part-2.arrow"), table.schema) as out:
        out.write_table(table)
    result = runner.invoke(app, ["pack", str(tmp_path), "-o", str(tmp_path.parent / "out-dup")])
    assert result.exit_code == 1
    assert (
        f"part-2.arrow row 0: duplicate id '{ids[0]}' (first at {tmp_path / 'part-0.arrow'} row 0)"
        in result.stderr
    )


def test_pack_refuses_mixed_and_empty_folders(tmp_path):
    (tmp_path / "mixed").mkdir()
    np.save(tmp_path / "mixed" / "a.npy", np.ones((1, 4), np.float32))
    pq.write_table(hf_table(["b"], [np.ones((1, 4), np.float32)]), tmp_path / "mixed" / "b.parquet")
    result = runner.invoke(app, ["pack", str(tmp_path / "mixed"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "holds .npy and .parquet files together" in result.stderr
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["pack", str(tmp_path / "empty"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "no .npy, .parquet or .arrow files in this directory" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["empty", "mixed"]


def test_pack_a_save_to_disk_folder_and_refuse_a_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    ids, docs = make_docs(n=7, seed=13)
    rows = {"id": list(range(7)), "embedding": [d.tolist() for d in docs]}
    dataset = datasets.Dataset.from_dict(rows)
    dataset.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    assert sorted(os.listdir(tmp_path / "saved"))[:2] == [
        "data-00000-of-00002.arrow",
        "data-00001-of-00002.arrow",
    ]
    result = runner.invoke(
        app, ["pack", str(tmp_path / "saved"), "-o", str(tmp_path / "out"), "--dtype", "float32"]
    )
    assert result.exit_code == 0, result.output
    got_ids, values = corpus_contents(tmp_path / "out")
    assert got_ids == [str(i) for i in range(7)]
    assert torch.equal(values, torch.from_numpy(np.concatenate(docs)))
    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(tmp_path / "dd"))
    result = runner.invoke(app, ["pack", str(tmp_path / "dd"), "-o", str(tmp_path / "out2")])
    assert result.exit_code == 2
    assert (
        "a DatasetDict saved with save_to_disk (splits: test, train); pack one split's folder"
        in result.stderr
    )


# --------------------------------------------------------------------------------------------------
# --mask-column and the all-zero-row warning


@pytest.mark.parametrize("mask_type", [pa.int64(), pa.bool_(), pa.int8(), pa.float32()])
def test_pack_mask_column_leaves_padding_out(tmp_path, mask_type):
    ids, docs = make_docs(n=8, seed=14)
    table = hf_table(ids, docs, mask_pad=3)
    table = table.set_column(2, "attention_mask", table.column("attention_mask").cast(pa.list_(mask_type)))
    pq.write_table(table, tmp_path / "padded.parquet", row_group_size=3)
    args = ["pack", str(tmp_path / "padded.parquet"), "-o", str(tmp_path / "out"), "--dtype", "float32"]
    result = runner.invoke(app, [*args, "--mask-column", "attention_mask"])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr
    got_ids, values = corpus_contents(tmp_path / "out")
    assert got_ids == ids and torch.equal(values, torch.from_numpy(np.concatenate(docs)))


def test_pack_without_the_mask_warns_about_zero_rows(tmp_path):
    ids, docs = make_docs(n=8, seed=15)
    pq.write_table(hf_table(ids, docs, mask_pad=2), tmp_path / "padded.parquet")
    result = runner.invoke(app, ["pack", str(tmp_path / "padded.parquet"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warning == [
        f"warning: {tmp_path / 'out'}: 8 documents carry all-zero token rows (first: '{ids[0]}' at "
        f"{tmp_path / 'padded.parquet'} row 0): padding kept without its mask? pack with --mask-column NAME "
        "(the attention mask) to leave padding out"
    ]
    quiet = runner.invoke(app, ["pack", str(tmp_path / "padded.parquet"), "-o", str(tmp_path / "q"), "-q"])
    assert quiet.stderr.startswith("warning:")  # -q silences the summary, not the warning


@pytest.mark.parametrize(
    "mask, fragment",
    [
        ([[1, 1], [1, 1]], "row 1: document 'b' has 3 token vectors but 2 entries in 'attention_mask'"),
        ([[1, 1], [1, 2, 0]], "row 1: document 'b' has 2 in 'attention_mask'; a mask holds 1/true"),
        ([[1, 1], [0, 0, 0]], "row 1: document 'b' has every token masked in 'attention_mask'"),
        ([[1, 1], None], "row 1: null in column 'attention_mask'"),
        ([[1, 1], [1, None, 0]], "row 1: document 'b' has a null in 'attention_mask'"),
    ],
)
def test_pack_bad_masks_are_named(tmp_path, mask, fragment):
    table = pa.table(
        {
            "id": ["a", "b"],
            "embedding": embedding_array([np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)], "list"),
            "attention_mask": pa.array(mask, pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, tmp_path / "src.parquet")
    result = runner.invoke(
        app,
        [
            "pack",
            str(tmp_path / "src.parquet"),
            "-o",
            str(tmp_path / "out"),
            "--mask-column",
            "attention_mask",
        ],
    )
    assert result.exit_code == 1, result.output
    assert f"src.parquet: {fragment}" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["src.parquet"]


def test_pack_mask_column_usage_errors(tmp_path):
    ids, docs = make_docs(n=2, seed=16)
    pq.write_table(hf_table(ids, docs), tmp_path / "src.parquet")
    out = str(tmp_path / "out")
    result = runner.invoke(app, ["pack", str(tmp_path / "src.parquet"), "-o", out, "--mask-column", "mask"])
    assert (
        result.exit_code == 2 and "no column 'mask' (--mask-column); columns: id, embedding" in result.stderr
    )
    result = runner.invoke(app, ["pack", str(tmp_path / "src.parquet"), "-o", out, "--mask-column", "id"])
    assert result.exit_code == 2 and "mask column 'id' is string; it must be a list of 0/1" in result.stderr
    npy = write_source(tmp_path, "npy", ids, docs)
    result = runner.invoke(app, ["pack", npy, "-o", out, "--mask-column", "attention_mask"])
    assert result.exit_code == 2 and "--mask-column applies to Parquet and Arrow sources" in result.stderr


# --------------------------------------------------------------------------------------------------
# --overwrite


def test_pack_overwrite_replaces_the_corpus_and_keeps_other_files(tmp_path):
    ids, docs = make_docs(n=10, seed=17)
    src = write_source(tmp_path, "npy", ids, docs)
    out = tmp_path / "out"
    assert runner.invoke(app, ["pack", src, "-o", str(out), "--shard-tokens", "20", "-q"]).exit_code == 0
    assert len([n for n in os.listdir(out) if n.startswith("shard-")]) > 2
    (out / "notes.txt").write_text("mine")
    again = runner.invoke(app, ["pack", src, "-o", str(out)])
    assert again.exit_code == 2
    assert (
        "already holds shards (index.json); choose a new or empty directory, or pass --overwrite"
        in again.stderr
    )
    result = runner.invoke(app, ["pack", src, "-o", str(out), "--overwrite", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(out)) == [
        "index.json", "notes.txt", "shard-00000.safetensors", "shard-00000.safetensors.idindex"
    ]  # the old shards and their id indexes gone, the other file kept  # fmt: skip
    assert corpus_contents(out)[1].dtype == torch.float32


def test_pack_overwrite_that_fails_leaves_the_old_corpus(tmp_path, monkeypatch):
    import maxsim_cli.shards.files as files_module

    ids, docs = make_docs(n=10, seed=18)
    src = write_source(tmp_path, "npy", ids, docs)
    out = tmp_path / "out"
    pack([src], str(out), shard_tokens=30)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    real_move = files_module.move_into

    def failing_move(source, target, outdir):
        if target.endswith("index.json") and ".maxsim-old-" not in target:
            raise OSError(28, "No space left on device")
        real_move(source, target, outdir)

    monkeypatch.setattr(files_module, "move_into", failing_move)
    with pytest.raises(OSError):
        pack([src], str(out), dtype="float32", overwrite=True)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before  # no debris, the old corpus whole


# --------------------------------------------------------------------------------------------------
# write_dataset


def test_write_dataset_with_int_ids_a_mask_and_array2d(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import maxsim_cli.pack as pack_module
    from maxsim_cli.pack import write_dataset

    monkeypatch.setattr(pack_module, "BATCH_BYTES", 200)  # many small batches: the same corpus
    _, docs = make_docs(n=9, dim=4, seed=19)
    width = max(len(d) for d in docs)
    padded = [np.concatenate([d, np.zeros((width - len(d), 4), np.float32)]) for d in docs]
    features = datasets.Features(
        {
            "pid": datasets.Value("int64"),
            "colbert": datasets.Array2D(shape=(None, 4), dtype="float32"),
            "mask": datasets.List(datasets.Value("bool")),
        }
    )
    dataset = datasets.Dataset.from_dict(
        {
            "pid": list(range(9)),
            "colbert": padded,
            "mask": [[i < len(d) for i in range(width)] for d in docs],
        },
        features=features,
    )
    result = write_dataset(
        dataset,
        tmp_path / "out",
        id_column="pid",
        embedding_column="colbert",
        mask_column="mask",
        dtype="float32",
    )
    assert (result.num_docs, result.num_tokens, result.sources) == (9, sum(map(len, docs)), ["dataset"])
    got_ids, values = corpus_contents(tmp_path / "out")
    assert got_ids == [str(i) for i in range(9)]
    assert torch.equal(values, torch.from_numpy(np.concatenate(docs)))
    # a shuffled view is written in its own order
    shuffled = dataset.shuffle(seed=0)
    write_dataset(
        shuffled, tmp_path / "shuffled", id_column="pid", embedding_column="colbert", mask_column="mask"
    )
    assert corpus_contents(tmp_path / "shuffled")[0] == [str(i) for i in shuffled["pid"]]


def test_write_dataset_warns_about_zero_rows_and_refuses_bad_input(tmp_path):
    datasets = pytest.importorskip("datasets")
    from maxsim_cli import MaxsimWarning
    from maxsim_cli.errors import UsageError
    from maxsim_cli.pack import write_dataset

    rows = [np.array([[1.0, 2.0], [0.0, 0.0]], np.float32), np.ones((2, 2), np.float32)]
    dataset = datasets.Dataset.from_dict({"id": ["a", "b"], "embedding": rows})
    with pytest.warns(
        MaxsimWarning, match="1 document carries all-zero token rows \\(first: 'a' at dataset row 0\\)"
    ):
        write_dataset(dataset, tmp_path / "out")
    with pytest.raises(UsageError, match="no column 'emb' \\(embedding_column=\\); columns: id, embedding"):
        write_dataset(dataset, tmp_path / "out2", embedding_column="emb")
    with pytest.raises(UsageError, match="already holds shards .* pass overwrite=True"):
        write_dataset(dataset, tmp_path / "out")
    with pytest.raises(UsageError, match="expected a datasets.Dataset or IterableDataset, not dict"):
        write_dataset({"id": ["a"]}, tmp_path / "out3")
    iterable = dataset.to_iterable_dataset()
    with pytest.warns(MaxsimWarning):
        result = write_dataset(iterable, tmp_path / "out4", overwrite=False)
    assert result.num_docs == 2
