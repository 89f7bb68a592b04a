"""Shard format v1: writers and readers round-trip exactly, read only what is asked, stream in budgets."""

from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors.numpy import save_file

from maxsim_cli.errors import InputError, MaxsimError, UsageError
from maxsim_cli.shards import (
    DocBatch,
    ShardWriter,
    arrow_schema,
    open_corpus,
    open_shard,
    read_queries,
    write_manifest,
    write_shard,
)
from maxsim_cli.units import format_size, parse_size

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
FORMATS = ("safetensors", "arrow", "parquet")
SUFFIX = {"safetensors": ".safetensors", "arrow": ".arrow", "parquet": ".parquet"}


def make_docs(
    n: int = 40, dim: int = 12, seed: int = 0, max_len: int = 30
) -> tuple[list[str], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=gen)
    docs = [torch.randn(int(k), dim, generator=gen) for k in lengths]
    return [f"doc-{seed}-{i}" for i in range(n)], docs


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so comparisons are exact (NaN-safe, -0.0 != 0.0)."""
    return (
        t.view(torch.int16)
        if t.element_size() == 2
        else t.view(torch.int32 if t.element_size() == 4 else torch.int8)
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_round_trip_bit_exact(tmp_path, fmt, dtype):
    ids, docs = make_docs()
    path = tmp_path / f"s{SUFFIX[fmt]}"
    info = write_shard(path, ids, docs, dtype=dtype, encoder="enc-x")
    assert (info.format, info.dtype, info.num_docs, info.encoder) == (fmt, dtype, 40, "enc-x")
    assert info.num_tokens == sum(d.shape[0] for d in docs)
    with open_shard(path) as shard:
        assert shard.info == info
        batch = shard.read_docs(0, shard.num_docs)
    expected = torch.cat(docs).to(DTYPES[dtype])
    assert batch.ids == ids
    assert batch.embeddings.dtype == DTYPES[dtype] and batch.embeddings.is_contiguous()
    assert torch.equal(bits(batch.embeddings), bits(expected))  # bf16 included: bit-exact
    assert batch.offsets.tolist() == np.cumsum([0] + [d.shape[0] for d in docs]).tolist()
    assert batch.scales is None and batch.first_doc == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_round_trip_with_scales(tmp_path, fmt):
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (50, 8), dtype=torch.int8, generator=gen)
    scales = torch.rand(50, generator=gen)
    path = tmp_path / f"q{SUFFIX[fmt]}"
    info = write_shard(path, ["a", "b", "c"], q, offsets=[0, 10, 11, 50], scales=scales)
    assert (info.dtype, info.quantization) == ("int8", "int8-per-token")
    with open_shard(path) as shard:
        batch = shard.read_docs(1, 3)
    assert batch.ids == ["b", "c"] and batch.first_doc == 1
    assert torch.equal(batch.embeddings, q[10:])
    assert torch.equal(batch.scales, scales[10:])


def test_safetensors_and_arrow_agree(tmp_path):
    ids, docs = make_docs(n=25, seed=3)
    write_shard(tmp_path / "a.safetensors", ids, docs, dtype="bfloat16")
    write_shard(tmp_path / "a.arrow", ids, docs, dtype="bfloat16")
    a, b = read_queries(str(tmp_path / "a.safetensors")), read_queries(str(tmp_path / "a.arrow"))
    assert a.ids == b.ids
    assert torch.equal(bits(a.embeddings), bits(b.embeddings))
    assert torch.equal(a.offsets, b.offsets)


def test_packed_input_and_streaming_writer_match(tmp_path):
    ids, docs = make_docs(n=30, seed=4)
    packed = torch.cat(docs)
    offsets = np.cumsum([0] + [d.shape[0] for d in docs])
    write_shard(tmp_path / "packed.safetensors", ids, packed.numpy(), offsets=offsets, dtype="float32")
    with ShardWriter(tmp_path / "streamed.arrow", 12, "float32") as writer:
        for i in range(0, 30, 7):  # uneven pieces, numpy and torch mixed
            writer.add(ids[i : i + 7], [d.numpy() if i % 2 else d for d in docs[i : i + 7]])
    a = read_queries(str(tmp_path / "packed.safetensors"))
    b = read_queries(str(tmp_path / "streamed.arrow"))
    assert a.ids == b.ids == ids
    assert torch.equal(a.embeddings, packed) and torch.equal(b.embeddings, packed)


def test_plain_safetensors_writer_is_compatible(tmp_path):
    """A shard written with nothing but safetensors.numpy.save_file (the docs/format.md example)."""
    ids = ["d1", "d2", "é3"]
    docs = [
        np.random.default_rng(i).standard_normal((n, 4)).astype(np.float16) for i, n in enumerate([3, 1, 2])
    ]
    id_bytes = [s.encode("utf-8") for s in ids]
    tensors = {
        "embeddings": np.concatenate(docs),
        "offsets": np.cumsum([0] + [len(d) for d in docs]).astype(np.int64),
        "ids": np.frombuffer(b"".join(id_bytes), dtype=np.uint8),
        "id_offsets": np.cumsum([0] + [len(b) for b in id_bytes]).astype(np.int64),
    }
    meta = {
        "format": "maxsim-shard",
        "format_version": "1",
        "dim": "4",
        "dtype": "float16",
        "quantization": "none",
        "normalized": "false",
        "num_docs": "3",
        "num_tokens": "6",
    }
    save_file(tensors, str(tmp_path / "plain.safetensors"), metadata=meta)
    batch = read_queries(str(tmp_path / "plain.safetensors"))
    assert batch.ids == ids
    assert np.array_equal(batch.embeddings.numpy(), tensors["embeddings"])


def test_arrow_written_by_plain_pyarrow_is_compatible(tmp_path):
    """An Arrow table built directly from the documented schema, as a list<list<float>> fallback too."""
    meta = {
        "format": "maxsim-shard",
        "format_version": "1",
        "dim": "2",
        "dtype": "float32",
        "quantization": "none",
        "normalized": "false",
        "num_docs": "2",
        "num_tokens": "3",
    }
    table = pa.table(
        {
            "id": ["x", "y"],
            "embedding": pa.array([[[1, 2]], [[3, 4], [5, 6]]], pa.list_(pa.list_(pa.float32()))),
        }
    ).replace_schema_metadata(meta)
    with pa.ipc.new_file(str(tmp_path / "t.arrow"), table.schema) as out:
        out.write_table(table)
    batch = read_queries(str(tmp_path / "t.arrow"))
    assert batch.embeddings.tolist() == [[1, 2], [3, 4], [5, 6]]


def test_read_docs_reads_only_the_slice(tmp_path):
    """Poison one document's values on disk: slices that avoid it read fine, the one covering it fails."""
    ids, docs = make_docs(n=10, dim=4, seed=5)
    path = tmp_path / "s.safetensors"
    write_shard(path, ids, docs, dtype="float32")
    with open_shard(path) as shard:
        offsets = shard.offsets.copy()
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    raw = bytearray(path.read_bytes())
    start = 8 + header_len + int(offsets[6]) * 4 * 4  # embeddings come first in the data section
    raw[start : start + 4] = np.array([np.nan], dtype=np.float32).tobytes()
    path.write_bytes(bytes(raw))
    with open_shard(path) as shard:  # open is O(N): values are not touched
        assert shard.read_docs(0, 6).num_docs == 6
        assert shard.read_docs(7, 10).num_docs == 3
        with pytest.raises(InputError, match=r"s\.safetensors: document 'doc-5-6' \(index 6\) has NaN"):
            shard.read_docs(5, 8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_doc_indices_gathers_in_order(tmp_path, fmt):
    ids, docs = make_docs(n=20, dim=6, seed=6)
    path = tmp_path / f"s{SUFFIX[fmt]}"
    write_shard(path, ids, docs, dtype="float32")
    order = [7, 3, 3, 19, 0, 8]
    with open_shard(path) as shard:
        batch = shard.read_doc_indices(order)
        empty = shard.read_doc_indices([])
    assert batch.ids == [ids[i] for i in order]
    assert torch.equal(batch.embeddings, torch.cat([docs[i] for i in order]))
    assert batch.offsets.tolist() == np.cumsum([0] + [docs[i].shape[0] for i in order]).tolist()
    assert empty.num_docs == 0 and empty.embeddings.shape == (0, 6) and empty.offsets.tolist() == [0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_iter_batches_respects_token_budget(tmp_path, fmt):
    ids, docs = make_docs(n=60, dim=4, seed=7, max_len=50)
    docs[10] = torch.randn(120, 4)  # longer than the budget: comes alone
    path = tmp_path / f"s{SUFFIX[fmt]}"
    write_shard(path, ids, docs, dtype="float16")
    with open_shard(path) as shard:
        batches = list(shard.iter_batches(100))
        capped = list(shard.iter_batches(10_000, max_docs=7))
    assert [i for b in batches for i in b.ids] == ids
    for b in batches:
        assert b.num_tokens <= 100 or b.num_docs == 1
        assert b.offsets[0] == 0 and b.offsets[-1] == b.num_tokens
    assert any(b.ids == [ids[10]] for b in batches)
    # greedy: a batch stops only where the next document would not fit
    for b, nxt in zip(batches, batches[1:], strict=False):
        assert b.num_tokens + int(nxt.lengths()[0]) > 100
    assert [b.first_doc for b in capped] == list(range(0, 60, 7))


def test_read_queries_from_stdin_stream(tmp_path, monkeypatch):
    ids, docs = make_docs(n=5, dim=3, seed=8)
    write_shard(tmp_path / "q.arrow", ids, docs, dtype="float32")
    table = pa.ipc.open_file(str(tmp_path / "q.arrow")).read_all()
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as out:
        out.write_table(table)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(sink.getvalue())))
    batch = read_queries("-")
    assert isinstance(batch, DocBatch) and batch.ids == ids
    assert torch.equal(batch.embeddings, torch.cat(docs))


