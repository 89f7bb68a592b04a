"""Every invalid input gets a one-line error naming the file and the document or offset, exit code 1
(2 for usage errors), no traceback, and no output file left behind.

Corrupt files are built here, byte by byte, from a valid shard or from plain `safetensors.numpy.save_file`
(what a foreign writer would do): no binary fixtures.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.numpy import save_file
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.errors import InputError
from maxsim_cli.shards import check_same_dim, open_corpus, read_queries, write_manifest, write_shard

runner = CliRunner()

META = {
    "format": "maxsim-shard",
    "format_version": "1",
    "dim": "4",
    "dtype": "float32",
    "quantization": "none",
    "normalized": "false",
    "num_docs": "3",
    "num_tokens": "6",
}


def raw_shard(
    path,
    *,
    ids=("d0", "d1", "d2"),
    lengths=(1, 2, 3),
    offsets=None,
    values=None,
    id_bytes=None,
    meta=None,
    drop=(),
    extra=None,
):
    """A safetensors shard written without maxsim's writer, so any rule can be broken."""
    n_tokens = sum(lengths)
    if values is None:
        values = np.arange(n_tokens * 4, dtype=np.float32).reshape(n_tokens, 4) / 10
    encoded = [i.encode("utf-8") for i in ids] if id_bytes is None else id_bytes
    tensors = {
        "embeddings": values,
        "offsets": np.asarray(offsets if offsets is not None else np.cumsum([0, *lengths]), dtype=np.int64),
        "ids": np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(),
        "id_offsets": np.cumsum([0] + [len(b) for b in encoded]).astype(np.int64),
        **(extra or {}),
    }
    for name in drop:
        tensors.pop(name)
    save_file(tensors, str(path), metadata={**META, **(meta or {})})
    return str(path)


def _listing(paths) -> dict[str, list[str]]:
    dirs = {os.path.dirname(os.path.abspath(p)) for p in paths if not str(p).startswith("-")}
    dirs |= {os.path.abspath(p) for p in paths if os.path.isdir(p)}
    return {d: sorted(os.listdir(d)) for d in dirs if os.path.isdir(d)}


def run_inspect(*paths):
    """`maxsim inspect PATHS`; also checks that it left no file behind (temp or otherwise)."""
    before = _listing(paths)
    result = runner.invoke(app, ["inspect", *map(str, paths)])
    assert _listing(paths) == before
    return result


