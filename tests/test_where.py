"""Metadata filters (`maxsim_cli.scoring.where`): ``--where`` / ``where=`` / a served ``"where"``, a
condition on the metadata columns of Arrow and Parquet shards. A filtered run is the unfiltered run over
the matching documents, byte for byte; the text form is read through Python's parser and a whitelist,
never evaluated; only the named metadata columns are read; every bad filter is a one-line error."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from test_score import TORCH_DTYPES, invoke, make_corpus, make_queries

from maxsim_cli import open_corpus, rerank, search
from maxsim_cli.errors import InputError, MaxsimWarning, UsageError
from maxsim_cli.scoring import where as where_mod
from maxsim_cli.scoring.where import parse_where
from maxsim_cli.shards import write_shard
from maxsim_cli.shards.arrow_shards import _RecordShard

K = 7
LANGS = ("en", "de", "fr", None)


def _meta(docno: str) -> dict:
    """A document's metadata, from its number: a language (or null), a year, a title."""
    n = int(docno.removeprefix("doc"))
    return {"lang": LANGS[n % 4], "year": 2010 + n % 13, "title": f"{'The' if n % 3 else 'A'} doc {n}"}


def add_columns(path: str, ids: list[str], rows_per_chunk: int = 8) -> None:
    """The shard at ``path`` written again with metadata columns (lang, year, title) beside its own, in
    record batches / row groups of ``rows_per_chunk`` documents."""
    meta = [_meta(docno) for docno in ids]
    columns = {
        "lang": pa.array([m["lang"] for m in meta], type=pa.string()),
        "year": pa.array([m["year"] for m in meta], type=pa.int64()),
        "title": pa.array([m["title"] for m in meta], type=pa.string()),
    }
    if path.endswith(".parquet"):
        table = pq.read_table(path)
        for name, values in columns.items():
            table = table.append_column(name, values)
        pq.write_table(table, path, row_group_size=rows_per_chunk)
        return
    table = pa.ipc.open_file(path).read_all()
    for name, values in columns.items():
        table = table.append_column(name, values)
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table, max_chunksize=rows_per_chunk)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Three shards (Arrow, Parquet, Arrow) with metadata columns, their documents, and queries."""
    root = tmp_path_factory.mktemp("where")
    layout = (("arrow", 30), ("parquet", 25), ("arrow", 20))
    paths, docs = make_corpus(root / "corpus", layout=layout, seed=21)
    for path in paths:
        with open_corpus([path]) as one:
            ids = list(one.ids)
        add_columns(path, ids)
    make_queries(root / "q.safetensors", n=5, seed=22)
    return {"root": root, "paths": paths, "docs": docs, "queries": str(root / "q.safetensors")}


def _subcorpus(data, allowed: list[str], name: str) -> list[str]:
    folder = data["root"] / name
    folder.mkdir(exist_ok=True)
    path = str(folder / "sub.safetensors")
    write_shard(
        path, allowed, [data["docs"][d].to(TORCH_DTYPES["float16"]) for d in allowed], dtype="float16"
    )
    return [path]


def _score_bytes(tmp_path, *args: str) -> bytes:
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}.trec"
    result = invoke(*args, "-k", str(K), "-o", str(out), "--quiet")
    assert result.exit_code == 0, result.output
    return out.read_bytes()


# the text filters of the tests, and what each allows in Python
CONDITIONS = {
    "lang == 'en'": lambda m: m["lang"] == "en",
    "year >= 2018 and lang != 'de'": lambda m: m["year"] >= 2018 and m["lang"] not in ("de", None),
    "lang in ['fr', 'de'] or year < 2012": lambda m: m["lang"] in ("fr", "de") or m["year"] < 2012,
    "not starts_with(title, 'The') and 2011 <= year < 2020": lambda m: (
        not m["title"].startswith("The") and 2011 <= m["year"] < 2020
    ),
    "year == 2013 and lang == 'de'": lambda m: m["year"] == 2013 and m["lang"] == "de",  # few: subset path
}


@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_cli_where_run_is_the_run_over_the_matching_documents(data, tmp_path, condition) -> None:
    allowed = sorted(d for d in data["docs"] if CONDITIONS[condition](_meta(d)))
    assert 0 < len(allowed) < len(data["docs"])
    filtered = _score_bytes(tmp_path, data["queries"], *data["paths"], "--where", condition)
    assert filtered == _score_bytes(tmp_path, data["queries"], *_subcorpus(data, allowed, "sub"))


def test_where_with_id_filters_allows_what_all_allow(data, tmp_path) -> None:
    ids = sorted(data["docs"])
    include, exclude = ids[::2], ids[::6]
    (tmp_path / "inc").write_text("\n".join(include) + "\n")
    (tmp_path / "exc").write_text("\n".join(exclude) + "\n")
    condition = "year >= 2015"
    args = [
        "--include-ids",
        str(tmp_path / "inc"),
        "--exclude-ids",
        str(tmp_path / "exc"),
        "--where",
        condition,
    ]
    allowed = sorted((set(include) - set(exclude)) & {d for d in ids if _meta(d)["year"] >= 2015})
    filtered = _score_bytes(tmp_path, data["queries"], *data["paths"], *args)
    assert filtered == _score_bytes(tmp_path, data["queries"], *_subcorpus(data, allowed, "sub-ids"))


def test_api_where_takes_an_expression_or_its_text(data) -> None:
    expression = (pc.field("lang") == "en") | (pc.field("year") < 2012)
    allowed = sorted(d for d in data["docs"] if _meta(d)["lang"] == "en" or _meta(d)["year"] < 2012)
    with open_corpus(data["paths"]) as corpus:
        by_expression = search(data["queries"], corpus, k=K, device="cpu", where=expression)
        by_text = search(data["queries"], corpus, k=K, device="cpu", where="lang == 'en' or year < 2012")
        assert by_expression.to_dict() == by_text.to_dict()
        assert by_expression.stats.extra["filter"]["allowed"] == len(allowed)
        candidates = {q: sorted(data["docs"])[::3] for q in by_text.to_dict()}
        reranked = rerank(data["queries"], corpus, candidates, device="cpu", where=expression)
        kept = {q: [d for d in docnos if d in set(allowed)] for q, docnos in candidates.items()}
        assert reranked.to_dict() == rerank(data["queries"], corpus, kept, device="cpu").to_dict()
        assert reranked.stats.extra["filtered_candidates"] == sum(
            len(c) - len(kept[q]) for q, c in candidates.items()
        )
    with open_corpus(_subcorpus(data, allowed, "sub-api")) as sub:
        assert by_expression.to_dict() == search(data["queries"], sub, k=K, device="cpu").to_dict()


def test_a_null_never_matches(data) -> None:
    """A document whose condition is null (its lang is null) is left out, as SQL's WHERE leaves it."""
    with open_corpus(data["paths"]) as corpus:
        matched = where_mod.matching(corpus, "lang != 'en'")
        want = [_meta(d)["lang"] not in ("en", None) for d in corpus.ids]
        assert matched.tolist() == want
        assert where_mod.matching(corpus, "lang.is_null()").tolist() == [
            _meta(d)["lang"] is None for d in corpus.ids
        ]