def test_corpus_with_manifest(tmp_path):
    ids_a, docs_a = make_docs(n=10, seed=9)
    ids_b, docs_b = make_docs(n=15, seed=10)
    write_shard(tmp_path / "a.safetensors", ids_a, docs_a, dtype="float16")
    write_shard(tmp_path / "b.arrow", ids_b, docs_b, dtype="float16")
    manifest = write_manifest(tmp_path)
    doc = json.loads(open(manifest).read())
    assert doc["format"] == "maxsim-corpus" and doc["format_version"] == 1
    assert [e["path"] for e in doc["shards"]] == ["a.safetensors", "b.arrow"]
    with open_corpus([tmp_path], verify_checksums=True) as corpus:
        assert (corpus.num_docs, corpus.dim, corpus.dtype) == (25, 12, "float16")
        assert corpus.num_tokens == sum(d.shape[0] for d in docs_a + docs_b)
        index = corpus.id_index()
        assert index[ids_b[3]] == (1, 3) and index[ids_a[0]] == (0, 0)
        assert corpus.doc_starts.tolist() == [0, 10, 25]
    # a shard changed after the manifest was written: counts still match, the checksum does not
    write_shard(tmp_path / "a.safetensors", ids_a, [d * 2 for d in docs_a], dtype="float16")
    open_corpus([tmp_path]).close()
    with pytest.raises(InputError, match=r"a\.safetensors: sha256 .* does not match"):
        open_corpus([tmp_path], verify_checksums=True)