def assert_error(result, *fragments, code=1):
    """Exit code, one line on stderr starting 'maxsim: error:', every fragment in it, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("maxsim: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in result.output
    assert result.stdout == ""


@pytest.fixture
def good(tmp_path):
    return raw_shard(tmp_path / "good.safetensors")


def test_the_valid_raw_shard_is_accepted(good):
    result = run_inspect(good, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_tokens"] == 6


# --- truncated or corrupt files ---


def test_truncated_safetensors(good, tmp_path):
    data = open(good, "rb").read()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-10])
    assert_error(run_inspect(cut), "cut.safetensors", "truncated: tensor", "only 156 bytes follow the header")
    cut.write_bytes(data[:5])
    assert_error(run_inspect(cut), "cut.safetensors", "truncated", "8-byte")
    cut.write_bytes(data[:40])
    assert_error(run_inspect(cut), "cut.safetensors", "truncated: header needs")
    assert sorted(os.listdir(tmp_path)) == ["cut.safetensors", "good.safetensors"]


def test_corrupt_safetensors_header(good, tmp_path):
    data = bytearray(open(good, "rb").read())
    data[8:12] = b"#!?@"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    assert_error(run_inspect(bad), "bad.safetensors", "corrupt safetensors header (bytes 8..")
    data = bytearray(open(good, "rb").read())
    data[0:8] = (2**40).to_bytes(8, "little")
    bad.write_bytes(bytes(data))
    assert_error(run_inspect(bad), "bad.safetensors", "corrupt safetensors header length", "offset 0")


def test_truncated_arrow_and_parquet(tmp_path):
    ids = ["a", "b"]
    docs = [torch.ones(3, 4), torch.ones(2, 4)]
    for name in ("x.arrow", "x.parquet"):
        write_shard(tmp_path / name, ids, docs, dtype="float32")
        data = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(data[: len(data) // 2])
        assert_error(run_inspect(tmp_path / name), name, "corrupt or truncated")


# --- unknown format, version, dtype ---


def test_unknown_format(tmp_path):
    path = raw_shard(tmp_path / "s.safetensors", meta={"format": "colbert-chunk"})
    assert_error(run_inspect(path), "s.safetensors", "unknown format 'colbert-chunk'")
    plain = tmp_path / "p.safetensors"
    save_file({"w": np.zeros(3, np.float32)}, str(plain))
    assert_error(run_inspect(plain), "p.safetensors", "no __metadata__; not a maxsim shard")
    text = tmp_path / "t.safetensors"
    text.write_text("id\tvector\n")
    assert_error(run_inspect(text), "t.safetensors", "corrupt safetensors header length")
    notes = tmp_path / "notes.txt"
    notes.write_text("id\tvector\n")
    assert_error(
        run_inspect(notes), "notes.txt", "not a shard: expected a safetensors, Arrow IPC or Parquet file"
    )


def test_unknown_version(tmp_path):
    path = raw_shard(tmp_path / "s.safetensors", meta={"format_version": "2"})
    assert_error(run_inspect(path), "s.safetensors", "unsupported format_version '2'", "reads version 1")


def test_unsupported_dtype(tmp_path):
    f64 = raw_shard(
        tmp_path / "f64.safetensors", values=np.zeros((6, 4), np.float64), meta={"dtype": "float64"}
    )
    assert_error(run_inspect(f64), "f64.safetensors", "unsupported dtype 'float64'")
    lying = raw_shard(tmp_path / "lying.safetensors", values=np.zeros((6, 4), np.float64))
    assert_error(run_inspect(lying), "lying.safetensors", "unsupported embeddings dtype F64")


# --- dim mismatches ---


def test_dim_mismatch_between_shards(tmp_path):
    write_shard(tmp_path / "a.safetensors", ["a"], [np.ones((2, 4), np.float32)])
    write_shard(tmp_path / "b.safetensors", ["b"], [np.ones((2, 8), np.float32)])
    assert_error(
        run_inspect(tmp_path), "b.safetensors", "dim mismatch: dim=8 here but dim=4 in", "a.safetensors"
    )
    assert_error(run_inspect(tmp_path / "a.safetensors", tmp_path / "b.safetensors"), "dim mismatch")


def test_dim_mismatch_between_queries_and_corpus(tmp_path):
    write_shard(tmp_path / "corpus.safetensors", ["a"], [np.ones((2, 4), np.float32)])
    write_shard(tmp_path / "queries.safetensors", ["q"], [np.ones((2, 8), np.float32)])
    queries = read_queries(str(tmp_path / "queries.safetensors"))
    with open_corpus([tmp_path / "corpus.safetensors"]) as corpus:
        with pytest.raises(
            InputError, match=r"queries\.safetensors: queries have dim 8 but the corpus .* dim 4"
        ):
            check_same_dim(queries, str(tmp_path / "queries.safetensors"), corpus)


@pytest.mark.parametrize("dim", [4, 12, 4104])
@pytest.mark.parametrize("command", ["score", "verify", "quantize"])
def test_a_dim_the_kernels_do_not_take_is_one_line_before_any_work(tmp_path, dim, command):
    """Dims that are not multiples of 8 up to the kernels' maximum: one line naming the corpus and what
    to do, exit 1, nothing written (not the kernel's ValueError as a traceback)."""
    rng = np.random.default_rng(dim)
    write_shard(tmp_path / "corpus.safetensors", ["a", "b"], [rng.standard_normal((3, dim))] * 2)
    write_shard(tmp_path / "queries.safetensors", ["q"], [rng.standard_normal((2, dim))])
    corpus, queries, out = (str(tmp_path / n) for n in ("corpus.safetensors", "queries.safetensors", "out"))
    args = {
        "score": ["score", queries, corpus, "-o", out, "--device", "cpu"],
        "verify": ["verify", queries, corpus, "--device", "cpu"],
        "quantize": ["quantize", corpus, "-o", out, "--device", "cpu"],
    }[command]
    result = runner.invoke(app, args)
    assert_error(result, "corpus.safetensors", f"dim {dim}", "multiples of 8", "pad")
    assert not os.path.exists(out)


def test_dim_disagrees_with_metadata(tmp_path):
    path = raw_shard(tmp_path / "s.safetensors", meta={"dim": "5"})
    assert_error(run_inspect(path), "s.safetensors", "metadata says dim=5 but the file holds 4")


@pytest.mark.parametrize("key", ["dim", "num_docs", "num_tokens"])
@pytest.mark.parametrize("text", ["\u00b2", "\u0663"])  # str.isdigit() takes both; int() refuses the first
def test_counts_in_metadata_are_ascii_digits(tmp_path, key, text):
    path = raw_shard(tmp_path / "s.safetensors", meta={key: text})
    assert_error(run_inspect(path), "s.safetensors", f"{key} in __metadata__ must be a non-negative integer")


# --- offsets ---


def test_offsets_not_starting_at_zero(tmp_path):
    path = raw_shard(tmp_path / "s.safetensors", offsets=[1, 2, 4, 6])
    assert_error(run_inspect(path), "s.safetensors", "offsets start at 1, not 0", "'d0'")


def test_offsets_not_monotonic(tmp_path):
    path = raw_shard(tmp_path / "s.safetensors", offsets=[0, 4, 3, 6])
    assert_error(run_inspect(path), "s.safetensors", "not monotonic: offsets[2] = 3 < offsets[1] = 4", "'d1'")


def test_offsets_not_ending_at_num_tokens(tmp_path):
    path = raw_shard(tmp_path / "s.safetensors", offsets=[0, 1, 3, 5])
    assert_error(run_inspect(path), "s.safetensors", "offsets end at 5 but embeddings hold 6 tokens")


def test_document_with_zero_tokens(tmp_path):
    path = raw_shard(tmp_path / "s.safetensors", offsets=[0, 3, 3, 6])
    assert_error(run_inspect(path), "s.safetensors", "document 'd1' (index 1, offset 3) has zero tokens")
    # the same in an Arrow shard written by plain pyarrow
    meta = {**META, "num_docs": "2", "num_tokens": "1"}
    table = pa.table(
        {
            "id": ["x", "empty"],
            "embedding": pa.array([[[1, 2, 3, 4]], []], pa.list_(pa.list_(pa.float32(), 4))),
        }
    ).replace_schema_metadata(meta)
    with pa.ipc.new_file(str(tmp_path / "t.arrow"), table.schema) as out:
        out.write_table(table)
    assert_error(
        run_inspect(tmp_path / "t.arrow"), "t.arrow", "document 'empty' (index 1, offset 1) has zero tokens"
    )


# --- values ---


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_values_name_the_document(tmp_path, bad):
    values = np.ones((6, 4), np.float32)
    values[4, 2] = bad  # document d2 holds tokens 3..5: this is its token 1
    path = raw_shard(tmp_path / "s.safetensors", values=values)
    assert_error(
        run_inspect(path), "s.safetensors", "document 'd2' (index 2) has NaN or Inf values at token 1"
    )
    # structure-only inspection does not read values
    assert runner.invoke(app, ["inspect", path, "--no-check-values"]).exit_code == 0


def test_nan_in_parquet_shard(tmp_path):
    docs = [np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)]
    docs[1][2, 0] = np.nan
    path = tmp_path / "s.parquet"
    ids = ["ok", "broken"]
    with pytest.raises(InputError, match="document 'broken'"):  # the writer refuses it
        write_shard(path, ids, docs)
    assert not path.exists()
    docs[1][2, 0] = 1.0
    write_shard(path, ids, docs)
    table = pq.read_table(path)
    emb = table.column("embedding").to_pylist()
    emb[1][2][0] = float("nan")
    table = table.set_column(1, "embedding", pa.array(emb, table.schema.field("embedding").type))
    pq.write_table(table, path)
    assert_error(
        run_inspect(path), "s.parquet", "document 'broken' (index 1) has NaN or Inf values at token 2"
    )


