"""Filters at search time (`maxsim_cli.scoring.filters`): a filtered run is the unfiltered run over the
filtered corpus, byte for byte, on the streamed engine and the direct path, masked in the scan or with
few allowed documents scored as candidates; every bad filter is a one-line error."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_score import TORCH_DTYPES, invoke, make_corpus, make_queries

import maxsim_cli
from maxsim_cli import open_corpus, rerank, search
from maxsim_cli.errors import InputError
from maxsim_cli.scoring import direct, filters
from maxsim_cli.shards import write_shard

K = 7


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A corpus of three shards (dyadic values: many exact ties), its documents, and queries."""
    root = tmp_path_factory.mktemp("filters")
    paths, docs = make_corpus(root / "corpus", seed=11)
    make_queries(root / "q.safetensors", n=5, seed=12)
    return {"root": root, "paths": paths, "docs": docs, "queries": str(root / "q.safetensors")}


def _subcorpus(data, allowed: list[str], name: str) -> list[str]:
    """The allowed documents written by the shard writer as a corpus of their own (two shards)."""
    folder = data["root"] / name
    folder.mkdir(exist_ok=True)
    paths = []
    halves = [allowed[: len(allowed) // 2], allowed[len(allowed) // 2 :]]
    for i, ids in enumerate(h for h in halves if h):
        path = str(folder / f"part{i}.safetensors")
        write_shard(path, ids, [data["docs"][d].to(TORCH_DTYPES["float16"]) for d in ids], dtype="float16")
        paths.append(path)
    return paths


def _ids_file(data, name: str, ids: list[str], extra: str = "") -> str:
    path = data["root"] / name
    path.write_text("\n".join(ids) + "\n" + extra)
    return str(path)


def _score_bytes(tmp_path, *args: str) -> bytes:
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}.trec"
    result = invoke(*args, "-k", str(K), "-o", str(out), "--quiet")
    assert result.exit_code == 0, result.output
    return out.read_bytes()


def _sets(data):
    ids = sorted(data["docs"])
    rng = np.random.default_rng(5)
    include = sorted(rng.choice(ids, size=30, replace=False).tolist())
    exclude = sorted(rng.choice(ids, size=20, replace=False).tolist())
    return ids, include, exclude


@pytest.mark.parametrize("which", ["include", "exclude", "both", "few"])
def test_cli_filtered_run_is_the_run_over_the_filtered_corpus(data, tmp_path, which) -> None:
    ids, include, exclude = _sets(data)
    if which == "few":  # under SUBSET_SHARE of the corpus: scored as candidates
        include = include[:2]
    args: list[str] = []
    allowed = set(ids)
    if which in ("include", "both", "few"):
        args += ["--include-ids", _ids_file(data, f"inc-{which}", include, extra="\n\n")]
        allowed &= set(include)
    if which in ("exclude", "both"):
        args += ["--exclude-ids", _ids_file(data, f"exc-{which}", exclude)]
        allowed -= set(exclude)
    sub = _subcorpus(data, sorted(allowed), f"sub-{which}")
    filtered = _score_bytes(tmp_path, data["queries"], *data["paths"], *args)
    expected = _score_bytes(tmp_path, data["queries"], *sub)
    assert filtered == expected
    assert filtered  # something was written


def test_rerank_drops_candidates_outside_the_filter(data, tmp_path) -> None:
    ids, include, _ = _sets(data)
    rng = np.random.default_rng(9)
    cands = tmp_path / "cands.trec"
    lines = []
    for q in range(5):
        for rank, d in enumerate(rng.choice(ids, size=15, replace=False).tolist()):
            lines.append(f"q{q} Q0 {d} {rank + 1} {-rank} first")
    cands.write_text("\n".join(lines) + "\n")
    stats = tmp_path / "stats.json"
    out = tmp_path / "run.trec"
    inc = _ids_file(data, "inc-rerank", include)
    result = invoke(
        data["queries"],
        *data["paths"],
        "--candidates",
        str(cands),
        "--include-ids",
        inc,
        "-o",
        str(out),
        "--stats-json",
        str(stats),
    )
    assert result.exit_code == 0, result.output
    kept = [ln.split() for ln in lines if ln.split()[2] in set(include)]
    dropped = len(lines) - len(kept)
    import json

    assert json.loads(stats.read_text())["filtered_candidates"] == dropped
    assert "outside the filter" in result.output
    sub = _subcorpus(data, sorted(include), "sub-rerank")
    out2 = tmp_path / "run2.trec"
    assert (
        invoke(data["queries"], *sub, "--candidates", str(cands), "-o", str(out2), "--quiet").exit_code == 0
    )
    assert out.read_bytes() == out2.read_bytes()


def _api_sets(data, corpus):
    ids, include, exclude = _sets(data)
    mask = np.zeros(len(corpus), dtype=bool)
    order = {d: i for i, d in enumerate(corpus.ids)}
    mask[[order[d] for d in include]] = True
    return include, exclude, mask


@pytest.mark.parametrize("path", ["engine", "direct"])
def test_api_filters_on_both_paths(data, monkeypatch, path) -> None:
    with open_corpus(data["paths"]) as corpus:
        if path == "direct":
            corpus.to("cpu")
        else:
            monkeypatch.setattr(direct, "eligible", lambda *args: None)
        include, exclude, mask = _api_sets(data, corpus)
        allowed = sorted(set(include) - set(exclude))
        sub = _subcorpus(data, allowed, f"api-{path}")
        expected = search(data["queries"], sub, k=K, device="cpu").to_dict()
        for inc in (include, set(include), np.array(include), mask, torch.from_numpy(mask)):
            run = search(data["queries"], corpus, k=K, device="cpu", include=inc, exclude=exclude)
            assert run.to_dict() == expected
            assert run.stats.extra.get("direct") is (True if path == "direct" else None)
            assert run.stats.extra["filter"] == {"allowed": len(allowed), "path": "scan"}
        first = corpus.ids[: corpus.shards[0].num_docs]  # one shard's documents: the others not scanned
        run = search(data["queries"], corpus, k=K, device="cpu", include=first[:-1])
        want = search(data["queries"], _subcorpus(data, sorted(first[:-1]), f"first-{path}"), k=K)
        assert run.to_dict() == want.to_dict()
        few = include[:2]  # the subset path
        run = search(data["queries"], corpus, k=K, device="cpu", include=few)
        assert run.stats.extra["filter"]["path"] == "subset"
        assert run.to_dict() == search(data["queries"], _subcorpus(data, few, f"few-{path}"), k=K).to_dict()
        only_excluded = [d for d in exclude if d not in include]
        cands = {"q0": include[:4] + only_excluded[:3], "q1": only_excluded[3:5]}
        got = rerank(data["queries"], corpus, cands, include=include, exclude=exclude)
        want = rerank(data["queries"], sub, {q: [d for d in ds if d in allowed] for q, ds in cands.items()})
        assert got.to_dict() == want.to_dict()
        kept = sum(1 for ds in cands.values() for d in ds if d in allowed)
        assert got.stats.extra["filtered_candidates"] == sum(map(len, cands.values())) - kept
        assert got.stats.extra["filter"]["path"] == "candidates"


def test_empty_include_is_an_empty_run_with_a_warning(data, tmp_path) -> None:
    with open_corpus(data["paths"]) as corpus:
        with pytest.warns(maxsim_cli.MaxsimWarning, match="allows no document"):
            run = search(data["queries"], corpus, k=K, device="cpu", include=[])
        assert len(run) == 0
        with pytest.raises(InputError, match="allows no document"):
            search(data["queries"], corpus, k=K, device="cpu", include=[], strict=True)
    empty = _ids_file(data, "empty", [])
    out = tmp_path / "run.trec"
    result = invoke(data["queries"], *data["paths"], "--include-ids", empty, "-o", str(out), "--quiet")
    assert result.exit_code == 0 and "allows no document" in result.output
    assert out.read_bytes() == b""


def test_unknown_ids_warn_with_a_count_and_strict_refuses(data, tmp_path) -> None:
    ids, include, _ = _sets(data)
    inc = _ids_file(data, "unknown", [*include, "nope1", "nope2"])
    out = tmp_path / "run.trec"
    result = invoke(data["queries"], *data["paths"], "--include-ids", inc, "-o", str(out), "--quiet")
    assert result.exit_code == 0
    assert "2 ids are not in the corpus, e.g. 'nope1', 'nope2'" in result.output
    out2 = tmp_path / "run2.trec"
    result = invoke(data["queries"], *data["paths"], "--include-ids", inc, "--strict", "-o", str(out2))
    assert result.exit_code == 1 and not out2.exists()
    assert len(result.output.strip().splitlines()) == 1 and "--strict" in result.output


def test_ids_from_stdin(data, tmp_path) -> None:
    _, include, _ = _sets(data)
    from_file = _score_bytes(
        tmp_path, data["queries"], *data["paths"], "--include-ids", _ids_file(data, "stdin-cmp", include)
    )
    out = tmp_path / "stdin.trec"
    result = invoke(
        data["queries"],
        *data["paths"],
        "--include-ids",
        "-",
        "-k",
        str(K),
        "-o",
        str(out),
        "--quiet",
        input="\n".join(include) + "\n",
    )
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == from_file


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--include-ids", "{ws}"], 1, "line 2"),
        (["--include-ids", "{missing}"], 1, "no such file"),
        (["--include-ids", "-", "--exclude-ids", "-"], 2, "stdin"),
        (["--include-ids", "-", "--devices", "cpu:2"], 2, "standard input cannot be shared"),
        (["--where", "open('x')"], 2, "the function open"),
        (["--where", "lang =="], 2, "not an expression"),
        (["--where", 'lang == "en"'], 1, "safetensors shard has none"),
    ],
)
def test_bad_filter_inputs_are_one_line_errors(data, tmp_path, args, code, words) -> None:
    files = {
        "ws": _ids_file(data, "ws", ["doc001", "doc 002"]),
        "missing": str(tmp_path / "nothing.txt"),
        "ok": _ids_file(data, "ok", ["doc001"]),
    }
    args = [a.format(**files) for a in args]
    out = tmp_path / "run.trec"
    result = invoke(data["queries"], *data["paths"], *args, "-o", str(out))
    assert result.exit_code == code, result.output
    assert len(result.output.strip().splitlines()) == 1 and words in result.output
    assert not out.exists()


