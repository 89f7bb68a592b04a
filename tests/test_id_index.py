"""Id indexes (`maxsim_cli.shards.id_index`, docs/format.md "Id indexes"): written by `write_manifest`,
`maxsim add` and `compact`, recorded with their sha256; `maxsim delete` and `add` find ids through them
without opening the corpus, and build again one that is missing or damaged (a warning, never a wrong
answer); the manifest's ``unique_ids`` record lets readers skip the sort of every id, and a record that
does not match what the manifest names is not trusted."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from maxsim_cli import open_corpus, search
from maxsim_cli.arrays import strings_array
from maxsim_cli.cli import app
from maxsim_cli.shards import corpus as shard_corpus
from maxsim_cli.shards import id_index, write_manifest, write_shard
from maxsim_cli.shards.edit import delete_ids
from maxsim_cli.shards.format import read_id_file
from maxsim_cli.shards.generations import read_pointer, read_state

runner = CliRunner()
DIM = 8


def _docs(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [rng.standard_normal((int(rng.integers(1, 4)), DIM)).astype(np.float32) for _ in range(n)]


def _cli(*args: object, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input)


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    rng = np.random.default_rng(5)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in "abc":
        write_shard(folder / f"{name}.safetensors", [f"{name}{i}" for i in range(30)], _docs(rng, 30))
    write_manifest(folder)
    return folder


def _live(folder: Path) -> list[str]:
    with open_corpus(folder) as c:
        mask = c.deleted_mask()
        return sorted(i for n, i in enumerate(c.ids) if mask is None or not mask[n])


def _manifest(folder: Path) -> tuple[Path, dict]:
    number = read_pointer(str(folder))
    path = folder / ("index.json" if number is None else f"generations/{number}/manifest.json")
    return path, json.loads(path.read_text())


def _no_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a corpus must not sort every id (its manifest records them unique)."""

    def refused(*args, **kwargs):
        raise AssertionError("every id sorted to check them unique")

    monkeypatch.setattr(shard_corpus.Corpus, "_check_unique_ids", refused)


def test_the_file_is_what_the_format_says() -> None:
    """A change to the hash or the layout changes these bytes: docs/format.md and the version go with it."""
    index = id_index.build_index(strings_array(["a", "b", "c"]))
    assert index.hashes.tolist() == [288732972, 553148914, 1689727451]  # top 32 bits of hash_utf8
    assert index.rows.tolist() == [2, 1, 0] and index.rows.dtype == np.uint32
    data = id_index.index_bytes(index)
    assert (
        hashlib.sha256(data).hexdigest() == "49ed7ceb7ecc3ada5ded832ae941eb5cc73c5e5c8ac4c128b263edf9b8a98e35"
    )
    from safetensors.numpy import load

    loaded = load(data)  # a plain safetensors file
    assert loaded["hashes"].tolist() == index.hashes.tolist() and loaded["rows"].tolist() == [2, 1, 0]
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert header["__metadata__"] == {
        "format": "maxsim-id-index", "format_version": "1", "hash": id_index.HASH_NAME, "num_docs": "3"
    }  # fmt: skip
    assert (8 + int.from_bytes(data[:8], "little")) % 8 == 0


def test_write_manifest_records_indexes_and_unique_ids(corpus: Path, monkeypatch) -> None:
    _, doc = _manifest(corpus)
    for entry in doc["shards"]:
        path = corpus / entry["ids"]["path"]
        assert path.name == entry["path"] + ".idindex"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["ids"]["sha256"]
    assert len(doc["unique_ids"]) == 64
    _no_sort(monkeypatch)
    with open_corpus(corpus) as c:
        assert len(c) == 90
    assert _cli("inspect", corpus, "--verify-checksums", "--no-check-values").exit_code == 0