def test_only_the_named_metadata_columns_are_read_and_kept(data, monkeypatch) -> None:
    """The token vectors are never read; each shard's pieces are read with only the columns the
    expression names; a second call with the same expression reads nothing."""
    asked: list[list[str]] = []
    original = _RecordShard.metadata_tables

    def spy(self, columns):
        asked.append(list(columns))
        return original(self, columns)

    def refuse(self, start, stop):
        raise AssertionError("the token vectors were read")

    monkeypatch.setattr(_RecordShard, "metadata_tables", spy)
    monkeypatch.setattr(_RecordShard, "_row_parts", refuse)
    with open_corpus(data["paths"]) as corpus:
        first = where_mod.matching(corpus, pc.field("year") > 2015)
        assert asked == [["year"]] * 3
        again = where_mod.matching(corpus, "year > 2015")  # the same expression: kept
        assert asked == [["year"]] * 3 and again.tolist() == first.tolist()
        where_mod.matching(corpus, "starts_with(title, 'A') and lang == 'en'")
        assert sorted(asked[-1]) == ["lang", "title"]
        where_mod.matching(corpus, "year > 2015.5")  # another literal type: another expression
        assert len(asked) == 9


# --------------------------------------------------------------------------------------------------
# the text form


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('lang == "en"', pc.field("lang") == "en"),
        ("pc.field('lang') == 'en'", pc.field("lang") == "en"),
        ("pyarrow.compute.field('my col') > -3", pc.field("my col") > -3),
        ("lang == 'en' and year >= 2020", (pc.field("lang") == "en") & (pc.field("year") >= 2020)),
        ("(lang == 'en') | ~(year < 2020)", (pc.field("lang") == "en") | ~(pc.field("year") < 2020)),
        ("2000 <= year < 2020", (pc.scalar(2000) <= pc.field("year")) & (pc.field("year") < 2020)),
        ("lang in ['en', 'de']", pc.field("lang").isin(["en", "de"])),
        ("lang not in ('en',)", ~pc.field("lang").isin(["en"])),
        (
            "starts_with(title, 'The', ignore_case=True)",
            pc.starts_with(pc.field("title"), "The", ignore_case=True),
        ),
        ("year.cast('string') == '2020'", pc.field("year").cast(pa.string()) == "2020"),
        ("year + 1 > scalar(3)", (pc.field("year") + 1) > pc.scalar(3)),
        ("True", pc.scalar(True)),
    ],
)
def test_the_text_form_is_the_expression_pyarrow_builds(text, expected) -> None:
    assert parse_where(text).equals(expected)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("__import__('os').system('touch {marker}')", "the method system"),
        ("__import__('os')", "the function __import__"),
        ("open('{marker}', 'w')", "the function open"),
        ("().__class__.__bases__[0].__subclasses__()", "is not allowed"),
        ("lang.__class__('{marker}')", "the method __class__"),
        ("(lambda: open('{marker}', 'w'))()", "is not allowed"),
        ("[x for x in lang]", "ListComp"),
        ("lang == 'en' if year else True", "IfExp"),
        ("year ** 2 > 1", "Pow"),
        ("lang == f'{{year}}'", "JoinedStr"),
        ("lang ==", "not an expression"),
        ("year == [1]", "a list"),
        ("'x' in lang", "'in'"),
        ("[1, 2]", "not a condition"),
        ("~" * 200 + "lang", "nested too deeply"),
        ("lang == 'x'" + " " * 5000, "characters"),
        ("year == 99999999999999999999999", "too large"),
    ],
)
def test_the_text_form_is_never_evaluated(tmp_path, text, words) -> None:
    marker = tmp_path / "marker"
    with pytest.raises(UsageError, match=words) as info:
        parse_where(text.format(marker=marker))
    assert "\n" not in str(info.value) and not marker.exists()


