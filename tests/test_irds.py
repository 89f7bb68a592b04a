"""``irds:<dataset-id>``: qrels and first-stage runs read through ir_datasets (`maxsim_cli.irds`).

Every dataset here is registered locally over copies of sample_data/ files, and the network is shut for
the whole module: nothing is downloaded.
"""

from __future__ import annotations

import json
import socket
import sys
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from maxsim_cli import irds
from maxsim_cli.cli import app
from maxsim_cli.errors import InputError, MaxsimError, UsageError
from maxsim_cli.run_files import iter_qrels, iter_run, read_qrels, read_run

ir_datasets = pytest.importorskip("ir_datasets")
from ir_datasets.datasets.base import Dataset  # noqa: E402
from ir_datasets.formats import TrecQrels, TrecScoredDocs  # noqa: E402
from ir_datasets.util import LocalDownload  # noqa: E402

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def register(tmp_path: Path, *, qrels: str | None = None, scoreddocs: str | None = None) -> str:
    """Register a dataset over the given file texts under a fresh id; returns ``irds:<id>``."""
    parts = []
    if qrels is not None:
        (tmp_path / "qrels").write_text(qrels)
        parts.append(TrecQrels(LocalDownload(str(tmp_path / "qrels")), {}))
    if scoreddocs is not None:
        (tmp_path / "scoreddocs").write_text(scoreddocs)
        parts.append(TrecScoredDocs(LocalDownload(str(tmp_path / "scoreddocs"))))
    name = f"maxsim-test/{uuid.uuid4().hex[:12]}"
    ir_datasets.registry.register(name, Dataset(*parts))
    return f"irds:{name}"


@pytest.fixture()
def sample(tmp_path: Path) -> str:
    """The sample data's qrels and candidates as one ir_datasets dataset."""
    return register(
        tmp_path,
        qrels=(SAMPLE / "qrels.txt").read_text(),
        scoreddocs=(SAMPLE / "candidates.trec").read_text(),
    )


def test_reads_the_same_as_the_files(sample: str) -> None:
    assert read_qrels(sample) == read_qrels(SAMPLE / "qrels.txt")
    assert read_run(sample) == read_run(SAMPLE / "candidates.trec")
    first = next(iter_run(sample))
    assert (first.qid, first.docno, first.rank, first.line) == ("q001", "libgprofng0", None, 1)
    assert [q.relevance for q in iter_qrels(sample)][:2] == [1, 1]


def test_eval_figures_equal_the_file_based_ones(sample: str) -> None:
    pytest.importorskip("ir_measures")
    run = str(SAMPLE / "candidates.trec")
    by_file = runner.invoke(app, ["eval", run, str(SAMPLE / "qrels.txt"), "--json"])
    by_irds = runner.invoke(app, ["eval", run, sample, "--json"])
    assert by_irds.exit_code == 0, by_irds.output
    assert json.loads(by_irds.stdout) == json.loads(by_file.stdout)
    assert "200 judged queries, 200 in the run" in by_irds.stderr
    # the dataset's own run evaluated against its own qrels
    own = runner.invoke(app, ["eval", sample, sample, "--json"])
    assert json.loads(own.stdout) == json.loads(by_file.stdout)


def test_score_reranks_the_scoreddocs_as_the_candidates_file(sample: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    queries, corpus = str(SAMPLE / "queries.safetensors"), str(SAMPLE / "corpus")
    common = [queries, corpus, "--device", "cpu", "-k", "10", "--quiet"]
    by_file = runner.invoke(app, ["score", *common, "--candidates", str(SAMPLE / "candidates.trec")])
    by_irds = runner.invoke(app, ["score", *common, "--candidates", sample])
    assert by_irds.exit_code == 0, by_irds.output
    assert by_irds.stdout == by_file.stdout and by_irds.stdout.count("\n") > 1000


def test_rerank_from_python(sample: str) -> None:
    from maxsim_cli import open_corpus, read_queries, rerank

    queries = read_queries(SAMPLE / "queries.safetensors")
    with open_corpus(SAMPLE / "corpus") as corpus:
        by_irds = rerank(queries, corpus, sample, k=5, device="cpu")
        by_file = rerank(queries, corpus, str(SAMPLE / "candidates.trec"), k=5, device="cpu")
    assert list(by_irds) == list(by_file)


def test_documents_absent_from_the_corpus_are_unknown_candidates(tmp_path: Path) -> None:
    dataset = register(tmp_path, scoreddocs="q001 Q0 libgprofng0 0 2.5 bm25\nq001 Q0 not-a-doc 1 1.5 bm25\n")
    queries, corpus = str(SAMPLE / "queries.safetensors"), str(SAMPLE / "corpus")
    result = runner.invoke(app, ["score", queries, corpus, "--device", "cpu", "--candidates", dataset])
    assert result.exit_code == 0, result.output
    assert [line.split()[2] for line in result.stdout.splitlines()] == ["libgprofng0"]
    assert "1 candidates are not in the corpus" in result.stderr and "'not-a-doc'" in result.stderr
    strict = runner.invoke(
        app, ["score", queries, corpus, "--device", "cpu", "--candidates", dataset, "--strict"]
    )
    assert strict.exit_code == 1 and dataset in strict.stderr


def test_repeated_records_keep_the_first(tmp_path: Path) -> None:
    dataset = register(
        tmp_path,
        qrels="q1 0 d1 2\nq1 0 d1 0\nq1 0 d2 1\n",
        scoreddocs="q1 Q0 d1 0 3.0 r\nq1 Q0 d1 1 1.0 r\nq1 Q0 d2 2 2.0 r\n",
    )
    assert read_qrels(dataset) == {"q1": {"d1": 2, "d2": 1}}
    assert read_run(dataset) == {"q1": [("d1", 3.0), ("d2", 2.0)]}


def test_a_non_finite_score_is_an_error(tmp_path: Path) -> None:
    dataset = register(tmp_path, scoreddocs="q1 Q0 d1 0 3.0 r\nq1 Q0 d2 1 nan r\n")
    with pytest.raises(InputError, match=r"scored document 2 \(query 'q1', docno 'd2'\) has score nan"):
        read_run(dataset)


def test_ids_obey_the_format_rule(tmp_path: Path) -> None:
    """A zero-width character in a docno, or a control character in a qid, is an error naming the record,
    as in a run or qrels file."""
    from maxsim_cli.run_files import read_qrels

    dataset = register(tmp_path, scoreddocs="q1 Q0 d1 0 3.0 r\nq1 Q0 d\u200b2 1 2.0 r\n")
    with pytest.raises(InputError, match=r"docno .* in scored document 2 contains an invisible zero-width"):
        read_run(dataset)
    dataset = register(tmp_path, qrels="q\x011 0 d1 1\n")
    with pytest.raises(InputError, match=r"query id .* in judgement 1 contains a control character, U\+0001"):
        read_qrels(dataset)


def test_unknown_dataset_id_suggests_close_ones(sample: str) -> None:
    typo = sample[:-1] + ("x" if sample[-1] != "x" else "y")
    result = runner.invoke(app, ["eval", str(SAMPLE / "candidates.trec"), typo])
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        f"maxsim: error: {typo}: no ir_datasets dataset has the id {typo[5:]!r}; did you mean "
    )
    assert sample in line
    with pytest.raises(InputError, match="the ids are listed at https://ir-datasets.com"):
        read_qrels("irds:no-such-collection-anywhere/at-all")