def test_delete_and_add_never_open_the_corpus_and_keep_the_record(
    corpus: Path, tmp_path: Path, monkeypatch
) -> None:
    import maxsim_cli.shards.edit as edit

    def refused(*args, **kwargs):
        raise AssertionError("the corpus was opened")

    monkeypatch.setattr(edit, "_open_current", refused)
    result = _cli("delete", corpus, "--ids", "-", input="a1\nb2\nc29\nnope\n")
    assert result.exit_code == 0 and "1 of 4 ids are not in the corpus" in result.output, result.output
    new = tmp_path / "new.safetensors"
    write_shard(new, ["n0", "a1", "b3"], _docs(np.random.default_rng(1), 3))
    result = _cli("add", corpus, new)
    assert result.exit_code == 1 and "'b3' (document 2) is already in the corpus" in result.output
    assert _cli("add", corpus, new, "--replace").exit_code == 0  # a1 deleted before: only b3 replaced
    assert _live(corpus) == sorted({f"{x}{i}" for x in "abc" for i in range(30)} - {"c29", "b2"} | {"n0"})
    _, doc = _manifest(corpus)
    assert all("ids" in e for e in doc["shards"]) and "unique_ids" in doc
    _no_sort(monkeypatch)
    with open_corpus(corpus) as c:
        assert c.num_live == 89
        run = search((["q"], [np.ones((2, DIM), np.float32)]), c, k=1000, device="cpu")
        assert sorted(r.docno for r in run) == _live(corpus)


@pytest.mark.parametrize(
    "damage",
    ["missing", "truncated", "a byte changed", "another shard's index", "the sha256 of another file"],
)
def test_a_missing_or_damaged_index_is_built_again(corpus: Path, damage: str) -> None:
    assert _cli("delete", corpus, "--ids", "-", input="a0\n").exit_code == 0  # generation 1
    path, doc = _manifest(corpus)
    target = corpus / doc["shards"][1]["ids"]["path"]
    if damage == "missing":
        target.unlink()
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:-4])
    elif damage == "a byte changed":
        data = bytearray(target.read_bytes())
        data[-3] ^= 0x10
        target.write_bytes(bytes(data))
    elif damage == "another shard's index":
        target.unlink()
        os.link(corpus / doc["shards"][2]["ids"]["path"], target)
    else:  # a file of the right format whose sha256 the manifest does not give
        doc["shards"][1]["ids"]["sha256"] = doc["shards"][2]["ids"]["sha256"]
        path.write_text(json.dumps(doc))
    result = _cli("delete", corpus, "--ids", "-", input="b7\nb29\nc3\n")
    assert result.exit_code == 0, result.output
    assert (
        "warning:" in result.output
        and "built again from" in result.output
        and "b.safetensors" in result.output
    )
    assert not {"b7", "b29", "c3", "a0"} & set(_live(corpus)) and len(_live(corpus)) == 86
    _, doc = _manifest(corpus)
    rebuilt = corpus / doc["shards"][1]["ids"]["path"]
    assert rebuilt.parent.name == str(read_pointer(str(corpus)))  # a new file in the new generation
    result = _cli("delete", corpus, "--ids", "-", input="b8\n")
    assert result.exit_code == 0 and "warning" not in result.output, result.output


def test_an_index_of_another_format_or_size_is_built_again(corpus: Path, tmp_path: Path) -> None:
    """A file whose sha256 the manifest gives but which is not this shard's index of this version."""
    index = id_index.build_index(strings_array(["x", "y"]))
    for bad, words in [
        (id_index.index_bytes(index), "num_docs='2', expected '30'"),
        (
            id_index.index_bytes(index).replace(b'"format_version":"1"', b'"format_version":"9"'),
            "format_version",
        ),
        (b"\x01" * 40, "not an id index"),
    ]:
        folder = tmp_path / f"c{len(words)}"
        shutil.copytree(corpus, folder)
        (folder / "a.safetensors.idindex").write_bytes(bad)
        doc = json.loads((folder / "index.json").read_text())
        doc["shards"][0]["ids"]["sha256"] = hashlib.sha256(bad).hexdigest()
        doc.pop("unique_ids")
        (folder / "index.json").write_text(json.dumps(doc))
        result = _cli("delete", folder, "--ids", "-", input="a4\n")
        assert result.exit_code == 0 and words in result.output, result.output
        assert "a4" not in _live(folder) and len(_live(folder)) == 89