def test_bad_masks_are_one_line_input_errors(data) -> None:
    with open_corpus(data["paths"]) as corpus:
        n = len(corpus)
        for bad, words in [
            (np.zeros(n - 1, dtype=bool), "shape"),
            (np.zeros(n, dtype=np.int64), "int64"),
            (torch.zeros(n, dtype=torch.float32), "float32"),
            (["doc 1"], "whitespace"),
        ]:
            with pytest.raises(InputError, match=words) as info:
                search(data["queries"], corpus, k=K, device="cpu", include=bad)
            assert "\n" not in str(info.value)


def test_the_subset_share_picks_the_path() -> None:
    mask = np.ones(100, dtype=bool)
    mask[:4] = False
    assert filters.use_subset(mask)
    mask[:5] = False
    assert not filters.use_subset(mask)


def test_batches_without_an_allowed_document_are_not_read(data, tmp_path) -> None:
    with open_corpus(data["paths"][:1]) as first:
        only_first = first.ids
    inc = _ids_file(data, "first-shard", only_first)
    stats = {}
    for name, extra in (("all", []), ("filtered", ["--include-ids", inc])):
        path = tmp_path / f"{name}.json"
        result = invoke(
            data["queries"],
            *data["paths"],
            *extra,
            "--batch-queries",
            "2",
            "-k",
            str(K),
            "-o",
            str(tmp_path / f"{name}.trec"),
            "--quiet",
            "--stats-json",
            str(path),
        )
        assert result.exit_code == 0, result.output
        import json

        stats[name] = json.loads(path.read_text())
    assert stats["filtered"]["documents"] == len(only_first) < stats["all"]["documents"]
    assert stats["filtered"]["bytes_read"] < stats["all"]["bytes_read"]
    sub = _subcorpus(data, sorted(only_first), "sub-first")
    assert (tmp_path / "filtered.trec").read_bytes() == _score_bytes(tmp_path, data["queries"], *sub)