# --------------------------------------------------------------------------------------------------
# one-line errors


@pytest.mark.parametrize(
    ("condition", "code", "words"),
    [
        ("colour == 'red'", 1, "no metadata column 'colour' in this shard (it has: lang (string), year"),
        ("lang == 1", 1, "lang is string here"),
        ("year + 1", 1, "is not a condition"),
        ("id == 'doc001'", 1, "filter by ids with --include-ids"),
        ("embedding == 1", 1, "holds the token vectors"),
        ("year.cast('date32') > scalar('2020-01-01').cast('date32')", 1, "shard"),
        ("lang == ", 2, "not an expression"),
        ("exec('1')", 2, "the function exec"),
    ],
)
def test_bad_where_is_a_one_line_error_naming_the_shard(data, tmp_path, condition, code, words) -> None:
    out = tmp_path / "run.trec"
    result = invoke(data["queries"], *data["paths"], "--where", condition, "-o", str(out))
    assert result.exit_code == code, result.output
    assert len(result.output.strip().splitlines()) == 1 and words in result.output, result.output
    if code == 1:
        assert data["paths"][0] in result.output
    assert not out.exists()


def test_shards_without_metadata_columns_are_refused_in_one_line(data, tmp_path) -> None:
    docs = data["docs"]
    ids = sorted(docs)[:5]
    plain = str(tmp_path / "plain.arrow")
    write_shard(plain, ids, [docs[d].to(TORCH_DTYPES["float16"]) for d in ids], dtype="float16")
    safetensors = str(tmp_path / "plain.safetensors")
    write_shard(safetensors, ids, [docs[d].to(TORCH_DTYPES["float16"]) for d in ids], dtype="float16")
    for path, words in (
        (plain, "no column beside id and embedding"),
        (safetensors, "safetensors shard has none"),
    ):
        result = invoke(data["queries"], path, "--where", "lang == 'en'", "-o", str(tmp_path / "run.trec"))
        assert result.exit_code == 1 and words in result.output and path in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
        words = r"where '\(lang == \"en\"\)' reads metadata"
        with open_corpus([path]) as corpus, pytest.raises(InputError, match=words):
            search(data["queries"], corpus, k=3, device="cpu", where=pc.field("lang") == "en")