@pytest.mark.parametrize(
    "record, words",
    [
        ("not an object", "ids must be an object with a path and a sha256"),
        ({"path": "a.safetensors.idindex", "sha256": "12ab"}, "64 hex digits"),
        ({"path": "../elsewhere.idindex", "sha256": "0" * 64}, "outside the corpus folder"),
        ({"path": "/abs.idindex", "sha256": "0" * 64}, "outside the corpus folder"),
    ],
)
def test_a_bad_ids_record_is_a_one_line_error(corpus: Path, record, words: str) -> None:
    for generation in (0, 1):
        if generation:
            assert _cli("delete", corpus, "--ids", "-", input="c0\n").exit_code == 0
        path, doc = _manifest(corpus)
        saved = path.read_text()
        doc["shards"][0]["ids"] = record
        path.write_text(json.dumps(doc))
        for args in (["inspect", corpus], ["delete", corpus, "--ids", "-"]):
            result = _cli(*args, input="a1\n")
            assert result.exit_code == 1 and words in result.output, (args, result.output)
            assert len(result.output.strip().splitlines()) == 1
        path.write_text(saved)


def test_a_bad_unique_ids_record_is_a_one_line_error(corpus: Path) -> None:
    for generation in (0, 1):
        if generation:
            assert _cli("delete", corpus, "--ids", "-", input="c0\n").exit_code == 0
        path, doc = _manifest(corpus)
        saved = path.read_text()
        path.write_text(json.dumps({**doc, "unique_ids": "yes"}))
        result = _cli("inspect", corpus)
        assert result.exit_code == 1 and "'unique_ids' must be a sha256" in result.output
        assert len(result.output.strip().splitlines()) == 1
        path.write_text(saved)


def test_a_record_that_does_not_match_is_not_trusted(corpus: Path, tmp_path: Path) -> None:
    """A deleted id added again in another shard, then its deletion set dropped from the manifest by
    hand: the record no longer matches, so readers sort the ids again and name the duplicate; a writer
    checks them once through the indexes and refuses too."""
    assert _cli("delete", corpus, "--ids", "-", input="a5\n").exit_code == 0
    again = tmp_path / "again.safetensors"
    write_shard(again, ["a5", "z1"], _docs(np.random.default_rng(3), 2))
    assert _cli("add", corpus, again).exit_code == 0
    assert _live(corpus).count("a5") == 1
    path, doc = _manifest(corpus)
    del doc["shards"][0]["deleted"]
    path.write_text(json.dumps(doc))
    result = _cli("inspect", corpus)
    assert result.exit_code == 1 and "duplicate id 'a5'" in result.output, result.output
    for args in (["delete", corpus, "--ids", "-"], ["add", corpus, tmp_path / "other.safetensors"]):
        write_shard(tmp_path / "other.safetensors", ["o1"], _docs(np.random.default_rng(4), 1))
        result = _cli(*args, input="b1\n")
        assert result.exit_code == 1 and "duplicate id 'a5'" in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("where", ["index.json", "no manifest", "a generation's manifest"])
def test_an_old_corpus_gets_its_indexes_at_its_first_write(corpus: Path, monkeypatch, where: str) -> None:
    """A folder changed or packed before id indexes (a manifest without them, or none): it opens as
    before, and the next write command builds its indexes and checks its ids unique, once."""
    if where == "a generation's manifest":
        assert _cli("delete", corpus, "--ids", "-", input="b0\n").exit_code == 0
    path, doc = _manifest(corpus)
    for entry in doc["shards"]:
        (corpus / entry["ids"]["path"]).unlink()
        del entry["ids"]
    del doc["unique_ids"]
    path.write_text(json.dumps(doc))
    if where == "no manifest":
        path.unlink()
    live = len(_live(corpus))
    calls = []
    real = id_index.check_unique
    monkeypatch.setattr("maxsim_cli.shards.edit.check_unique", lambda s: calls.append(1) or real(s))
    result = _cli("delete", corpus, "--ids", "-", input="a1\nc2\n")
    assert result.exit_code == 0 and "warning" not in result.output, result.output
    assert calls == [1]
    number = read_pointer(str(corpus))
    _, doc = _manifest(corpus)
    assert (
        all(e["ids"]["path"].startswith(f"generations/{number}/") for e in doc["shards"])
        and doc["unique_ids"]
    )
    assert _cli("delete", corpus, "--ids", "-", input="b3\n").exit_code == 0
    assert calls == [1]  # the record holds now: not checked again
    assert len(_live(corpus)) == live - 3


