"""`maxsim serve` follows its corpus: ``POST /reload`` (and ``--watch``) serve a new generation made by
`maxsim delete`, swapped in beside the old one; requests during a reload answer from the old or the
new generation; a generation that does not fit is refused and the old one answers; the token guards
/reload; the generation replaced lets its reader lock go after its last request."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient  # noqa: E402
from test_serve import TOKEN, Server, assert_one_line_error  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from maxsim_cli import open_corpus  # noqa: E402
from maxsim_cli.cli import app as cli_app  # noqa: E402
from maxsim_cli.service.app import create_app  # noqa: E402
from maxsim_cli.service.metrics import available as metrics_available  # noqa: E402
from maxsim_cli.shards import write_manifest, write_shard  # noqa: E402

DIM = 16
DOCS = 40
runner = CliRunner()


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    rng = np.random.default_rng(5)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in "ab":
        sizes = rng.integers(1, 5, DOCS // 2)
        docs = [rng.standard_normal((int(n), DIM)).astype(np.float32) for n in sizes]
        write_shard(folder / f"{name}.safetensors", [f"{name}{i}" for i in range(DOCS // 2)], docs)
    write_manifest(folder)
    return folder


def _body(k: int = DOCS) -> dict:
    rng = np.random.default_rng(9)
    queries = [{"qid": f"q{i}", "embedding": rng.standard_normal((3, DIM)).tolist()} for i in range(2)]
    return {"queries": queries, "k": k}


def _docnos(answer: dict) -> set[str]:
    return {hit["docno"] for result in answer["results"] for hit in result["hits"]}


def _delete(folder: Path, ids: list[str], tmp_path: Path) -> None:
    (tmp_path / "gone.txt").write_text("\n".join(ids) + "\n")
    result = runner.invoke(cli_app, ["delete", str(folder), "--ids", str(tmp_path / "gone.txt")])
    assert result.exit_code == 0, result.output


GONE = ["a1", "a7", "b3", "b19"]


def test_reload_serves_the_new_generation_and_lets_the_old_one_go(folder: Path, tmp_path: Path) -> None:
    corpus = open_corpus(folder)
    corpus.to("cpu")
    with TestClient(create_app(corpus, batch_window_ms=0, owned=True)) as client:
        before = client.post("/search", json=_body()).json()
        assert set(GONE) <= _docnos(before)
        assert client.post("/reload").json() == {"generation": 0, "previous": 0, "changed": False}
        _delete(folder, GONE, tmp_path)
        assert client.get("/health").json()["generation"] == 0  # not until asked
        assert client.post("/reload").json() == {"generation": 1, "previous": 0, "changed": True}
        after = client.post("/search", json=_body()).json()
        assert _docnos(after) == _docnos(before) - set(GONE)
        rerank = {"queries": _body()["queries"], "candidates": {"q0": ["a1", "a2"], "q1": ["b3"]}}
        answer = client.post("/rerank", json=rerank).json()
        assert [r["missing"] for r in answer["results"]] == [["a1"], ["b3"]]
        health = client.get("/health").json()
        assert (health["generation"], health["documents"], health["deleted"]) == (1, DOCS - 4, 4)
        if metrics_available():  # the corpus gauges follow the swap
            assert f"maxsim_corpus_documents {float(DOCS - 4)}" in client.get("/metrics").text
        assert all(lock.fd is None for lock in corpus._locks)  # the old generation's reader lock is gone
        assert client.post("/reload").json()["changed"] is False


def test_a_reload_that_does_not_fit_is_refused_and_the_old_generation_answers(
    folder: Path, tmp_path: Path, monkeypatch, caplog
) -> None:
    from maxsim_cli.shards import resident

    # the server's logger may not propagate (a served app's log configuration): listen to it directly
    served_log = logging.getLogger("maxsim.serve")
    served_log.addHandler(caplog.handler)
    monkeypatch.setattr(served_log, "level", logging.INFO)
    with open_corpus(folder) as corpus, TestClient(create_app(corpus.to("cpu"), batch_window_ms=0)) as client:
        _delete(folder, GONE, tmp_path)
        monkeypatch.setattr(resident, "available_bytes", lambda device: 1000)
        response = client.post("/reload")
        assert_one_line_error(response, 507, "needs")
        detail = response.json()["detail"]
        assert "beside generation 0" in detail and "kept generation 0" in detail
        assert any("kept generation 0" in r.getMessage() for r in caplog.records)
        assert set(GONE) <= _docnos(client.post("/search", json=_body()).json())
        assert client.get("/health").json()["generation"] == 0
        monkeypatch.undo()
        served_log.removeHandler(caplog.handler)
        assert client.post("/reload").json()["changed"] is True


def test_reload_needs_the_token_and_a_corpus_folder(folder: Path) -> None:
    with open_corpus(folder) as corpus, TestClient(create_app(corpus, token=TOKEN)) as client:
        assert_one_line_error(client.post("/reload"), 401, "bearer token")
        ok = client.post("/reload", headers={"authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json()["changed"] is False
    rng = np.random.default_rng(1)
    from maxsim_cli import Corpus

    memory = Corpus.from_embeddings(["d0"], [rng.standard_normal((2, DIM)).astype(np.float32)])
    with TestClient(create_app(memory)) as client:
        assert_one_line_error(client.post("/reload"), 409, "nothing to reload")


def test_watch_picks_up_a_new_generation(folder: Path, tmp_path: Path) -> None:
    with open_corpus(folder) as corpus, TestClient(create_app(corpus.to("cpu"), watch=True)) as client:
        _delete(folder, GONE, tmp_path)
        deadline = time.monotonic() + 20
        while client.get("/health").json()["generation"] != 1:
            assert time.monotonic() < deadline, "--watch did not reload"
            time.sleep(0.1)
        assert not set(GONE) & _docnos(client.post("/search", json=_body()).json())


def test_workers_answer_through_a_reload_with_the_old_or_the_new_generation(
    folder: Path, tmp_path: Path
) -> None:
    """A real server, HTTP in a worker process, a token: clients search while `maxsim delete` commits
    and /reload swaps; every answer succeeds and is the old or the new generation's."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    server = Server(str(folder), "--workers", "1", "--token-file", str(token_file), "--batch-window-ms", "1")
    auth = {"authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client(base_url=server.url, timeout=30, headers=auth) as http:
            old = http.post("/search", json=_body(10)).json()["results"]
            answers: list[tuple[int, object]] = []
            stop = threading.Event()

            def client() -> None:
                with httpx.Client(base_url=server.url, timeout=30, headers=auth) as own:
                    while not stop.is_set():
                        response = own.post("/search", json=_body(10))
                        answers.append((response.status_code, response.json()["results"]))

            threads = [threading.Thread(target=client) for _ in range(4)]
            for thread in threads:
                thread.start()
            time.sleep(0.3)
            _delete(folder, GONE, tmp_path)
            assert httpx.post(f"{server.url}/reload").status_code == 401
            reloaded = http.post("/reload")
            time.sleep(0.3)
            stop.set()
            for thread in threads:
                thread.join()
            assert reloaded.status_code == 200 and reloaded.json()["generation"] == 1, reloaded.text
            new = http.post("/search", json=_body(10)).json()["results"]
            assert new != old and not set(GONE) & {h["docno"] for r in new for h in r["hits"]}
            assert answers and all(status == 200 for status, _ in answers)
            assert all(results in (old, new) for _, results in answers)
            assert http.get("/health").json()["generation"] == 1
    finally:
        server.stop()