@pytest.mark.parametrize("path", ["engine", "direct"])
def test_a_deleted_document_never_comes_back_through_a_filter(tmp_path, monkeypatch, path) -> None:
    """Deletions and filters are one mask: an include naming a deleted document (by id, or by a mask
    over the corpus's ordinals), on the scan and on the subset path, never returns it."""
    from typer.testing import CliRunner

    from maxsim_cli.cli import app
    from maxsim_cli.shards import write_manifest

    rng = np.random.default_rng(8)
    folder = tmp_path / "corpus"
    folder.mkdir()
    ids = [f"d{i}" for i in range(40)]
    write_shard(folder / "a.safetensors", ids, [rng.standard_normal((3, 16)).astype(np.float32) for _ in ids])
    write_manifest(folder)
    (tmp_path / "gone.txt").write_text("d3\nd4\n")
    deleted = CliRunner().invoke(app, ["delete", str(folder), "--ids", str(tmp_path / "gone.txt")])
    assert deleted.exit_code == 0
    queries = maxsim_cli.Queries.from_embeddings(["q"], [rng.standard_normal((2, 16)).astype(np.float32)])
    with open_corpus(folder) as corpus:
        if path == "direct":
            corpus.to("cpu")
        else:
            monkeypatch.setattr(direct, "eligible", lambda *args: None)
        few = np.zeros(len(corpus), dtype=bool)
        few[[2, 3, 4]] = True  # the subset path: d3 and d4 are deleted
        many = np.ones(len(corpus), dtype=bool)  # the scan
        for include in (few, many, ["d2", "d3", "d4"]):
            with pytest.warns(maxsim_cli.MaxsimWarning) if isinstance(include, list) else _no_warning():
                run = search(queries, corpus, k=40, device="cpu", include=include).to_dict()
            assert run["q"] and not {"d3", "d4"} & {docno for docno, _ in run["q"]}
        run = search(queries, corpus, k=40, device="cpu", include=few)
        assert run.stats.extra["filter"] == {"allowed": 1, "path": "subset"}