def test_an_old_corpus_with_duplicate_ids_is_refused_as_before(tmp_path: Path) -> None:
    folder = tmp_path / "dups"
    folder.mkdir()
    rng = np.random.default_rng(6)
    write_shard(folder / "a.safetensors", ["x1", "x2", "x3"], _docs(rng, 3))
    write_shard(folder / "b.safetensors", ["y1", "x2"], _docs(rng, 2))
    write_manifest(folder)
    assert "unique_ids" not in json.loads((folder / "index.json").read_text())  # not recorded
    for args in (["inspect", folder], ["delete", folder, "--ids", "-"]):
        result = _cli(*args, input="x1\n")
        assert result.exit_code == 1 and "duplicate id 'x2'" in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("weaken", [0x3, 0x0])
def test_ids_that_share_a_hash_are_told_apart(corpus: Path, tmp_path: Path, monkeypatch, weaken: int) -> None:
    """With hashes of two bits, or one hash for every id, the indexes still find exactly the ids asked
    for, and still tell a duplicate from ids that only share a hash."""
    real = id_index.id_hashes
    monkeypatch.setattr(id_index, "id_hashes", lambda d, o: real(d, o) & np.uint32(weaken))
    folder = tmp_path / "weak"
    shutil.copytree(corpus, folder)
    for f in folder.glob("*.idindex"):
        f.unlink()
    write_manifest(folder)  # indexes of the weak hash, recorded unique
    assert "unique_ids" in json.loads((folder / "index.json").read_text())
    gone = ["a0", "a29", "b15", "c7", "missing", "a0"]
    change = delete_ids(str(folder), gone)
    assert (change.deleted, change.unknown) == (4, 1)
    assert not {"a0", "a29", "b15", "c7"} & set(_live(folder)) and len(_live(folder)) == 86
    extra = tmp_path / "extra.safetensors"
    write_shard(extra, ["a0", "q1"], _docs(np.random.default_rng(2), 2))  # a0 was deleted: it may return
    assert _cli("add", folder, extra).exit_code == 0
    write_shard(extra, ["q2", "b1"], _docs(np.random.default_rng(2), 2))
    result = _cli("add", folder, extra)
    assert result.exit_code == 1 and "'b1' (document 1) is already in the corpus" in result.output
    dup = tmp_path / "dup"
    dup.mkdir()
    write_shard(dup / "a.safetensors", ["x1", "x2", "x3"], _docs(np.random.default_rng(7), 3))
    write_shard(dup / "b.safetensors", ["y1", "x3"], _docs(np.random.default_rng(8), 2))
    write_manifest(dup)
    assert "unique_ids" not in json.loads((dup / "index.json").read_text())
    with pytest.raises(Exception, match="duplicate id 'x3'"):
        id_index.check_unique(
            [id_index.IndexedShard(str(dup / f"{n}.safetensors"), k, id_index.build_index(strings_array(ids)))
             for n, k, ids in (("a", 3, ["x1", "x2", "x3"]), ("b", 2, ["y1", "x3"]))]
        )  # fmt: skip


def test_a_delete_that_finds_nothing_lets_the_lock_go(corpus: Path) -> None:
    """It used to return with the writer lock held: the next write command of the process was refused."""
    for _ in range(2):
        change = delete_ids(str(corpus), ["nope"])
        assert change.generation is None and change.unknown == 1
    assert delete_ids(str(corpus), ["a1"]).generation == 1


def test_verify_checksums_checks_the_indexes(corpus: Path) -> None:
    (corpus / "b.safetensors.idindex").write_bytes(b"damaged")
    result = _cli("inspect", corpus, "--verify-checksums", "--no-check-values")
    assert result.exit_code == 1 and "b.safetensors.idindex: sha256" in result.output
    assert len(result.output.strip().splitlines()) == 1
    (corpus / "b.safetensors.idindex").unlink()
    result = _cli("inspect", corpus, "--verify-checksums", "--no-check-values")
    assert result.exit_code == 1 and "no such file" in result.output