# --- ids ---


def test_duplicate_ids_within_a_shard(tmp_path):
    path = raw_shard(tmp_path / "s.safetensors", ids=("d0", "d1", "d0"))
    assert_error(run_inspect(path), "s.safetensors", "duplicate id 'd0' at indices 0 and 2")


@pytest.mark.parametrize("by_shard", [False, True])
def test_duplicate_ids_across_shards(tmp_path, monkeypatch, by_shard):
    if by_shard:  # the ids sorted shard by shard in threads (`sorted_id_order`), as on a large corpus
        from maxsim_cli.shards import format as shard_format  # where sorted_id_order reads them

        monkeypatch.setattr(shard_format, "BY_SHARD_SORT_MIN_THREADS", 1)
        monkeypatch.setattr(shard_format, "BY_SHARD_SORT_MIN_IDS", 0)
    write_shard(tmp_path / "a.safetensors", ["x", "shared"], [np.ones((1, 4), np.float32)] * 2)
    write_shard(tmp_path / "b.safetensors", ["y", "z", "shared"], [np.ones((1, 4), np.float32)] * 3)
    assert_error(
        run_inspect(tmp_path),
        "b.safetensors",
        "duplicate id 'shared': document 2 here and document 1 of",
        "a.safetensors",
    )


def test_ids_with_whitespace(tmp_path):
    path = raw_shard(tmp_path / "s.safetensors", ids=("d0", "d 1", "d2"))
    assert_error(run_inspect(path), "s.safetensors", "id 'd 1' at index 1 contains whitespace")
    tab = raw_shard(tmp_path / "t.safetensors", ids=("d0", "d1", "tab\there"))
    assert_error(run_inspect(tab), "t.safetensors", "id 'tab\\there' at index 2 contains whitespace")
    with pytest.raises(InputError, match=r"w\.arrow: id 'a\\nb' at index 1 contains whitespace"):
        write_shard(tmp_path / "w.arrow", ["ok", "a\nb"], [np.ones((1, 4), np.float32)] * 2)
    assert not (tmp_path / "w.arrow").exists()


