"""The command line as a whole: version, the command list, help examples, and the README quickstart."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from maxsim_cli import __version__
from maxsim_cli.cli import COMMAND_MODULES, app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"maxsim {__version__}"


def test_help_lists_every_command_with_a_summary() -> None:
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in COMMAND_MODULES:
        assert re.search(rf"^\W*{name}\s+\w", result.stdout, re.M), name


@pytest.mark.parametrize("name", COMMAND_MODULES)
def test_each_command_help_has_a_runnable_example(name: str) -> None:
    result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert f"Example: maxsim {name} " in result.stdout


def test_unknown_command_is_a_usage_error() -> None:
    assert runner.invoke(app, ["frobnicate"]).exit_code == 2


def _quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", "", block)  # continuation lines
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_readme_quickstart_runs(tmp_path: Path) -> None:
    """Every quickstart command, pasted into a shell in a fresh folder next to sample_data/, succeeds."""
    (tmp_path / "sample_data").symlink_to(ROOT / "sample_data")
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    commands = _quickstart_commands()
    assert any(c.startswith("maxsim score") for c in commands)
    for command in commands:
        proc = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
    assert (tmp_path / "run.trec").stat().st_size > 0
    assert (tmp_path / "run-int8.trec").stat().st_size > 0


@pytest.mark.parametrize("name", ["", *COMMAND_MODULES])
def test_flags_are_shown_as_flags(name: str) -> None:
    """Typer shows a flag's type as <bool>, as if it took a value; the help shows none."""
    result = runner.invoke(app, [name, "--help"] if name else ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "<bool>" not in result.stdout
    assert re.search(r"--help\s+-h\s+Show this message", result.stdout)


def test_top_level_help_has_an_example_that_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ir_measures")
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "300"})
    (example,) = [line.strip(" │") for line in result.stdout.splitlines() if "Example: maxsim " in line]
    (tmp_path / "sample_data").symlink_to(ROOT / "sample_data")
    monkeypatch.chdir(tmp_path)
    for command in example.removeprefix("Example: ").split("&&"):
        words = command.split()
        assert words[0] == "maxsim"
        ran = runner.invoke(app, [*words[1:], *(["--device", "cpu"] if words[1] == "score" else [])])
        assert ran.exit_code == 0, ran.output
    assert (tmp_path / "run.trec").stat().st_size > 0


def test_a_query_folder_is_accepted_as_queries(tmp_path: Path) -> None:
    folder = tmp_path / "queries"
    folder.mkdir()
    (folder / "shard-00000.safetensors").write_bytes((ROOT / "sample_data/queries.safetensors").read_bytes())
    common = [str(ROOT / "sample_data/corpus"), "-k", "3", "--device", "cpu", "-q"]
    by_folder = runner.invoke(app, ["score", str(folder), *common])
    assert by_folder.exit_code == 0, by_folder.output
    by_file = runner.invoke(app, ["score", str(ROOT / "sample_data/queries.safetensors"), *common])
    assert by_folder.stdout == by_file.stdout and by_folder.stdout.count("\n") == 600


def test_summaries_count_the_work(tmp_path: Path) -> None:
    queries, corpus = str(ROOT / "sample_data/queries.safetensors"), str(ROOT / "sample_data/corpus")
    exhaustive = runner.invoke(app, ["score", queries, corpus, "-k", "1", "--device", "cpu"])
    assert exhaustive.exit_code == 0, exhaustive.output
    assert (
        "scored 200 queries x 400 documents = 80,000 pairs (4,469 document tokens) in " in exhaustive.stderr
    )
    assert " pairs/s on cpu" in exhaustive.stderr and "docs/s" not in exhaustive.stderr
    candidates = tmp_path / "two.trec"  # candidates for 2 of the 200 queries, one of them not in the corpus
    candidates.write_text(
        "q001 Q0 libgprofng0 1 3 bm25\nq001 Q0 gcc 2 2 bm25\n"
        "q002 Q0 libkeyutils1 1 3 bm25\nq002 Q0 gone 2 1 x\n"
    )
    rerank = runner.invoke(
        app, ["score", queries, corpus, "--device", "cpu", "--candidates", str(candidates)]
    )
    assert rerank.exit_code == 0, rerank.output
    assert (
        "reranked 3 candidates of 2 queries (3 documents, " in rerank.stderr
        and "1 not in the corpus; 198 of 200 queries had none) in " in rerank.stderr
    )


def test_one_number_format() -> None:
    from maxsim_cli.units import format_count, format_counted, format_rate, format_si

    assert format_count(80000) == "80,000" and format_count(7) == "7"
    assert format_counted(1, "query", "queries") == "1 query"
    assert format_counted(1200, "query", "queries") == "1,200 queries"
    assert format_si(455) == "455" and format_si(92_000) == "92K" and format_si(5_160_000) == "5.16M"
    assert format_rate(80_000, 0.5, "pairs") == "160K pairs/s" and format_rate(3, 0, "pairs") == "- pairs/s"