def test_corpus_without_manifest_lists_shards_by_name(tmp_path):
    for name, seed in (("b.parquet", 1), ("a.safetensors", 2), ("c.arrow", 3)):
        ids, docs = make_docs(n=3, dim=4, seed=seed)
        write_shard(tmp_path / name, ids, docs, dtype="float32")
    (tmp_path / "notes.txt").write_text("not a shard")
    with open_corpus([str(tmp_path)]) as corpus:
        assert [os.path.basename(p) for p in corpus.paths] == ["a.safetensors", "b.parquet", "c.arrow"]


def test_normalized_flag_is_measured(tmp_path):
    ids, docs = make_docs(n=5, dim=8, seed=11)
    unit = [torch.nn.functional.normalize(d, dim=1) for d in docs]
    assert write_shard(tmp_path / "u.safetensors", ids, unit, dtype="bfloat16").normalized
    assert not write_shard(tmp_path / "r.safetensors", ids, docs, dtype="bfloat16").normalized
    with pytest.raises(InputError, match="normalized=True but token 0 of document 'doc-11-0'"):
        write_shard(tmp_path / "bad.safetensors", ids, docs, normalized=True)
    assert not (tmp_path / "bad.safetensors").exists()


def test_failed_write_leaves_nothing(tmp_path):
    ids, docs = make_docs(n=5, dim=4, seed=12)
    docs[3][0, 1] = float("inf")
    for fmt in FORMATS:
        with pytest.raises(InputError, match="document 'doc-12-3' .* NaN or Inf values at token 0"):
            write_shard(tmp_path / f"x{SUFFIX[fmt]}", ids, docs)
    with pytest.raises(RuntimeError), ShardWriter(tmp_path / "y.arrow", 4, "float32") as writer:
        writer.add(ids[:2], docs[:2])
        raise RuntimeError("caller failed midway")
    assert os.listdir(tmp_path) == []