def test_api_where_of_another_type_is_a_usage_error(data) -> None:
    with open_corpus(data["paths"]) as corpus, pytest.raises(UsageError, match="where: got int"):
        search(data["queries"], corpus, k=3, device="cpu", where=3)


def test_where_with_devices_cpu2_is_the_single_process_run(data, tmp_path) -> None:
    """Every rank of a ``--devices cpu:2`` job reads the metadata and scores its shards with its part of
    the mask: the run of one process."""
    from typer.testing import CliRunner

    from maxsim_cli.cli import app

    condition = "year >= 2016 or lang == 'fr'"
    single = _score_bytes(tmp_path, data["queries"], *data["paths"], "--where", condition)
    out = tmp_path / "dist.trec"
    result = CliRunner().invoke(
        app,
        ["score", data["queries"], *data["paths"], "--where", condition, "-k", str(K), "-o", str(out)]
        + ["--quiet", "--devices", "cpu:2"],
        env={"MAXSIM_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"},
    )
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == single


# --------------------------------------------------------------------------------------------------
# maxsim compact keeps the metadata columns


def _metadata_of(path: str) -> pa.Table:
    """A shard file's id column and metadata columns, as pyarrow reads them."""
    table = pq.read_table(path) if path.endswith(".parquet") else pa.ipc.open_file(path).read_all()
    return table.select(["id"] + [n for n in table.column_names if n not in ("id", "embedding", "length")])


def _changed_corpus(data, folder) -> list[str]:
    """``data``'s shards as a corpus folder with a third of the documents deleted; the deleted ids."""
    import shutil

    from maxsim_cli.shards import write_manifest

    folder.mkdir()
    for path in data["paths"]:
        shutil.copy(path, folder)
    write_manifest(folder)
    gone = sorted(data["docs"])[::3]
    (folder.parent / "gone").write_text("\n".join(gone) + "\n")
    assert _cli("delete", str(folder), "--ids", str(folder.parent / "gone")).exit_code == 0
    return gone


def _cli(*args: str, input: str | None = None):
    from typer.testing import CliRunner

    from maxsim_cli.cli import app

    return CliRunner().invoke(app, list(args), input=input)


