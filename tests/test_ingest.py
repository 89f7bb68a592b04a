"""Embeddings as encoders hand them over: `write_shard` / `ShardWriter` with padded tensors and masks
(PyLate's, stanford ColBERT's and colpali-engine's shapes), int ids, and the all-zero-row warning."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from maxsim_cli import MaxsimWarning
from maxsim_cli.errors import InputError
from maxsim_cli.shards import ShardWriter, open_shard, write_shard


def padded_batch(lengths=(2, 6, 4), dim=4, seed=0, mask_dtype=torch.long):
    """What colpali-engine returns: `[batch, L, dim]` with zero rows after each document, plus the
    attention mask of the batch."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(len(lengths), max(lengths), dim)
    mask = torch.zeros(len(lengths), max(lengths), dtype=mask_dtype)
    for i, n in enumerate(lengths):
        out[i, :n] = torch.randn(n, dim, generator=gen)
        mask[i, :n] = 1
    return out, mask


def read_all(path):
    with open_shard(path) as shard:
        batch = shard.read_docs(0, shard.num_docs)
    return batch.ids, batch.embeddings, batch.lengths().tolist()


@pytest.mark.parametrize("mask_dtype", [torch.long, torch.bool, torch.float32, torch.int32])
@pytest.mark.parametrize("as_numpy", [False, True])
def test_padded_with_mask_writes_only_real_tokens(tmp_path, mask_dtype, as_numpy):
    out, mask = padded_batch(mask_dtype=mask_dtype)
    emb, m = (out.numpy(), mask.numpy()) if as_numpy else (out, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MaxsimWarning)  # a masked batch has no padding left: no warning
        info = write_shard(tmp_path / "p.safetensors", ["a", "b", "c"], emb, mask=m)
    assert (info.num_docs, info.num_tokens) == (3, 12)
    ids, values, lengths = read_all(tmp_path / "p.safetensors")
    assert ids == ["a", "b", "c"] and lengths == [2, 6, 4]
    assert torch.equal(values, torch.cat([out[0, :2], out[1], out[2, :4]]))


def test_a_list_of_documents_with_a_list_of_masks(tmp_path):
    out, mask = padded_batch()
    info = write_shard(tmp_path / "l.arrow", ["a", "b", "c"], list(out.unbind(0)), mask=list(mask))
    assert info.num_tokens == 12 and info.format == "arrow"
    # the same, given the [n, L] mask whole
    write_shard(tmp_path / "l2.arrow", ["a", "b", "c"], list(out.unbind(0)), mask=mask)
    assert torch.equal(read_all(tmp_path / "l.arrow")[1], read_all(tmp_path / "l2.arrow")[1])


def test_a_mask_that_is_not_a_prefix_is_honoured(tmp_path):
    """Left padding (or any holes): the rows kept are exactly the True ones, in order."""
    out = torch.arange(2 * 4 * 2, dtype=torch.float32).reshape(2, 4, 2) + 1
    mask = torch.tensor([[0, 0, 1, 1], [1, 0, 1, 0]])
    write_shard(tmp_path / "m.safetensors", ["x", "y"], out, mask=mask)
    _, values, lengths = read_all(tmp_path / "m.safetensors")
    assert lengths == [2, 2]
    assert torch.equal(values, torch.stack([out[0, 2], out[0, 3], out[1, 0], out[1, 2]]))


def test_pylate_output_list_of_arrays_and_int_ids(tmp_path):
    """PyLate's `encode(..., is_query=False)`: a list of float32 `[len, 128]` numpy arrays; ids often ints."""
    rng = np.random.default_rng(1)
    docs = [rng.standard_normal((n, 128)).astype(np.float32) for n in (5, 31, 1)]
    docs = [d / np.linalg.norm(d, axis=1, keepdims=True) for d in docs]
    info = write_shard(tmp_path / "py.safetensors", [7, np.int64(8), 9], docs, dtype="float16")
    assert info.normalized and info.num_tokens == 37
    ids, _, lengths = read_all(tmp_path / "py.safetensors")
    assert ids == ["7", "8", "9"] and lengths == [5, 31, 1]
    write_shard(tmp_path / "t.safetensors", torch.tensor([1, 2, 3]), docs)  # a tensor of ids
    assert read_all(tmp_path / "t.safetensors")[0] == ["1", "2", "3"]


def test_shard_writer_takes_masks_and_int_ids(tmp_path):
    out, mask = padded_batch()
    with ShardWriter(tmp_path / "w.safetensors", 4, "float32") as writer:
        writer.add([0, 1, 2], out, mask=mask)
        writer.add([3], [out[1]])
    ids, _, lengths = read_all(tmp_path / "w.safetensors")
    assert ids == ["0", "1", "2", "3"] and lengths == [2, 6, 4, 6]


def test_int8_scales_are_masked_with_their_tokens(tmp_path):
    codes = torch.randint(-127, 128, (2, 3, 4), dtype=torch.int8)
    scales = torch.rand(2, 3) + 0.1
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    write_shard(tmp_path / "q.safetensors", ["a", "b"], codes, mask=mask, scales=scales, dtype="int8")
    with open_shard(tmp_path / "q.safetensors") as shard:
        batch = shard.read_docs(0, 2)
    assert torch.equal(batch.scales, torch.cat([scales[0, :2], scales[1, :1]]))