def test_arrow_schema_layout():
    schema = arrow_schema(128, "bfloat16")
    assert str(schema.field("embedding").type) == "list<item: fixed_size_list<item: uint16>[128]>"
    assert schema.names == ["id", "embedding"]
    assert arrow_schema(4, "int8").names == ["id", "embedding", "scales"]


def test_parse_size():
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512 MB") == 512_000_000
    assert parse_size("1.5KiB") == 1536
    assert parse_size("4096") == 4096
    assert parse_size("3tib") == 3 * 1024**4
    for junk in ("", "GiB", "2 gigs", "-1GB", "1e9", "2GiBs"):
        with pytest.raises(UsageError, match="--max-memory: invalid size"):
            parse_size(junk, option="--max-memory")
    assert format_size(1536) == "1.5 KiB" and format_size(10) == "10 B"


def test_parquet_from_a_foreign_writer(tmp_path):
    """No `length` column and variable-size inner lists (what a non-Arrow Parquet writer produces)."""
    import pyarrow.parquet as pq

    meta = {
        "format": "maxsim-shard",
        "format_version": "1",
        "dim": "2",
        "dtype": "float32",
        "quantization": "none",
        "normalized": "false",
        "num_docs": "3",
        "num_tokens": "4",
    }
    vectors = [[[1, 2]], [[3, 4], [5, 6]], [[7, 8]]]
    table = pa.table(
        {"id": ["a", "b", "c"], "embedding": pa.array(vectors, pa.list_(pa.list_(pa.float32())))}
    )
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "f.parquet", row_group_size=2)
    with open_shard(tmp_path / "f.parquet") as shard:
        assert shard.offsets.tolist() == [0, 1, 3, 4]
        assert shard.read_docs(1, 3).embeddings.tolist() == [[3, 4], [5, 6], [7, 8]]
    vectors[1][1] = [5, 6, 9]  # one vector of the wrong width
    table = pa.table(
        {"id": ["a", "b", "c"], "embedding": pa.array(vectors, pa.list_(pa.list_(pa.float32())))}
    )
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "f.parquet", row_group_size=2)
    with open_shard(tmp_path / "f.parquet") as shard:
        assert shard.read_docs(0, 1).ids == ["a"]  # only the documents asked for are checked
        with pytest.raises(
            InputError, match=r"f\.parquet: document 'b' has a token vector of 3 values; dim is 2"
        ):
            shard.read_docs(0, 3)


def test_id_checks_without_python_objects_agree_with_python_on_every_code_point() -> None:
    """The shard reader checks ids with a byte table (ASCII ids) or Arrow's regex (others) and sorted
    neighbours; both must refuse exactly the ids that `ID_FORBIDDEN` (Python's `\\s`, control and
    zero-width characters) or a repeated id would."""
    import numpy as np

    from maxsim_cli import shards as sh
    from maxsim_cli.shards.format import decode_ids

    def decode(ids: list[str]) -> None:
        raw = [i.encode() for i in ids]
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in raw])]).astype(np.int64)
        decode_ids("t.safetensors", np.frombuffer(b"".join(raw), dtype=np.uint8), offsets)

    for code in range(1, 0x3100):
        char = chr(code)
        if 0xD800 <= code <= 0xDFFF:
            continue  # surrogates are not valid UTF-8
        for ids in ([f"a{char}b", "c"], [f"x{char}", "é"]):  # an ASCII-only id list, and a mixed one
            if sh.ID_FORBIDDEN.search(char):
                kind = "whitespace" if char.isspace() else "a control" if code < 0xA0 else "an invisible"
                with pytest.raises(MaxsimError, match=f"contains {kind}"):
                    decode(ids)
            else:
                decode(ids)
    with pytest.raises(MaxsimError, match="duplicate id 'b' at indices 1 and 3"):
        decode(["a", "b", "c", "b"])
    with pytest.raises(MaxsimError, match="duplicate id 'é' at indices 0 and 2"):
        decode(["é", "e", "é"])