def test_compact_carries_the_metadata_columns(data, tmp_path, monkeypatch) -> None:
    """A compacted Arrow / Parquet shard holds the surviving documents' metadata rows, with the columns'
    names and types, read and written a small batch at a time: --where gives the run it gave before the
    compact, byte for byte."""
    from maxsim_cli.shards import edit, sinks

    folder = tmp_path / "corpus"
    gone = set(_changed_corpus(data, folder))
    expected = []
    for path in data["paths"]:
        table = _metadata_of(path)
        expected.append(table.filter(pc.invert(pc.is_in(table.column("id"), pa.array(sorted(gone))))))
    condition = "lang == 'en' or year >= 2018 or starts_with(title, 'A')"
    before = _score_bytes(tmp_path, data["queries"], str(folder), "--where", condition)
    # batches of a few documents read, and record batches of 5 written, across the 8-document chunks
    monkeypatch.setattr(edit, "COMPACT_BATCH_BYTES", 64)
    monkeypatch.setattr(sinks.RecordSink, "FLUSH_DOCS", 5)
    result = _cli("compact", str(folder), "--threshold", "0")
    assert result.exit_code == 0 and "compacted 3 shards" in result.output, result.output
    assert _score_bytes(tmp_path, data["queries"], str(folder), "--where", condition) == before
    with open_corpus(folder) as corpus:
        assert corpus.num_deleted == 0
        paths = list(corpus.paths)
    for path, want in zip(paths, expected, strict=True):
        got = _metadata_of(path)
        assert got.schema.equals(want.schema) and got.equals(want), path
        assert path.endswith(".parquet") or pa.ipc.open_file(path).num_record_batches > 1


def test_compact_leaves_a_shard_without_metadata_columns_without(data, tmp_path) -> None:
    """A corpus of shards with and without metadata columns stays so: --where is refused on it before
    the compact and after, naming the shard without."""
    import shutil

    from maxsim_cli.shards import write_manifest

    folder = tmp_path / "corpus"
    folder.mkdir()
    ids = [f"plain{i}" for i in range(6)]
    write_shard(folder / "a.arrow", ids, [data["docs"]["doc001"]] * 6, dtype="float16")
    shutil.copy(data["paths"][1], folder)
    write_manifest(folder)
    assert _cli("delete", str(folder), "--ids", "-", input="plain0\ndoc001\n").exit_code == 0
    refusals = []
    for _ in range(2):
        result = invoke(data["queries"], str(folder), "--where", "year > 2015", "-o", "-")
        assert result.exit_code == 1
        refusals.append(result.output)
        assert _cli("compact", str(folder), "--threshold", "0").exit_code == 0
    assert [r.split("a.arrow: ", 1)[1] for r in refusals] == [refusals[0].split("a.arrow: ", 1)[1]] * 2
    with open_corpus(folder) as corpus:
        assert [len(s.metadata_schema()) for s in corpus.shards] == [0, 3]


def test_a_writer_writes_metadata_columns(tmp_path, monkeypatch) -> None:
    """`ShardWriter(metadata_columns=)`: rows given with each add, dictionary columns kept dictionaries
    (one dictionary grown across the record batches of an IPC file), every misuse one line."""
    import numpy as np

    from maxsim_cli.shards import ShardWriter, sinks

    monkeypatch.setattr(sinks.RecordSink, "FLUSH_DOCS", 2)
    schema = pa.schema([("tag", pa.dictionary(pa.int32(), pa.string())), ("n", pa.int16())])
    rows = [
        pa.table({"tag": pa.array(["x", "y", "x"]).dictionary_encode(), "n": [1, 2, None]}).cast(schema),
        pa.table({"tag": pa.array(["z", "y"]).dictionary_encode(), "n": [4, 5]}).cast(schema),
    ]
    vectors = np.ones((2, 4), dtype=np.float32)
    for suffix in ("arrow", "parquet"):
        path = tmp_path / f"s.{suffix}"
        with ShardWriter(path, 4, "float32", metadata_columns=schema) as writer:
            writer.add(["a", "b", "c"], [vectors] * 3, metadata_columns=rows[0])
            writer.add(["d", "e"], [vectors] * 2, metadata_columns=rows[1])
        got = _metadata_of(str(path))
        assert got.column("id").to_pylist() == list("abcde")
        assert got.schema.field("tag").type == schema.field("tag").type
        assert got.column("tag").to_pylist() == ["x", "y", "x", "z", "y"]
        assert got.column("n").to_pylist() == [1, 2, None, 4, 5]
    with pytest.raises(InputError, match="holds no metadata columns"):
        ShardWriter(tmp_path / "s.safetensors", 4, "float32", metadata_columns=schema)
    with pytest.raises(InputError, match="'length' is a column of the shard's own"):
        ShardWriter(tmp_path / "t.arrow", 4, "float32", metadata_columns=pa.schema([("length", pa.int8())]))
    writer = ShardWriter(tmp_path / "t.arrow", 4, "float32", metadata_columns=schema)
    with pytest.raises(InputError, match="2 rows for 3 documents"):
        writer.add(["a", "b", "c"], [vectors] * 3, metadata_columns=rows[1])
    assert not (tmp_path / "t.arrow").exists()
    writer = ShardWriter(tmp_path / "t.arrow", 4, "float32", metadata_columns=schema)
    with pytest.raises(InputError, match="column 'n' of type int16"):
        writer.add(["a"], [vectors], metadata_columns=pa.table({"tag": rows[1]["tag"][:1], "n": [1]}))


