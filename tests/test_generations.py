"""A corpus that changes: `maxsim add`, `delete`, `compact` (generations), readers that honour them, and
the exactness of a changed corpus against a freshly packed one and a float64 reference."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from maxsim_cli import open_corpus, rerank, search
from maxsim_cli.cli import app
from maxsim_cli.shards import write_manifest, write_shard
from maxsim_cli.shards.generations import WriterLock

runner = CliRunner()
DIM = 16


def _docs(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [rng.standard_normal((int(rng.integers(2, 7)), DIM)).astype(np.float32) for _ in range(n)]


def _shard(path: Path, ids: list[str], rng: np.random.Generator, **kw) -> Path:
    write_shard(path, ids, _docs(rng, len(ids)), **kw)
    return path


def _cli(*args: str, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input)


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    rng = np.random.default_rng(1)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in "ab":
        _shard(folder / f"{name}.safetensors", [f"{name}{i}" for i in range(20)], rng)
    write_manifest(folder)
    return folder


def _live(folder: Path) -> list[str]:
    with open_corpus(folder) as c:
        mask = c.deleted_mask()
        return sorted(i for n, i in enumerate(c.ids) if mask is None or not mask[n])


def test_generation_zero_converts_on_the_first_write(corpus: Path, tmp_path: Path) -> None:
    with open_corpus(corpus) as c:
        assert (c.generation, c.num_deleted, c.deleted_mask()) == (0, 0, None)
    extra = _shard(tmp_path / "c.safetensors", ["c0", "c1"], np.random.default_rng(2))
    result = _cli("add", corpus, extra)
    assert result.exit_code == 0, result.output
    assert "generation 1" in result.output
    pointer = json.loads((corpus / "index.json").read_text())
    assert pointer["format_version"] == 2 and pointer["generation"] == 1
    assert pointer["manifest"] == "generations/1/manifest.json"
    assert extra.exists()  # the input stays
    assert len(_live(corpus)) == 42
    assert sorted(os.listdir(corpus / "generations")) == ["1"]  # generation 0's description cleaned up


def test_delete_honoured_by_search_rerank_counts_and_inspect(corpus: Path, tmp_path: Path) -> None:
    (tmp_path / "ids.txt").write_text("a3\n\n  b5  \nmissing-id\n")
    result = _cli("delete", corpus, "--ids", tmp_path / "ids.txt")
    assert result.exit_code == 0, result.output
    assert "1 of 3 ids are not in the corpus" in result.output and "'missing-id'" in result.output
    with open_corpus(corpus) as c:
        assert (c.generation, c.num_deleted, c.num_live, len(c)) == (1, 2, 38, 40)
        mask = c.deleted_mask()
        assert mask is not None and not {"a3", "b5"} & set(c.ids)  # a deleted row's id is one no docno has
        assert mask.sum() == 2 and mask[3] and mask[25]
        queries = (["q0", "q1"], [torch.randn(3, DIM), torch.randn(2, DIM)])
        run = search(queries, c, k=100, device="cpu")
        docnos = {r.docno for r in run}
        assert len(docnos) == 38 and not docnos & {"a3", "b5"}
        with pytest.warns(UserWarning, match="not in the corpus"):
            reranked = rerank(queries, c, {"q0": ["a3", "a4"], "q1": ["b5"]}, device="cpu")
        assert [r.docno for r in reranked] == ["a4"]
    report = json.loads(_cli("inspect", corpus, "--json", "--no-check-values").stdout)
    assert (report["generation"], report["deleted_docs"], report["num_docs"]) == (1, 2, 38)


def test_delete_strict_stdin_and_bad_inputs(corpus: Path, tmp_path: Path) -> None:
    before = sorted(os.listdir(corpus))
    result = _cli("delete", corpus, "--ids", "-", "--strict", input="a1\nnope\n")
    assert result.exit_code == 1 and "nothing was deleted" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert sorted(set(os.listdir(corpus)) - {"generations"}) == before  # an empty generations/ at most
    assert os.listdir(corpus / "generations") == []
    assert _cli("delete", corpus, "--ids", "-", input="a1\n").exit_code == 0
    assert "a1" not in _live(corpus)
    for args, words in [
        (["--ids", tmp_path / "absent.txt"], "cannot read it"),
        (["--ids", tmp_path], "cannot read it"),
    ]:
        result = _cli("delete", corpus, *args)
        assert result.exit_code == 1 and words in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    (tmp_path / "bad.txt").write_bytes(b"a2\n\xff\xfe\n")
    result = _cli("delete", corpus, "--ids", tmp_path / "bad.txt")
    assert result.exit_code == 1 and "line 2 is not valid UTF-8" in result.output
    everything = "\n".join(i for i in _live(corpus)) + "\n"
    result = _cli("delete", corpus, "--ids", "-", input=everything)
    assert result.exit_code == 1 and "would delete every document" in result.output
    result = _cli("delete", tmp_path / "nowhere", "--ids", "-", input="a1\n")
    assert result.exit_code == 1 and "no such folder" in result.output


def test_add_checks_everything_first(corpus: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    bad = tmp_path / "bad"
    bad.mkdir()
    cases = [
        (_shard(bad / "dup.safetensors", ["z0", "a1"], rng), "'a1' (document 1) is already in the corpus"),
        (_shard(bad / "f16.safetensors", ["z1"], rng, dtype="float16"), "dtype=float16 but the corpus"),
        (_shard(bad / "enc.safetensors", ["z2"], rng, encoder="other"), None),
        (corpus / "a.safetensors", "lies inside the corpus folder"),
        (bad / "absent.safetensors", "no such file"),
    ]
    write_shard(bad / "dim.safetensors", ["z3"], [np.ones((2, 8), np.float32)])
    cases.append((bad / "dim.safetensors", "dim=8 but the corpus"))
    for source, words in cases:
        result = _cli("add", corpus, source)
        if words is None:  # the corpus records no encoder: shards of any encoder may join
            assert result.exit_code == 0, result.output
            continue
        assert result.exit_code == 1 and words in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    encoded = tmp_path / "encoded"
    encoded.mkdir()
    _shard(encoded / "x.safetensors", ["x0"], rng, encoder="m1")
    write_manifest(encoded)
    _shard(tmp_path / "y.safetensors", ["y0"], rng, encoder="m2")
    assert _cli("add", encoded, tmp_path / "y.safetensors").exit_code == 1


def test_replace_is_delete_and_add_in_one_commit(corpus: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    new = _shard(tmp_path / "new.safetensors", ["a1", "n1"], rng)
    result = _cli("add", corpus, new, "--replace")
    assert result.exit_code == 0 and "(1 replaced)" in result.output, result.output
    with open_corpus(corpus) as c:
        assert (c.generation, c.num_live, c.num_deleted) == (1, 41, 1)
        batch = c.shards[-1].read_docs(0, 1)
        assert batch.ids == ["a1"]
        run = search((["q"], [torch.randn(2, DIM)]), c, k=1000, device="cpu")
        assert sorted(r.docno for r in run).count("a1") == 1


def test_one_writer_at_a_time(corpus: Path, tmp_path: Path) -> None:
    with WriterLock(str(corpus)):
        result = _cli("delete", corpus, "--ids", "-", input="a1\n")
    assert result.exit_code == 1
    assert "another maxsim add/delete/compact is changing this corpus" in result.output
    assert _cli("delete", corpus, "--ids", "-", input="a1\n").exit_code == 0


def test_compact_and_readers_that_hold_an_old_generation(corpus: Path, tmp_path: Path) -> None:
    ids = "\n".join(f"a{i}" for i in range(10)) + "\nb0\n"
    assert _cli("delete", corpus, "--ids", "-", input=ids).exit_code == 0
    assert _cli("compact", corpus, "--threshold", "1.5").exit_code == 2
    reader = open_corpus(corpus)  # holds generation 1 (the gen-0 shards a and b)
    result = _cli("compact", corpus, "--threshold", "0.3")  # a: half deleted; b: 5%
    assert result.exit_code == 0 and "compacted 1 shards" in result.output, result.output
    assert (corpus / "a.safetensors").exists()  # the reader holds it
    assert len(search((["q"], [torch.randn(2, DIM)]), reader, k=100, device="cpu")) == 29
    reader.close()
    assert _cli("compact", corpus).exit_code == 0  # nothing to rewrite; old generations cleaned up
    assert not (corpus / "a.safetensors").exists()
    assert (corpus / "b.safetensors").exists()
    with open_corpus(corpus) as c:
        assert (c.generation, c.num_live, c.num_deleted) == (2, 29, 1)
    assert sorted(os.listdir(corpus / "generations")) == ["1", "2"]
    assert os.listdir(corpus / "generations" / "1") == ["00001.deleted.npy"]  # b's deletions, still named
    assert _cli("compact", corpus, "--threshold", "0").exit_code == 0
    with open_corpus(corpus) as c:
        assert (c.generation, c.num_live, c.num_deleted) == (3, 29, 0)


def test_refresh_opens_the_latest_generation(corpus: Path) -> None:
    c = open_corpus(corpus)
    assert c.refresh() is False
    assert _cli("delete", corpus, "--ids", "-", input="a1\nb1\n").exit_code == 0
    assert c.refresh() is True
    assert (c.generation, c.num_live) == (1, 38)
    c.close()


def test_a_generation_held_open_is_opened_by_number_after_newer_commits(corpus: Path, tmp_path: Path) -> None:
    """What the ranks of one job open (`committed_generations`, `open_corpus(generations=...)`): the
    generation found when the job looked, as long as it is held, whatever was committed since - generation
    0 too, once its folder is converted - and a generation no longer there is one line."""
    from maxsim_cli.errors import InputError
    from maxsim_cli.shards import open_corpus as open_listed
    from maxsim_cli.shards.generations import committed_generations

    shard = str(corpus / "a.safetensors")
    numbers, held = committed_generations([str(corpus), shard, str(tmp_path / "nothing")])
    assert numbers == [0, None, None]
    assert _cli("delete", corpus, "--ids", "-", input="a1\nb1\n").exit_code == 0  # converts: generation 1
    with open_listed([corpus], generations=[0]) as c:
        assert (c.generation, c.num_live, c.num_deleted) == (0, 40, 0)
    for lock in held:
        lock.release()
    numbers, held = committed_generations([str(corpus)])
    assert numbers == [1]
    assert _cli("delete", corpus, "--ids", "-", input="b2\n").exit_code == 0
    assert _cli("compact", corpus, "--threshold", "0").exit_code == 0  # a and b rewritten: generation 3
    assert (corpus / "a.safetensors").exists()  # generation 1 is held
    with open_listed([corpus], generations=numbers) as c, open_listed([corpus]) as now:
        assert (c.generation, c.num_live, c.num_deleted) == (1, 38, 2)
        assert c.num_docs == 40  # the shards as packed
        assert (now.generation, now.num_live, now.num_deleted) == (3, 37, 0)
    for lock in held:
        lock.release()
    assert _cli("compact", corpus).exit_code == 0  # generation 1 released: its files go
    with pytest.raises(InputError, match="generation 1, which this job opened, is no longer there"):
        open_listed([corpus], generations=[1])


def test_latest_compares_each_folder_with_the_generation_opened_of_it(corpus: Path, tmp_path: Path) -> None:
    """A corpus of two folders at different generations is the latest while neither changes; a commit to
    either makes `latest` open the new one; `reopen` opens the generations open, whatever came since."""
    other = tmp_path / "other"
    other.mkdir()
    _shard(other / "c.safetensors", [f"c{i}" for i in range(5)], np.random.default_rng(3))
    assert _cli("delete", corpus, "--ids", "-", input="a1\n").exit_code == 0  # corpus at 1, other at 0
    c = open_corpus([corpus, other])
    assert c.latest() is None and c.refresh() is False
    assert _cli("delete", other, "--ids", "-", input="c1\n").exit_code == 0
    assert c.refresh() is True
    assert (c.num_live, c.latest()) == (43, None)
    assert _cli("delete", corpus, "--ids", "-", input="a2\n").exit_code == 0
    with c.reopen() as again:  # the generations open, not the latest
        assert (again.generation, again.num_live) == (c.generation, 43)
    c.close()


def test_damaged_generation_files_are_one_line_errors(corpus: Path) -> None:
    assert _cli("delete", corpus, "--ids", "-", input="a1\n").exit_code == 0
    deleted = next((corpus / "generations" / "1").glob("*.npy"))
    deleted.write_bytes(deleted.read_bytes()[:-8])
    result = _cli("score", corpus / "a.safetensors", corpus, "-k", "3", "--device", "cpu", "-o", "-")
    assert result.exit_code == 1 and "does not match" in result.output
    assert len(result.output.strip().splitlines()) == 1
    pointer = {"format": "maxsim-corpus", "format_version": 2, "generation": 7}
    (corpus / "index.json").write_text(json.dumps({**pointer, "manifest": "generations/7/manifest.json"}))
    result = _cli("inspect", corpus)
    assert result.exit_code == 1 and "manifest is missing" in result.output


# --------------------------------------------------------------------------------------------------
# exactness: a seeded random sequence of changes against a fresh pack and a float64 reference


def _reference_ranking(queries: list[np.ndarray], docs: dict[str, np.ndarray], k: int) -> list[list[str]]:
    out = []
    for q in queries:
        q64 = q.astype(np.float64)
        scored = [(float((q64 @ d.astype(np.float64).T).max(axis=1).sum()), i) for i, d in docs.items()]
        scored.sort(key=lambda t: -t[0])  # random vectors: no two scores tie
        out.append([i for _, i in scored[:k]])
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_changed_corpus_scores_as_a_fresh_pack_of_its_documents(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    folder = tmp_path / "corpus"
    folder.mkdir()
    truth: dict[str, np.ndarray] = {}
    counter = 0

    def new_shard(n: int, reuse: list[str] | None = None) -> Path:
        nonlocal counter
        counter += 1
        ids = (reuse or []) + [f"d{counter}-{i}" for i in range(n)]
        docs = _docs(rng, len(ids))
        path = tmp_path / f"in-{counter}.safetensors"
        write_shard(path, ids, docs)
        truth.update(zip(ids, docs, strict=True))
        return path

    shutil.copy(new_shard(15), folder / "first.safetensors")
    for _ in range(8):
        step = rng.choice(["add", "delete", "replace", "compact"])
        if step == "add":
            assert _cli("add", folder, new_shard(int(rng.integers(1, 10)))).exit_code == 0
        elif step == "replace":
            reuse = list(rng.choice(sorted(truth), size=min(2, len(truth) - 1), replace=False))
            assert _cli("add", folder, new_shard(2, reuse), "--replace").exit_code == 0
        elif step == "delete" and len(truth) > 3:
            gone = list(rng.choice(sorted(truth), size=int(rng.integers(1, len(truth) // 2)), replace=False))
            assert _cli("delete", folder, "--ids", "-", input="\n".join(gone) + "\n").exit_code == 0
            for i in gone:
                truth.pop(i)
        else:
            assert _cli("compact", folder, "--threshold", str(rng.choice([0.0, 0.2, 0.5]))).exit_code == 0
    assert _live(folder) == sorted(truth)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    names = sorted(truth)
    write_shard(fresh / "all.safetensors", names, [truth[i] for i in names])
    queries = _docs(rng, 3)
    write_shard(tmp_path / "q.safetensors", ["q0", "q1", "q2"], queries)
    k = len(truth) + 5
    for corpus, out in ((folder, "changed.trec"), (fresh, "fresh.trec")):
        result = _cli("score", tmp_path / "q.safetensors", corpus, "-k", k, "--device", "cpu", "-q", "-o",
                      tmp_path / out)  # fmt: skip
        assert result.exit_code == 0, result.output
    assert (tmp_path / "changed.trec").read_bytes() == (tmp_path / "fresh.trec").read_bytes()
    lines = (tmp_path / "changed.trec").read_text().splitlines()
    got = [[ln.split()[2] for ln in lines if ln.startswith(f"{q} ")] for q in ("q0", "q1", "q2")]
    assert got == _reference_ranking(queries, truth, k)


def test_order_keys_leave_out_rank_minus_one_on_both_paths() -> None:
    """A deleted document (rank -1) gets the smallest key from the torch arithmetic and from the CUDA
    launch (run here under Triton's interpreter), and `RunningTopK` drops it."""
    from maxsim_kernels.order_keys import order_keys_triton

    from maxsim_cli.scoring.topk import LEFT_OUT, RunningTopK, order_keys

    scores, ranks = torch.randn(3, 5), torch.tensor([4, -1, 2, 0, -1])
    keys = order_keys(scores.clone(), ranks)
    assert torch.equal(keys, order_keys_triton(scores.clone(), ranks))
    # the columns given (the engine finds a block's deleted documents without scanning its ranks)
    assert torch.equal(keys, order_keys(scores.clone(), ranks, torch.tensor([1, 4])))
    assert torch.equal(
        order_keys(scores.clone(), ranks.abs()),
        order_keys(scores.clone(), ranks.abs(), torch.tensor([], dtype=torch.int64)),
    )
    # ranks per score ([nq, nd]) leave out theirs too
    assert torch.equal(keys, order_keys(scores.clone(), ranks.expand(3, 5).contiguous()))
    assert (keys[:, [1, 4]] == LEFT_OUT).all() and (keys[:, [0, 2, 3]] != LEFT_OUT).all()
    topk = RunningTopK(3, 5)
    topk.add(scores.clone(), ranks)
    best, best_ranks = topk.result()
    assert best.shape == (3, 3) and set(best_ranks.flatten().tolist()) == {0, 2, 4}