def _no_warning():
    import contextlib

    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------------
# several devices: each rank (device) scores its shards with its part of the mask

JOB_ENV = {"MAXSIM_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}


def _first_shard_ids(data) -> list[str]:
    with open_corpus(data["paths"][:1]) as first:
        return list(first.ids)


@pytest.mark.parametrize("mode", ["search", "rerank"])
def test_devices_cpu2_filtered_run_is_the_run_over_the_filtered_corpus(data, tmp_path, mode) -> None:
    """``--devices cpu:2`` (two worker processes, each a share of the shards): the filtered run is the
    unfiltered run over the filtered corpus, byte for byte; a rerank's is the single process's."""
    import json

    from typer.testing import CliRunner

    from maxsim_cli.cli import app

    ids, include, exclude = _sets(data)
    args = ["--include-ids", _ids_file(data, f"inc-dev-{mode}", include)]
    args += ["--exclude-ids", _ids_file(data, f"exc-dev-{mode}", exclude)]
    if mode == "rerank":
        cands = tmp_path / "cands.trec"
        rng = np.random.default_rng(3)
        lines = [
            f"q{q} Q0 {d} {r + 1} {-r} first"
            for q in range(5)
            for r, d in enumerate(rng.choice(ids, size=20, replace=False).tolist())
        ]
        cands.write_text("\n".join(lines) + "\n")
        args += ["--candidates", str(cands)]
        expected = _score_bytes(tmp_path, data["queries"], *data["paths"], *args)
    else:
        sub = _subcorpus(data, sorted(set(include) - set(exclude)), "sub-devices")
        expected = _score_bytes(tmp_path, data["queries"], *sub)
    out, stats = tmp_path / "dist.trec", tmp_path / "dist.json"
    result = CliRunner().invoke(
        app,
        ["score", data["queries"], *data["paths"], *args, "-k", str(K), "-o", str(out), "--quiet"]
        + ["--devices", "cpu:2", "--stats-json", str(stats)],
        env=JOB_ENV,
    )
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == expected and expected
    report = json.loads(stats.read_text())
    assert report["world_size"] == 2
    if mode == "search":
        assert report["filter"]["allowed"] == len(set(include) - set(exclude))
    else:
        assert report["filtered_candidates"] > 0


def test_torchrun_filtered_run_is_the_single_process_run(data, tmp_path) -> None:
    """Under torchrun each rank builds the job's mask (the same on every rank) and scores its shards with
    its part: rank 0 writes the single process's run, and warns once of ids not in the corpus."""
    import subprocess
    import sys

    ids, include, exclude = _sets(data)
    args = ["--include-ids", _ids_file(data, "inc-torchrun", include, extra="nowhere\n")]
    args += ["--exclude-ids", _ids_file(data, "exc-torchrun", exclude)]
    single = _score_bytes(tmp_path, data["queries"], *data["paths"], *args)
    out = tmp_path / "torchrun.trec"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "maxsim_cli", "score", data["queries"], *data["paths"], *args, "--device", "cpu"]
    cmd += ["-k", str(K), "-o", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, **JOB_ENV), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == single
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "1 ids are not in the corpus" in warnings[0], proc.stderr