# --------------------------------------------------------------------------------------------------
# maxsim serve


@pytest.fixture(scope="module")
def served(data):
    from test_serve import TestClient

    from maxsim_cli.service.app import create_app

    with open_corpus(data["paths"]) as corpus:
        corpus.to("cpu")
        with TestClient(create_app(corpus, batch_window_ms=5, max_request_bytes=4 << 20)) as client:
            yield client, corpus


def _query_json(data) -> list[dict]:
    from test_serve import query_json

    from maxsim_cli import read_queries

    queries = read_queries(data["queries"])
    return [query_json(queries, i) for i in range(len(queries.ids))]


def test_a_served_search_takes_where(data, served) -> None:
    from test_serve import hits_of

    client, corpus = served
    condition = "lang == 'de' or year < 2013"
    answer = client.post("/search", json={"queries": _query_json(data), "k": K, "where": condition})
    assert answer.status_code == 200, answer.text
    want = search(data["queries"], corpus, k=K, where=condition).to_dict()
    got = hits_of(answer.json())
    assert {q: [d for d, _ in rows] for q, rows in got.items()} == {
        q: [d for d, _ in rows] for q, rows in want.items()
    }


def test_a_served_arrow_search_takes_where_in_the_query_string(data, served, tmp_path) -> None:
    from urllib.parse import quote

    from test_serve import ARROW_TYPE, arrow_stream, hits_of

    from maxsim_cli import read_queries

    client, corpus = served
    condition = "year >= 2019 and lang in ['en', 'fr']"
    queries = read_queries(data["queries"])
    body = arrow_stream(queries, list(range(len(queries.ids))), tmp_path)
    answer = client.post(
        f"/search?k={K}&where={quote(condition)}", content=body, headers={"Content-Type": ARROW_TYPE}
    )
    assert answer.status_code == 200, answer.text
    want = search(data["queries"], corpus, k=K, where=condition).to_dict()
    assert {q: [d for d, _ in rows] for q, rows in hits_of(answer.json()).items()} == {
        q: [d for d, _ in rows] for q, rows in want.items()
    }


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"where": "__import__('os')"}, "the function __import__"),
        ({"where": "colour == 'red'"}, "no metadata column 'colour'"),
        ({"where": "lang == 1"}, "lang is string"),
        ({"where": 3}, "where"),
        ({"where": "x" * 5000}, "where"),
    ],
)
def test_a_bad_served_where_is_a_422(data, served, extra, fragment) -> None:
    from test_serve import assert_one_line_error

    client, _ = served
    answer = client.post("/search", json={"queries": _query_json(data)[:1], **extra})
    assert_one_line_error(answer, 422, fragment)


def _rerank_body(data, condition: str, **extra) -> tuple[dict, dict[str, list[str]]]:
    """A served rerank's JSON body: each query's candidates a third of the corpus and a docno that is not
    in it, with ``where`` and ``extra``; and the candidates."""
    queries = _query_json(data)
    ids = sorted(data["docs"])
    candidates = {q["qid"]: [*ids[i::3], "no-such-doc"] for i, q in enumerate(queries[:3])}
    return {"queries": queries[:3], "candidates": candidates, "where": condition, **extra}, candidates


