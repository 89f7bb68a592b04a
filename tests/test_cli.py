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
