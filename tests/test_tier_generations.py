"""A compressed tier records the generation of the corpus it was quantized from: `--exact-from` (the
command, the API, `serve` and its reload) refuses an exact tier at another generation in one line; a
corpus with deleted documents is refused by `maxsim quantize` until it is compacted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from maxsim_cli import Queries, open_corpus, search
from maxsim_cli.cli import app
from maxsim_cli.errors import InputError
from maxsim_cli.shards import write_manifest, write_shard

DIM = 16
runner = CliRunner()


def _cli(*args: object):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture()
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A corpus folder at generation 1 (one `maxsim add`) and its int8 tier."""
    rng = np.random.default_rng(3)
    folder = tmp_path / "corpus"
    folder.mkdir()

    def docs(n: int) -> list[np.ndarray]:
        return [rng.standard_normal((int(rng.integers(1, 5)), DIM)).astype(np.float32) for _ in range(n)]

    write_shard(folder / "a.safetensors", [f"a{i}" for i in range(30)], docs(30))
    write_manifest(folder)
    write_shard(tmp_path / "b.safetensors", [f"b{i}" for i in range(10)], docs(10))
    assert _cli("add", folder, tmp_path / "b.safetensors").exit_code == 0
    tier = tmp_path / "int8"
    result = _cli("quantize", folder, "-o", tier, "-q", "--sample-queries", "0", "--device", "cpu")
    assert result.exit_code == 0, result.output
    return folder, tier


def _queries() -> Queries:
    rng = np.random.default_rng(4)
    return Queries.from_embeddings(["q0"], [rng.standard_normal((3, DIM)).astype(np.float32)])


def _delete(folder: Path, ids: str, tmp_path: Path) -> None:
    (tmp_path / "gone.txt").write_text(ids)
    assert _cli("delete", folder, "--ids", tmp_path / "gone.txt").exit_code == 0


def test_the_tier_records_its_source_generation(pair) -> None:
    folder, tier = pair
    with open_corpus(tier) as codes, open_corpus(folder) as exact:
        assert exact.generation == 1
        assert {s.info.source_generation for s in codes.shards} == {1}
        search(_queries(), codes, k=5, device="cpu", exact_from=exact, depth=10)  # a pair: accepted


def test_exact_from_refuses_another_generation(pair, tmp_path: Path) -> None:
    folder, tier = pair
    _delete(folder, "a3\n", tmp_path)
    queries = tmp_path / "q.safetensors"
    write_shard(queries, ["q0"], [np.ones((2, DIM), np.float32)])
    run = tmp_path / "run.trec"
    result = _cli("score", queries, tier, "--exact-from", folder, "-o", run, "--device", "cpu")
    assert result.exit_code == 1
    line = result.output.strip().splitlines()[-1]
    assert "generation 1" in line and "generation 2" in line and str(folder) in line and str(tier) in line
    assert "quantize" in line and not (tmp_path / "run.trec").exists()
    with open_corpus(tier) as codes, open_corpus(folder) as exact:
        with pytest.raises(InputError, match="quantized from generation 1 .* at generation 2 now"):
            search(_queries(), codes, k=5, device="cpu", exact_from=exact, depth=10)


def test_quantize_refuses_deleted_documents_until_compacted(pair, tmp_path: Path) -> None:
    folder, _ = pair
    _delete(folder, "a3\nb1\n", tmp_path)
    out = tmp_path / "again"
    result = _cli("quantize", folder, "-o", out, "-q", "--sample-queries", "0", "--device", "cpu")
    assert result.exit_code == 1 and "2 deleted documents" in result.output
    assert "maxsim compact" in result.output
    assert not out.exists()
    assert _cli("compact", folder, "--threshold", "0").exit_code == 0
    result = _cli("quantize", folder, "-o", out, "-q", "--sample-queries", "0", "--device", "cpu")
    assert result.exit_code == 0, result.output
    with open_corpus(out) as codes, open_corpus(folder) as exact:
        assert len(codes) == 38 and {s.info.source_generation for s in codes.shards} == {exact.generation}
        run = search(_queries(), codes, k=38, device="cpu", exact_from=exact, depth=38).to_dict()
        assert not {"a3", "b1"} & {docno for docno, _ in run["q0"]}


def test_a_served_pair_refuses_a_reload_to_another_generation(pair, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from maxsim_cli.service.app import create_app

    folder, tier = pair
    with open_corpus(tier) as codes, open_corpus(folder) as exact:
        with TestClient(create_app(codes.to("cpu"), exact=exact)) as client:
            _delete(folder, "a3\n", tmp_path)
            response = client.post("/reload")
            assert response.status_code == 409 and "quantize" in response.json()["detail"]
            assert "\n" not in response.json()["detail"]
            body = {"queries": [{"qid": "q", "embedding": [[1.0] * DIM]}], "k": 40}
            hits = client.post("/search", json=body).json()["results"][0]["hits"]
            assert "a3" in {h["docno"] for h in hits}  # the old pair still answers