@pytest.mark.parametrize("by_shard", [False, True])
def test_sorted_id_order_is_one_sort_of_all_ids(monkeypatch, by_shard):
    """Ids sorted shard by shard in threads, then their sorted runs once more, give the order of one
    sort of all ids (UTF-8 bytes: Python's str order), with each id's corpus ordinal."""
    from maxsim_cli.shards import format as shard_format  # where sorted_id_order reads its thresholds

    if by_shard:
        monkeypatch.setattr(shard_format, "BY_SHARD_SORT_MIN_THREADS", 2)
        monkeypatch.setattr(shard_format, "BY_SHARD_SORT_MIN_IDS", 0)
    monkeypatch.setattr(shard_format.os, "cpu_count", lambda: 4)
    rng = np.random.default_rng(3)
    words = ["é", "e", "E", "z", "10", "9", "a", "ß", "中"]
    ids = list(dict.fromkeys(f"{rng.choice(words)}{rng.integers(0, 10**6)}" for _ in range(3000)))
    ids += ["", "0"]  # the empty id sorts first
    cuts = [0, 1, 700, 1500, 1500, len(ids)]  # one id alone, an empty shard
    arrays = [pa.array(ids[a:b], type=pa.string()) for a, b in zip(cuts, cuts[1:], strict=False)]
    all_ids, ordinals, sorted_ids = shard_format.sorted_id_order(arrays)
    assert all_ids.to_pylist() == ids
    expected = sorted(range(len(ids)), key=lambda i: ids[i].encode())
    assert ordinals.tolist() == expected
    assert sorted_ids.to_pylist() == [ids[i] for i in expected]


def test_candidate_index_is_id_index_restricted_to_the_candidates(tmp_path):
    """Candidates found in any shard map to (shard, document) as `id_index` says; unknown ones, and an
    empty request, give nothing; a docno asked twice is one entry. Once the whole `id_index` is built
    (a server's corpus), that is what it gives: the same entries for the candidates."""
    a = ["x", "b", "é", "a"]
    b = ["z", "y", "中", "10"]
    for name, ids in (("a", a), ("b", b)):
        write_shard(tmp_path / f"{name}.safetensors", ids, [np.ones((2, 4), np.float32)] * len(ids))
    corpus = open_corpus([tmp_path])
    asked = ["10", "missing", "é", "x", "10", "", "中"]
    found = corpus.candidate_index(asked)
    assert corpus.candidate_index([]) == {}
    full = corpus.id_index()
    assert found == {d: full[d] for d in asked if d in full}
    assert found["中"] == (1, 2) and found["x"] == (0, 0)
    assert corpus.candidate_index(asked) is full and "missing" not in full


def test_ordinal_index_numbers_documents_over_the_shards_in_order(tmp_path):
    """`ordinal_index`: each id's position over the shards in order (what a resident corpus and the
    kernels index), i.e. `id_index`'s (shard, document) as the shard's first ordinal plus the document."""
    for name, ids in (("a", ["x", "b", "é"]), ("b", ["z", "中", "10", "a"])):
        write_shard(tmp_path / f"{name}.safetensors", ids, [np.ones((2, 8), np.float32)] * len(ids))
    corpus = open_corpus([tmp_path])
    ordinals = corpus.ordinal_index()
    assert ordinals == {d: int(corpus.doc_starts[s]) + i for d, (s, i) in corpus.id_index().items()}
    assert ordinals["x"] == 0 and ordinals["中"] == 4 and corpus.ordinal_index() is ordinals


TORCH_FREE_SCRIPT = """
import sys

import maxsim_cli.run_files
import maxsim_cli.shards

assert "torch" not in sys.modules, "importing maxsim_cli.shards or maxsim_cli.run_files imported torch"
from maxsim_cli.shards import open_corpus, open_shard

corpus = open_corpus([sys.argv[1]])
print(corpus.num_docs, corpus.dim, len(corpus.id_order()[0]))
for path in sys.argv[2:]:
    with open_shard(path) as shard:
        print(shard.info.format, shard.num_docs, shard.ids[0], int(shard.offsets[-1]))
assert "torch" not in sys.modules, "opening shards imported torch"
"""