def test_compact_and_the_clean_up_keep_every_index_named(corpus: Path) -> None:
    ids = "".join(f"a{i}\n" for i in range(20))
    assert _cli("delete", corpus, "--ids", "-", input=ids).exit_code == 0
    assert _cli("compact", corpus, "--threshold", "0.5").exit_code == 0
    state = read_state(str(corpus), read_pointer(str(corpus)))
    assert state.ids_unique
    named = {f for e in state.entries for f in e.files()}
    present = {str(p.relative_to(corpus)) for p in corpus.rglob("*") if p.is_file()}
    assert present - named == {"index.json", f"generations/{state.number}/manifest.json"}
    assert "a.safetensors.idindex" not in present  # the compacted shard's old index went with it
    assert len(_live(corpus)) == 70


@pytest.mark.parametrize(
    "data",
    [b"a1\n\n  b5  \nmissing\n", b"\xef\xbb\xbfa1\r\nb2\rc3", b"  \xef\xbb\xbfa1\n", b"", b"a\xc2\x85b\n",
     b"a b\n", b"x\x0by\n", b"\xff\n", b"ok\nbad\x00id\n"],
)  # fmt: skip
def test_the_ids_file_reads_as_line_by_line(tmp_path: Path, data: bytes, monkeypatch) -> None:
    """`read_id_file`'s one-pass reading gives what reading line by line gives, ids and errors alike."""
    from maxsim_cli.errors import InputError
    from maxsim_cli.shards import format as shard_format

    path = tmp_path / "ids.txt"
    path.write_bytes(data)

    def read() -> object:
        try:
            return read_id_file(str(path))
        except InputError as exc:
            return str(exc)

    fast = read()
    monkeypatch.setattr(shard_format, "_plain_ids", lambda data: None)
    assert fast == read()


def test_a_search_in_many_batches_leaves_out_exactly_the_deleted(
    corpus: Path, tmp_path: Path, monkeypatch
) -> None:
    """The engine finds each block's deleted documents among the sorted deleted ordinals
    (`Engine._left_out`): over many small batches, the run is that of a fresh pack of the live ones."""
    from maxsim_cli.scoring.engine import _Engine as Engine

    gone = [f"{x}{i}" for x in "abc" for i in range(0, 30, 4)]
    assert _cli("delete", corpus, "--ids", "-", input="\n".join(gone) + "\n").exit_code == 0
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with open_corpus(corpus) as c:
        mask = c.deleted_mask()
        keep = [n for n in range(len(c)) if not mask[n]]
        docs, ids = [], []
        for n in keep:
            s = int(np.searchsorted(c.doc_starts, n, side="right") - 1)
            batch = c.shards[s].read_docs(n - int(c.doc_starts[s]), n - int(c.doc_starts[s]) + 1)
            docs.append(batch.embeddings.numpy())
            ids.append(batch.ids[0])
    write_shard(fresh / "all.safetensors", ids, docs)
    write_shard(tmp_path / "q.safetensors", ["q0", "q1"], _docs(np.random.default_rng(9), 2))
    blocks = []
    real = Engine._left_out
    monkeypatch.setattr(
        Engine, "_left_out", lambda self, b, lo, hi: blocks.append(1) or real(self, b, lo, hi)
    )
    for folder, out in ((corpus, "changed.trec"), (fresh, "fresh.trec")):
        result = _cli("score", tmp_path / "q.safetensors", folder, "-k", 100, "--device", "cpu", "-q",
                      "--max-memory", "48KiB", "-o", tmp_path / out)  # fmt: skip
        assert result.exit_code == 0, result.output
    assert len(blocks) > 4  # many batches of the changed corpus (and of the fresh one)
    assert (tmp_path / "changed.trec").read_bytes() == (tmp_path / "fresh.trec").read_bytes()
    assert not set(gone) & {ln.split()[2] for ln in (tmp_path / "changed.trec").read_text().splitlines()}


def test_a_folder_without_shards_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for args in (["delete", tmp_path / "empty", "--ids", "-"], ["add", tmp_path / "empty", tmp_path / "x"]):
        result = _cli(*args, input="a1\n")
        assert result.exit_code == 1 and "no shards" in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1