def test_rank_threads_with_a_filter_of_one_rank_s_shards(data, tmp_path, monkeypatch) -> None:
    """Rank threads (``--devices`` with GPUs; here two CPU "devices") with a filter that allows only the
    first shard's documents: one rank has nothing allowed, and the run is still the filtered corpus's."""
    from maxsim_cli.scoring import dispatch
    from maxsim_cli.scoring.entry import score

    first = _first_shard_ids(data)
    sub = _subcorpus(data, sorted(first[:12]), "sub-threads")
    expected = _score_bytes(tmp_path, data["queries"], *sub)
    monkeypatch.setattr(dispatch, "in_threads", lambda devices: True)
    out = tmp_path / "threads.trec"
    inc = _ids_file(data, "inc-threads", first[:12])
    stats = score(data["queries"], data["paths"], output=str(out), top_k=K, devices="cpu:2", include_ids=inc)
    assert out.read_bytes() == expected
    assert stats.extra["workers"] == "threads" and stats.extra["filter"]["allowed"] == 12
    assert sorted(r["filter"]["allowed"] for r in stats.extra["ranks"] if "filter" in r)[0] == 0


def test_a_corpus_resident_on_two_devices_takes_a_filter(data) -> None:
    """A corpus resident on several devices (`Corpus.to` with a list) scores each device's shards with
    their part of the mask: the run of one device."""
    ids, include, exclude = _sets(data)
    with open_corpus(data["paths"]) as corpus:
        expected = search(data["queries"], corpus, k=K, device="cpu", include=include, exclude=exclude)
        corpus.to(["cpu", "cpu"])
        run = search(data["queries"], corpus, k=K, include=include, exclude=exclude)
        assert run.stats.extra["workers"] == "resident devices"
        assert run.to_dict() == expected.to_dict()
        assert run.stats.extra["filter"]["allowed"] == len(set(include) - set(exclude))