def test_importing_and_opening_shards_needs_no_torch(tmp_path):
    """Importing the package (and `maxsim_cli.run_files`, which imports from it), and opening a corpus or a
    shard of each container down to its ids and offsets, import no torch: commands that score nothing
    (`maxsim --help`, `eval`, `merge`, `inspect` without value checks) start without it. Checked in a
    fresh interpreter, since this one has torch already."""
    import subprocess
    from pathlib import Path

    corpus = Path(__file__).resolve().parent.parent / "sample_data" / "corpus"
    ids, docs = make_docs(n=5, dim=4)
    paths = []
    for fmt in FORMATS:  # bfloat16, which numpy has no type for
        paths.append(str(tmp_path / f"s{SUFFIX[fmt]}"))
        write_shard(paths[-1], ids, docs, dtype="bfloat16")
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_SCRIPT, str(corpus), *paths], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "400 384 400"
    assert lines[1:] == [f"{fmt} 5 {ids[0]} {sum(len(d) for d in docs)}" for fmt in FORMATS]


def test_candidate_index_is_the_same_with_the_id_dict_built(tmp_path):
    from maxsim_cli.shards import open_corpus, write_shard

    for s in range(3):
        ids = [f"s{s}d{i}" for i in range(5)]
        write_shard(str(tmp_path / f"{s}.safetensors"), ids, [np.ones((2, 4), np.float32)] * 5)
    wanted = ["s2d4", "nope", "s0d0", "s1d3", "s0d0"]
    with open_corpus([tmp_path]) as corpus:
        hashed = corpus.candidate_index(wanted)
        corpus.id_index()
        built = corpus.candidate_index(wanted)
        assert hashed == {"s2d4": (2, 4), "s0d0": (0, 0), "s1d3": (1, 3)}
        assert {d: built[d] for d in wanted if d in built} == hashed


# --------------------------------------------------------------------------------------------------
# the patch grid of image-patch shards (docs/format.md, "Metadata")


@pytest.mark.parametrize("fmt", FORMATS)
def test_patch_grid_round_trips_in_every_container(tmp_path, fmt: str) -> None:
    path = tmp_path / f"pages{SUFFIX[fmt]}"
    docs = [torch.randn(7, 8), torch.randn(5, 8)]
    info = write_shard(path, ["p1", "p2"], docs, patch_grid=(2, 2), patch_start=1)
    assert (info.patch_grid, info.patch_start) == ((2, 2), 1)
    with open_shard(path) as shard:
        assert (shard.info.patch_grid, shard.info.patch_start) == ((2, 2), 1)
    plain = write_shard(tmp_path / f"plain{SUFFIX[fmt]}", ["p1"], docs[:1])
    assert (plain.patch_grid, plain.patch_start) == (None, 0)
    assert write_shard(tmp_path / f"s{SUFFIX[fmt]}", ["p1"], docs[:1], patch_grid="3x1").patch_grid == (3, 1)


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"patch_grid": "32 x 32"}, "patch_grid '32 x 32' is not ROWSxCOLS"),
        ({"patch_grid": "0x4"}, "patch_grid '0x4' is not ROWSxCOLS"),
        ({"patch_grid": "2x2", "patch_start": "-1"}, "patch_start '-1' is not a non-negative integer"),
        ({"patch_start": "3"}, "patch_start without patch_grid"),
    ],
)
def test_a_malformed_patch_grid_is_one_line_naming_the_file(tmp_path, meta: dict, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    embeddings = np.ones((3, 8), dtype=np.float16)
    save_file(
        {
            "embeddings": embeddings,
            "offsets": np.array([0, 3], dtype=np.int64),
            "ids": np.frombuffer(b"d1", dtype=np.uint8),
            "id_offsets": np.array([0, 2], dtype=np.int64),
        },
        str(path),
        metadata={
            "format": "maxsim-shard", "format_version": "1", "dim": "8", "dtype": "float16",
            "quantization": "none", "normalized": "false", "num_docs": "1", "num_tokens": "3", **meta,
        },
    )  # fmt: skip
    with pytest.raises(InputError, match=message) as err:
        open_shard(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)
    with pytest.raises(InputError, match="is not ROWSxCOLS"):
        write_shard(tmp_path / "w.safetensors", ["d1"], [embeddings], patch_grid=(4,))