def test_empty_dataset_id_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="no dataset id after 'irds:'"):
        read_qrels("irds:")
    assert runner.invoke(app, ["eval", str(SAMPLE / "candidates.trec"), "irds:"]).exit_code == 2


def test_dataset_without_qrels_or_scoreddocs(tmp_path: Path) -> None:
    only_run = register(tmp_path, scoreddocs="q1 Q0 d 0 1 r\n")
    only_qrels = register(tmp_path, qrels="q1 0 d 1\n")
    with pytest.raises(
        InputError, match="this dataset has no qrels .it provides scoreddocs.; choose a subset"
    ):
        read_qrels(only_run)
    with pytest.raises(InputError, match="this dataset has no scoreddocs .it provides qrels."):
        read_run(only_qrels)
    result = runner.invoke(app, ["eval", str(SAMPLE / "candidates.trec"), only_run])
    assert result.exit_code == 1 and "has no qrels" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_empty_qrels_and_scoreddocs(tmp_path: Path) -> None:
    dataset = register(tmp_path, qrels="", scoreddocs="")
    with pytest.raises(InputError, match="qrels are empty"):
        read_qrels(dataset)
    with pytest.raises(InputError, match="scoreddocs are empty"):
        read_run(dataset)


def test_ir_datasets_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ir_datasets", None)  # makes `import ir_datasets` fail
    with pytest.raises(MaxsimError, match=r"pip install 'maxsim\[irds\]'"):
        read_run("irds:msmarco-passage/dev/small")
    result = runner.invoke(app, ["eval", str(SAMPLE / "candidates.trec"), "irds:msmarco-passage/dev/small"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "maxsim: error: reading 'irds:' datasets needs the optional package ir-datasets; install it with "
        "pip install 'maxsim[irds]'"
    ]


def test_ir_datasets_failures_are_one_line(tmp_path: Path) -> None:
    dataset = register(tmp_path, qrels="q1 0 d 1\n")
    (tmp_path / "qrels").unlink()  # the data gone from under ir_datasets
    with pytest.raises(MaxsimError, match=f"{dataset}: ir_datasets could not read the qrels: "):
        read_qrels(dataset)


def test_an_existing_file_named_like_a_dataset_is_read_as_the_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("irds:local").write_text("q1 Q0 d1 0 1.0 r\n")
    assert not irds.is_irds("irds:local") and irds.is_irds("irds:elsewhere")
    assert read_run("irds:local") == {"q1": [("d1", 1.0)]}


def test_no_network_is_one_line_naming_the_cache_folder(tmp_path: Path, monkeypatch, capfd) -> None:
    """A dataset whose files must be downloaded, with the network shut: one line naming the dataset,
    the folder ir_datasets keeps its data in (IR_DATASETS_HOME) and what to do; none of ir_datasets'
    own lines about the failed attempts."""
    from ir_datasets.util import Download, RequestsDownload

    home = tmp_path / "irds-home"
    monkeypatch.setenv("IR_DATASETS_HOME", str(home))
    mirrors = [RequestsDownload(f"http://127.0.0.1:9/{name}", tries=2) for name in ("qrels", "mirror")]
    download = Download(mirrors, cache_path=str(tmp_path / "cache" / "qrels"))
    name = f"maxsim-test/{uuid.uuid4().hex[:12]}"
    ir_datasets.registry.register(name, Dataset(TrecQrels(download, {})))
    capfd.readouterr()
    with pytest.raises(MaxsimError) as info:
        read_qrels(f"irds:{name}")
    message = str(info.value)
    assert message.startswith(f"irds:{name}: ir_datasets could not download the qrels (no network here?)")
    assert str(home) in message and "~/.ir_datasets" not in message and "\n" not in message
    assert len(message) < 400
    assert capfd.readouterr().err == ""  # ir_datasets' [INFO] / [WARNING] lines left out
    result = runner.invoke(app, ["eval", str(SAMPLE / "candidates.trec"), f"irds:{name}"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [f"maxsim: error: {message}"]