# --------------------------------------------------------------------------------------------------
# two stages: the filter applies to the compressed scan

SAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sample_data")
SAMPLE_QUERIES = os.path.join(SAMPLE, "queries.safetensors")
SAMPLE_CORPUS = os.path.join(SAMPLE, "corpus")


def _sample_subcorpus(folder, allowed: list[str]) -> str:
    """sample_data's allowed documents as a corpus of their own (one shard, the values as stored)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "sub.safetensors")
    with open_corpus([SAMPLE_CORPUS]) as corpus:
        where = corpus.candidate_index(allowed)
        docs = []
        for docno in allowed:
            s, d = where[docno]
            batch = corpus.shards[s].read_docs(d, d + 1)
            docs.append(batch.embeddings)
        write_shard(path, allowed, docs, dtype="float16", normalized=True, encoder=corpus.encoder)
    return path


@pytest.mark.parametrize("bits", [4, 2])
def test_two_stage_filtered_run_is_the_exact_run_over_the_filtered_corpus(tiers, tmp_path, bits) -> None:
    """``--exact-from`` with a filter: the compressed scan keeps only allowed documents, so at a depth
    that covers them the run is the exact run of the filtered corpus, byte for byte (and the scan's
    candidates are all allowed at any depth)."""
    import json

    with open_corpus([SAMPLE_CORPUS]) as corpus:
        all_ids = list(corpus.ids)
    rng = np.random.default_rng(bits)
    include = sorted(rng.choice(all_ids, size=60, replace=False).tolist())
    exclude = include[::7]
    allowed = sorted(set(include) - set(exclude))
    inc, exc = tmp_path / "inc.txt", tmp_path / "exc.txt"
    inc.write_text("\n".join(include) + "\n")
    exc.write_text("\n".join(exclude) + "\n")
    sub = _sample_subcorpus(tmp_path / "sub", allowed)
    expected = _score_bytes(tmp_path, SAMPLE_QUERIES, sub, "--device", "cpu")
    filters_args = ["--include-ids", str(inc), "--exclude-ids", str(exc)]
    tier = [tiers[bits], "--exact-from", SAMPLE_CORPUS, *filters_args, "--device", "cpu"]
    got = _score_bytes(tmp_path, SAMPLE_QUERIES, *tier, "--depth", str(len(allowed)))
    assert got == expected
    stats = tmp_path / "stats.json"
    shallow = _score_bytes(tmp_path, SAMPLE_QUERIES, *tier, "--depth", str(K), "--stats-json", str(stats))
    rows = [line.split() for line in shallow.decode().splitlines()]
    assert rows and {row[2] for row in rows} <= set(allowed)
    assert all(sum(1 for r in rows if r[0] == q) == K for q in {r[0] for r in rows})
    report = json.loads(stats.read_text())
    assert report["filter"]["allowed"] == len(allowed) and report["scores"] == "exact"


def test_two_stage_api_filter_and_a_mask(tiers) -> None:
    """``search(..., exact_from=, include=)``: ids or a mask over the documents (both tiers hold them in
    one order), the exact top-k among the allowed documents."""
    with open_corpus([SAMPLE_CORPUS]) as exact:
        mask = np.zeros(len(exact), dtype=bool)
        mask[::5] = True
        allowed = [docno for docno, keep in zip(exact.ids, mask, strict=True) if keep]
        want = search(SAMPLE_QUERIES, exact, k=5, device="cpu", include=allowed).to_dict()
        got = search(
            SAMPLE_QUERIES, tiers[4], k=5, device="cpu", exact_from=exact, depth=len(allowed), include=mask
        )
        assert got.to_dict() == want
        assert got.stats.extra["filter"]["allowed"] == len(allowed)