@pytest.mark.parametrize("path", ["direct", "library"])
def test_a_served_rerank_takes_where(data, served, monkeypatch, path) -> None:
    """The candidates the condition does not hold for are dropped, as the library's rerank drops them:
    not missing, the rest scored as they are; with include, what both allow. On both scoring paths."""
    from maxsim_cli.scoring import dispatch

    if path == "library":
        monkeypatch.setattr(
            dispatch, "plan_served_rerank", lambda *a: dispatch.Plan(dispatch.LIBRARY, ("cpu",))
        )
    client, corpus = served
    condition = "lang == 'en' or year < 2014"
    for extra in ({}, {"include": sorted(data["docs"])[::2]}):
        body, candidates = _rerank_body(data, condition, **extra)
        answer = client.post("/rerank", json=body)
        assert answer.status_code == 200, answer.text
        with pytest.warns(MaxsimWarning, match="no-such-doc"):
            want = rerank(data["queries"], corpus, candidates, where=condition, **extra).to_dict()
        assert hits_of_json(answer.json()) == {q: want.get(q, []) for q in candidates}
        missing = [] if extra else ["no-such-doc"]  # include drops it with the others it leaves out
        assert all(r["missing"] == missing for r in answer.json()["results"])
        kept = [d for d, _ in hits_of_json(answer.json())["q0"]]
        assert kept and all(_meta(d)["lang"] == "en" or _meta(d)["year"] < 2014 for d in kept)


def hits_of_json(answer: dict) -> dict[str, list[tuple[str, float]]]:
    from test_serve import hits_of

    return hits_of(answer)


def test_a_served_arrow_rerank_takes_where_in_the_query_string(data, served, tmp_path) -> None:
    from urllib.parse import quote

    from test_serve import ARROW_TYPE, arrow_stream

    from maxsim_cli import read_queries

    client, corpus = served
    condition = "year >= 2016"
    _, candidates = _rerank_body(data, condition)
    queries = read_queries(data["queries"])
    body = arrow_stream(queries, [0, 1, 2], tmp_path, [candidates[q] for q in queries.ids[:3]])
    answer = client.post(
        f"/rerank?where={quote(condition)}", content=body, headers={"Content-Type": ARROW_TYPE}
    )
    assert answer.status_code == 200, answer.text
    with pytest.warns(MaxsimWarning, match="no-such-doc"):
        want = rerank(data["queries"], corpus, candidates, where=condition).to_dict()
    assert hits_of_json(answer.json()) == {q: want.get(q, []) for q in candidates}


@pytest.mark.parametrize(
    ("where", "fragment"),
    [
        ("__import__('os')", "the function __import__"),
        ("colour == 'red'", "no metadata column 'colour'"),
        ("lang == 1", "lang is string"),
        (3, "where"),
        ("x" * 5000, "where"),
    ],
)
def test_a_bad_served_rerank_where_is_a_422(data, served, where, fragment) -> None:
    from test_serve import assert_one_line_error

    client, _ = served
    body = {"queries": _query_json(data)[:1], "candidates": {"q0": ["doc001"]}, "where": where}
    answer = client.post("/rerank", json=body)
    assert_one_line_error(answer, 422, fragment)
    assert "--where" not in answer.json()["detail"]