def test_ids_not_valid_utf8(tmp_path):
    path = raw_shard(tmp_path / "s.safetensors", id_bytes=[b"d0", b"\xff\xfe", b"d2"])
    assert_error(run_inspect(path), "s.safetensors", "id at index 1 (bytes 2..4) is not valid UTF-8")


# --- int8 ---


def test_int8_without_scales(tmp_path):
    path = raw_shard(
        tmp_path / "s.safetensors",
        values=np.ones((6, 4), np.int8),
        meta={"dtype": "int8", "quantization": "int8-per-token"},
    )
    assert_error(run_inspect(path), "s.safetensors", "int8 embeddings without scales")
    with pytest.raises(InputError, match=r"w\.safetensors: int8 embeddings without scales"):
        write_shard(tmp_path / "w.safetensors", ["a"], [np.ones((2, 4), np.int8)])
    assert not (tmp_path / "w.safetensors").exists()


# --- manifests ---


@pytest.mark.parametrize("escape", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_manifest_naming_files_outside_its_directory(tmp_path, escape):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_shard(tmp_path / "outside.safetensors", ["a"], [np.ones((1, 4), np.float32)])
    manifest = {"format": "maxsim-corpus", "format_version": 1, "shards": [{"path": escape}]}
    (corpus / "index.json").write_text(json.dumps(manifest))
    assert_error(
        run_inspect(corpus), "index.json", f"path {escape!r} names a file outside the corpus directory"
    )


def test_manifest_symlink_escape(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_shard(tmp_path / "outside.safetensors", ["a"], [np.ones((1, 4), np.float32)])
    os.symlink(tmp_path / "outside.safetensors", corpus / "link.safetensors")
    manifest = {"format": "maxsim-corpus", "format_version": 1, "shards": [{"path": "link.safetensors"}]}
    (corpus / "index.json").write_text(json.dumps(manifest))
    assert_error(
        run_inspect(corpus), "index.json", "resolves (through a symlink)", "outside the corpus directory"
    )


def test_manifest_path_with_a_nul_is_one_line(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_shard(corpus / "a.safetensors", ["a"], [np.ones((1, 4), np.float32)])
    manifest = {"format": "maxsim-corpus", "format_version": 1, "shards": [{"path": "a.safetensors\u0000x"}]}
    (corpus / "index.json").write_text(json.dumps(manifest))
    assert_error(run_inspect(corpus), "index.json", r"path 'a.safetensors\x00x' contains a NUL character")
    with pytest.raises(InputError, match="contains a NUL character"):
        open_corpus([corpus])


@pytest.mark.parametrize("manifest", [False, True])
def test_one_rule_for_links_out_of_a_corpus_folder(tmp_path, manifest):
    """With or without index.json, a folder's shard that a symlink takes outside the folder is refused;
    named as a corpus path itself, the same file is read; links inside the folder are followed."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_shard(corpus / "a.safetensors", ["a"], [np.ones((1, 4), np.float32)])
    write_shard(tmp_path / "outside.safetensors", ["b"], [np.ones((1, 4), np.float32)])
    os.symlink(tmp_path / "outside.safetensors", corpus / "b.safetensors")
    if manifest:
        write_manifest(corpus, ["a.safetensors", "b.safetensors"])
    where = "index.json" if manifest else "b.safetensors"
    assert_error(
        run_inspect(corpus), where, "resolves (through a symlink) to", "outside the corpus directory"
    )
    with pytest.raises(InputError, match="name the file itself as a corpus path"):
        open_corpus([corpus])
    (corpus / "b.safetensors").unlink()
    if manifest:
        write_manifest(corpus, ["a.safetensors"])
    with open_corpus([corpus, corpus.parent / "outside.safetensors"]) as named:  # named: read
        assert named.ids == ["a", "b"]
    os.symlink(corpus / "a.safetensors", corpus / "sub.safetensors")  # a link inside the folder
    if manifest:
        write_manifest(corpus, ["sub.safetensors"])
        with open_corpus([corpus]) as inside:
            assert inside.ids == ["a"]
    else:  # both names of one file are listed: the same shard twice
        with pytest.raises(InputError, match="the same shard is listed twice"):
            open_corpus([corpus])


def test_write_shard_with_mixed_dims_is_an_input_error(tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(InputError) as info:
        write_shard(path, ["a", "b"], [np.ones((3, 128)), np.ones((3, 64))])
    assert str(info.value) == (
        f"{path}: document 'b' (index 1) has vectors of 64 values; this shard has dim 128; encode all "
        "documents with one model"
    )
    assert not path.exists()
    with pytest.raises(InputError, match=r"document 'b' \(index 1\): dtype <U1 is not a real-number type"):
        write_shard(path, ["a", "b"], [np.ones((3, 8)), np.array([["x"] * 8])])


def test_manifest_counts_must_match(tmp_path):
    write_shard(tmp_path / "a.safetensors", ["a", "b"], [np.ones((1, 4), np.float32)] * 2)
    manifest = json.loads(open(write_manifest(tmp_path)).read())
    manifest["shards"][0]["num_docs"] = 3
    (tmp_path / "index.json").write_text(json.dumps(manifest))
    assert_error(run_inspect(tmp_path), "a.safetensors", "num_docs=2 but the manifest", "says 3")


# --- pack: invalid sources leave no output ---


def pack(*args):
    return runner.invoke(app, ["pack", *map(str, args)])


def write_parquet(path, ids, docs):
    pq.write_table(pa.table({"id": ids, "embedding": pa.array(docs, pa.list_(pa.list_(pa.float32())))}), path)


@pytest.mark.parametrize(
    "ids, docs, fragments",
    [
        (["a", "b"], [[[1.0, 2.0]], []], ["row 1: document 'b' has zero tokens"]),
        (
            ["a", "a"],
            [[[1.0, 2.0]], [[3.0, 4.0]]],
            ["src.parquet row 1: duplicate id 'a' (first at", "row 0)"],
        ),
        (
            ["a", "b"],
            [[[1.0, 2.0]], [[3.0, float("nan")]]],
            ["src.parquet row 1: document 'b' has NaN or Inf values at token 0"],
        ),
        (
            ["a", "b"],
            [[[1.0, 2.0]], [[3.0, 4.0, 5.0]]],
            ["row 1: document 'b' has a token vector of 3 values"],
        ),
        (["a", "b c"], [[[1.0, 2.0]], [[3.0, 4.0]]], ["src.parquet row 1: id 'b c' contains whitespace"]),
    ],
)
def test_pack_refuses_invalid_sources_and_leaves_nothing(tmp_path, ids, docs, fragments):
    write_parquet(tmp_path / "src.parquet", ids, docs)
    result = pack(tmp_path / "src.parquet", "-o", tmp_path / "out")
    assert_error(result, "src.parquet", *fragments)
    assert sorted(os.listdir(tmp_path)) == ["src.parquet"]  # no OUTDIR, no temp directory


def test_pack_refuses_an_outdir_with_shards(tmp_path):
    write_parquet(tmp_path / "src.parquet", ["a"], [[[1.0, 2.0]]])
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-00000.safetensors").write_bytes(b"keep me")
    assert_error(
        pack(tmp_path / "src.parquet", "-o", out),
        "out",
        "already holds shards (shard-00000.safetensors)",
        code=2,
    )
    assert os.listdir(out) == ["shard-00000.safetensors"]
    assert (out / "shard-00000.safetensors").read_bytes() == b"keep me"


def test_pack_usage_errors(tmp_path):
    write_parquet(tmp_path / "src.parquet", ["a"], [[[1.0, 2.0]]])
    result = pack(tmp_path / "src.parquet", "-o", tmp_path / "out", "--embedding-column", "colbert")
    assert_error(
        result, "src.parquet", "no column 'colbert' (--embedding-column); columns: id, embedding", code=2
    )
    assert_error(
        pack(tmp_path / "src.parquet", "-o", tmp_path / "out", "--dtype", "int8"), "--dtype 'int8'", code=2
    )
    assert sorted(os.listdir(tmp_path)) == ["src.parquet"]


def test_npy_object_arrays_are_never_unpickled(tmp_path):
    src = tmp_path / "npy"
    src.mkdir()
    np.save(src / "a.npy", np.ones((2, 4), np.float32))
    np.save(src / "evil.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    assert_error(pack(src, "-o", tmp_path / "out"), "evil.npy", "cannot read as a numeric .npy array")
    assert sorted(os.listdir(tmp_path)) == ["npy"]


# --- ids: no whitespace, control or zero-width characters, in every reader and writer ---

# Each forbidden id has a 3-byte UTF-8 placeholder of the same length, so that a valid file written with
# the placeholder becomes the bad file by replacing bytes (what a foreign writer would produce).
BAD_IDS = [
    ("a\x00\x00\x00b", "aQQQb", "contains a control character, U+0000, at character 1"),
    ("a\u200bb", "aQQQb", "contains an invisible zero-width character, U+200B ZERO WIDTH SPACE"),
    ("a\u2060b", "aQQQb", "contains an invisible zero-width character, U+2060 WORD JOINER"),
    ("a\ufeffb", "aQQQb", "contains an invisible zero-width character, U+FEFF"),
    ("a\x1b\x7f\x7fb", "aQQQb", "contains a control character, U+001B"),
]


@pytest.mark.parametrize("suffix", [".safetensors", ".arrow", ".parquet"])
@pytest.mark.parametrize(("bad_id", "placeholder", "problem"), BAD_IDS)
def test_forbidden_id_characters_are_refused_by_every_reader(tmp_path, suffix, bad_id, placeholder, problem):
    assert len(bad_id.encode()) == len(placeholder.encode())
    path = tmp_path / f"s{suffix}"
    write_shard(path, ["d0", placeholder, "d2"], [np.ones((1, 4), np.float32)] * 3)
    data = path.read_bytes()
    assert placeholder.encode() in data
    path.write_bytes(data.replace(placeholder.encode(), bad_id.encode()))
    assert_error(run_inspect(path), f"s{suffix}: id {bad_id!r} at index 1 {problem}")
    # as a query file, the same line before anything is scored
    corpus = tmp_path / "corpus.safetensors"
    write_shard(corpus, ["c0"], [np.ones((1, 4), np.float32)])
    result = runner.invoke(app, ["score", str(path), str(corpus), "--device", "cpu"])
    assert_error(result, f"s{suffix}: ", f"at index 1 {problem}")


@pytest.mark.parametrize(("bad_id", "placeholder", "problem"), BAD_IDS)
def test_forbidden_id_characters_are_refused_by_every_writer(tmp_path, bad_id, placeholder, problem):
    from maxsim_cli.queries import Queries
    from maxsim_cli.shards import ShardWriter

    docs = [np.ones((1, 4), np.float32)] * 2
    pattern = re.escape(problem)
    for suffix in (".safetensors", ".arrow", ".parquet"):
        with pytest.raises(InputError, match=rf"w{suffix}: id .* at index 1 {pattern}"):
            write_shard(tmp_path / f"w{suffix}", ["ok", bad_id], docs)
    with pytest.raises(InputError, match=rf"sw\.safetensors: id .* at index 1 {pattern}"):
        with ShardWriter(str(tmp_path / "sw.safetensors"), 4, "float32") as writer:
            writer.add(["ok"], docs[:1])
            writer.add([bad_id], docs[:1])
    with pytest.raises(InputError, match=rf"queries: query id .* at index 1 {pattern}"):
        Queries.from_embeddings(["q0", bad_id], docs)
    write_parquet(tmp_path / "src.parquet", ["a", bad_id], [[[1.0, 2.0]], [[3.0, 4.0]]])
    assert_error(pack(tmp_path / "src.parquet", "-o", tmp_path / "out"), "src.parquet row 1: id", problem)
    assert sorted(os.listdir(tmp_path)) == ["src.parquet"]  # nothing written, no temp file left


def test_forbidden_id_characters_in_a_candidate_run_or_qrels(tmp_path):
    corpus = tmp_path / "c.safetensors"
    write_shard(corpus, ["d0", "d1"], [np.ones((1, 8), np.float32)] * 2)
    write_shard(tmp_path / "q.safetensors", ["q0"], [np.ones((1, 8), np.float32)])
    (tmp_path / "run.trec").write_text("q0 Q0 d0 1 2 t\nq0 Q0 d\u200b1 2 1 t\n")
    out = tmp_path / "out.trec"
    result = runner.invoke(
        app,
        ["score", str(tmp_path / "q.safetensors"), str(corpus), "--candidates", str(tmp_path / "run.trec")]
        + ["--device", "cpu", "-o", str(out)],
    )
    assert_error(result, "run.trec:2: column 3 'd\\u200b1' contains an invisible zero-width character")
    assert not out.exists()
    (tmp_path / "qrels.txt").write_text("q0 0 d\x001 1\n")
    result = runner.invoke(app, ["eval", str(tmp_path / "run.trec"), str(tmp_path / "qrels.txt")])
    assert result.exit_code == 1
    assert "contains" in result.stderr and len(result.stderr.strip().splitlines()) == 1


# --- zero-document shards, encoder and normalisation mismatches: warnings, errors under --strict ---


def empty_shard(path, **meta):
    """A shard of no documents, as another tool could write it (maxsim's writers refuse to)."""
    values = np.zeros((0, 8), np.float32)
    meta = {"num_docs": "0", "num_tokens": "0", "dim": "8", **meta}
    return raw_shard(path, ids=(), lengths=(), values=values, meta=meta)


def shard(path, ids, *, normalized=False, encoder=None):
    """A valid dim-8 shard of one token per id (unit vectors when ``normalized``)."""
    rng = np.random.default_rng(len(ids))
    docs = [rng.standard_normal((1, 8)).astype(np.float32) for _ in ids]
    if normalized:
        docs = [d / np.linalg.norm(d) for d in docs]
    else:
        docs = [d * 3 for d in docs]
    write_shard(path, list(ids), docs, encoder=encoder)
    return str(path)


def score(*args):
    return runner.invoke(app, ["score", *map(str, args), "--device", "cpu", "--quiet"])


def test_empty_corpus_shard_is_skipped_with_a_warning(tmp_path):
    from maxsim_cli import api
    from maxsim_cli.errors import MaxsimWarning

    queries = shard(tmp_path / "q.safetensors", ["q0"])
    good = shard(tmp_path / "a.safetensors", ["d0", "d1", "d2"])
    empty = empty_shard(tmp_path / "b.safetensors")
    result = score(queries, good, empty, "-k", "2")
    assert result.exit_code == 0, result.output
    assert result.stderr.strip() == (
        f"maxsim: warning: {empty}: holds no documents; skipped (--strict makes this an error)"
    )
    assert len(result.stdout.splitlines()) == 2
    out = tmp_path / "out.trec"
    assert_error(score(queries, good, empty, "--strict", "-o", out), f"{empty}: holds no documents; drop it")
    assert not out.exists()
    assert_error(score(queries, empty, "-o", out), f"{empty}: holds no documents; a corpus needs")
    assert not out.exists()
    with pytest.warns(MaxsimWarning, match="b.safetensors: holds no documents; skipped"):
        corpus = api.open_corpus([good, empty])
    assert (len(corpus), corpus.skipped) == (3, [empty])
    corpus.close()


def test_query_file_without_queries_gives_a_warning_and_an_empty_run(tmp_path):
    from maxsim_cli import api
    from maxsim_cli.errors import MaxsimWarning

    corpus = shard(tmp_path / "a.safetensors", ["d0", "d1"])
    queries = empty_shard(tmp_path / "q.safetensors")
    out = tmp_path / "out.trec"
    result = score(queries, corpus, "-o", out)
    assert result.exit_code == 0, result.output
    assert result.stderr.strip() == (
        f"maxsim: warning: {queries}: holds no queries; the run is empty (--strict makes this an error)"
    )
    assert out.read_text() == ""
    out.unlink()
    assert_error(score(queries, corpus, "--strict", "-o", out), f"{queries}: holds no queries; give")
    assert not out.exists()
    with pytest.warns(MaxsimWarning, match="holds no queries"):
        run = api.search(queries, corpus, k=1, device="cpu")
    assert len(run) == 0


def test_queries_from_another_encoder_or_normalisation(tmp_path):
    from maxsim_cli import api
    from maxsim_cli.errors import MaxsimWarning

    corpus = shard(tmp_path / "a.safetensors", ["d0", "d1"], encoder="org/colbert-a")
    queries = shard(tmp_path / "q.safetensors", ["q0"], encoder="org/colbert-b")
    result = score(queries, corpus, "-k", "1")
    assert result.exit_code == 0, result.output
    warning = result.stderr.strip()
    assert warning.startswith(f"maxsim: warning: {queries}: the queries were made by encoder 'org/colbert-b'")
    assert f"but the corpus ({corpus}) by 'org/colbert-a'" in warning and "\n" not in warning
    out = tmp_path / "out.trec"
    out.write_text("previous\n")
    assert_error(score(queries, corpus, "--strict", "-o", out), "'org/colbert-b'", "encode the queries")
    assert out.read_text() == "previous\n"
    with pytest.warns(MaxsimWarning, match="made by encoder 'org/colbert-b'"):
        api.search(queries, corpus, k=1, device="cpu")
    with pytest.raises(InputError, match="made by encoder 'org/colbert-b'"):
        api.rerank(queries, corpus, {"q0": ["d0"]}, strict=True, device="cpu")
    # one side without an encoder name: nothing to compare
    unnamed = shard(tmp_path / "u.safetensors", ["q0"])
    result = score(unnamed, corpus, "-k", "1")
    assert (result.exit_code, result.stderr) == (0, "")
    # L2-normalised queries against a corpus that is not
    normalized = shard(tmp_path / "n.safetensors", ["q0"], normalized=True, encoder="org/colbert-a")
    result = score(normalized, corpus, "-k", "1")
    assert result.exit_code == 0, result.output
    assert "the queries are L2-normalised but the corpus" in result.stderr
    assert "is not L2-normalised" in result.stderr
    assert_error(score(normalized, corpus, "--strict", "-o", out), "are L2-normalised but the corpus")
    assert out.read_text() == "previous\n"