def test_all_zero_rows_warn_with_count_and_first_id(tmp_path):
    """colpali-engine's README pattern `list(torch.unbind(out))` keeps the padding rows."""
    out, _ = padded_batch()
    with pytest.warns(MaxsimWarning) as record:
        info = write_shard(tmp_path / "z.safetensors", ["a", "b", "c"], list(torch.unbind(out)))
    assert info.num_tokens == 18  # written as given: 6 rows per document
    (message,) = [str(w.message) for w in record]
    assert "z.safetensors: 2 documents carry all-zero token rows (first: 'a')" in message
    assert "pass mask=" in message
    assert record[0].filename == __file__  # points at the caller's line


def test_shard_writer_warns_once_at_close(tmp_path):
    out, _ = padded_batch()
    with pytest.warns(
        MaxsimWarning, match="2 documents carry all-zero token rows \\(first: 'c'\\)"
    ) as record:
        with ShardWriter(tmp_path / "s.safetensors", 4, "float32") as writer:
            writer.add(["a", "b"], [out[0, :2], out[1]])
            writer.add(["c", "d", "e"], out)
    assert len(record) == 1 and writer.zero_row_docs == 2
    quiet = ShardWriter(tmp_path / "t.safetensors", 4, "float32", warn_zero_rows=False)
    quiet.add(["a"], [out[0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", MaxsimWarning)
        quiet.close()
    assert (quiet.zero_row_docs, quiet.first_zero_row_id) == (1, "a")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"mask": torch.ones(3, 5)}, "mask has shape (3, 5); expected (3, 6) ([documents, tokens])"),
        ({"mask": torch.full((3, 6), 2)}, "the mask of document 'a' (index 0) holds 2; a mask holds True/1"),
        ({"mask": torch.zeros(3, 6)}, "the mask of document 'a' (index 0) masks every token"),
        ({"mask": [torch.ones(6)] * 2}, "2 masks for 3 documents"),
        ({"mask": [torch.ones(6), torch.ones(5), torch.ones(6)]}, "document 'b' (index 1) has 5 entries"),
        ({"mask": torch.ones(3, 6), "offsets": [0, 1]}, "mask= with offsets="),
        ({"mask": torch.ones(3, 6), "scales": torch.ones(18)}, "packed [T] scales with a mask"),
    ],
)
def test_bad_masks_are_one_line_errors_and_write_nothing(tmp_path, kwargs, fragment):
    out, _ = padded_batch()
    if "scales" in kwargs:
        out = out.to(torch.int8)
        kwargs = {**kwargs, "dtype": "int8"}
    if "offsets" in kwargs:
        out = out.reshape(-1, 4)
    with pytest.raises(InputError) as err:
        write_shard(tmp_path / "bad.safetensors", ["a", "b", "c"], out, **kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "ids, embeddings, fragment",
    [
        ([1.5, 2], [torch.ones(1, 4)] * 2, "id at index 0 is float; ids must be str or int"),
        ([True, 2], [torch.ones(1, 4)] * 2, "id at index 0 is bool; ids must be str or int"),
        (["a"], torch.ones(6, 4), "embeddings of shape (6, 4); pass a list of [tokens, dim] arrays"),
        (["a", "b"], torch.ones(3, 2, 4), "2 ids but 3 documents"),
    ],
)
def test_bad_ids_and_shapes(tmp_path, ids, embeddings, fragment):
    with pytest.raises(InputError, match=None) as err:
        write_shard(tmp_path / "bad.safetensors", ids, embeddings)
    assert fragment in str(err.value)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------------
# score / inspect on embeddings that need packing: one line with the command


def _hf_table(ids, lengths, dim=4):
    import pyarrow as pa

    rng = np.random.default_rng(3)
    vectors = [rng.standard_normal((n, dim)).astype(np.float32).tolist() for n in lengths]
    return pa.table(
        {
            "docid": ids,
            "colbert": pa.array(vectors, pa.list_(pa.list_(pa.float32()))),
            "attention_mask": [[1] * n for n in lengths],
        }
    )


@pytest.mark.parametrize("command", ["inspect", "score"])
def test_an_hf_parquet_file_points_at_pack(tmp_path, command):
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from maxsim_cli.cli import app

    (tmp_path / "data").mkdir()
    pq.write_table(_hf_table([1, 2], [2, 3]), tmp_path / "data" / "train-00000-of-00001.parquet")
    pq.write_table(_hf_table(["a", "b"], [2, 3]), tmp_path / "plain.parquet")
    write_shard(tmp_path / "q.safetensors", ["q"], [np.ones((2, 4), np.float32)])
    for target, source in [
        (tmp_path / "data" / "train-00000-of-00001.parquet", f"{tmp_path / 'data'}/"),
        (tmp_path / "plain.parquet", str(tmp_path / "plain.parquet")),
    ]:
        args = (
            ["inspect", str(target)]
            if command == "inspect"
            else ["score", str(tmp_path / "q.safetensors"), str(target)]
        )
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1, result.output
        assert result.stderr.count("\n") == 1
        assert (
            "a table of token embeddings (column 'colbert'), not a maxsim shard; make a corpus of it with: "
            in result.stderr
        )
        assert (
            f"maxsim pack {source} --id-column docid --embedding-column colbert --mask-column attention_mask "
            "-o corpus/" in result.stderr
        )


def test_a_folder_of_npy_files_points_at_pack(tmp_path):
    from typer.testing import CliRunner

    from maxsim_cli.cli import app

    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "d1.npy", np.ones((2, 4), np.float32))
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "npy")])
    assert result.exit_code == 1
    assert f"it holds embeddings to pack first: maxsim pack {tmp_path / 'npy'} -o corpus/" in result.stderr