def test_a_rerank_batch_with_a_bad_where_fails_that_request_alone(data, served) -> None:
    """Reranks of one batch with different conditions each keep their own candidates; one whose condition
    names a column the shards lack fails alone, the batch not split."""
    import asyncio

    from test_serve import Batcher, Counters, Parsed

    from maxsim_cli import read_queries
    from maxsim_cli.service.batching import Scorer

    _, corpus = served
    queries = read_queries(data["queries"])
    ids = sorted(data["docs"])
    candidates = {qid: ids[i::4] for i, qid in enumerate(queries.ids)}
    wheres = ["lang == 'en'", "colour == 'red'", None, "year < 2015"]
    requests = [Parsed(queries, None, dict(candidates), where=where) for where in wheres]
    counters = Counters()

    async def main() -> list:
        batcher = Batcher(Scorer(corpus, counters=counters), window_s=0.5, max_queries=64)
        await batcher.start()
        try:
            return await asyncio.gather(
                *(batcher.submit("rerank", r) for r in requests), return_exceptions=True
            )
        finally:
            await batcher.close()

    answers = asyncio.run(main())
    assert counters.batches == 1 and counters.splits == 0
    assert isinstance(answers[1], InputError) and "colour" in str(answers[1])
    for where, answer in zip(wheres, answers, strict=True):
        if where == "colour == 'red'":
            continue
        alone = rerank(queries, corpus, candidates, where=where).to_dict()
        assert {qid: list(hits) for qid, hits, _ in answer} == {q: alone.get(q, []) for q in queries.ids}


def test_the_where_limits_agree() -> None:
    from maxsim_cli.service.schema import MAX_WHERE_CHARS

    assert MAX_WHERE_CHARS == where_mod.MAX_WHERE_CHARS


def test_a_batch_of_different_wheres_gives_each_request_its_own(data, served) -> None:
    """Requests of one batch with different conditions are searched apart (the batch split by filter),
    and a condition crosses to a `--workers` server's scoring process in the request's frame."""
    import asyncio

    from test_serve import Batcher, Counters, Parsed

    from maxsim_cli import read_queries
    from maxsim_cli.service.batching import Scorer

    _, corpus = served
    queries = read_queries(data["queries"])
    requests = [
        Parsed(queries, 5),
        Parsed(queries, 5, where="lang == 'en'"),
        Parsed(queries, 5, where="year < 2015"),
        Parsed(queries, 5, include=sorted(data["docs"])[::2], where="lang == 'en'"),
        Parsed(queries, 5, where="lang == 'en'"),
    ]
    counters = Counters()

    async def main() -> list:
        batcher = Batcher(Scorer(corpus, counters=counters), window_s=0.5, max_queries=64)
        await batcher.start()
        try:
            return await asyncio.gather(*(batcher.submit("search", r) for r in requests))
        finally:
            await batcher.close()

    answers = asyncio.run(main())
    assert counters.batches == 1
    for request, answer in zip(requests, answers, strict=True):
        alone = search(queries, corpus, k=5, include=request.include, where=request.where).to_dict()
        assert {qid: list(hits) for qid, hits, _ in answer} == alone


def test_where_crosses_to_the_scoring_process(data) -> None:
    import json as json_mod

    from test_serve import query_json

    from maxsim_cli import read_queries
    from maxsim_cli.service.schema import check_request
    from maxsim_cli.service.wire import checked_from_frame, request_frame

    queries = read_queries(data["queries"])
    body = json_mod.dumps({"queries": [query_json(queries, 0)], "k": 3, "where": "year > 2015"}).encode()
    frame = request_frame(7, "search", check_request("search", None, body, {}, queries.dim))
    head_len = int.from_bytes(frame[:4], "little")
    header = json_mod.loads(frame[8 : 8 + head_len])
    assert checked_from_frame(header, frame[8 + head_len :]).where == "year > 2015"
    header["where"] = 5
    with pytest.raises(Exception, match="where"):
        checked_from_frame(header, frame[8 + head_len :])
    body = {"queries": [query_json(queries, 0)], "candidates": {"q0": ["doc001"]}, "where": "year > 2015"}
    frame = request_frame(
        8, "rerank", check_request("rerank", None, json_mod.dumps(body).encode(), {}, queries.dim)
    )
    head_len = int.from_bytes(frame[:4], "little")
    header = json_mod.loads(frame[8 : 8 + head_len])
    assert checked_from_frame(header, frame[8 + head_len :]).where == "year > 2015"
