"""Every ```python block of docs/integrations.md runs, in order within its section, in a fresh folder next to
sample_data/. A section's blocks share one namespace; a block needing a library that is not installed is
skipped with its section (the first line may say `# needs: <module>`)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "integrations.md"


def _sections() -> list[tuple[str, list[str]]]:
    text = PAGE.read_text(encoding="utf-8")
    sections = []
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        title = part.splitlines()[0].strip()
        blocks = re.findall(r"```python\n(.*?)```", part, re.S)
        if blocks:
            sections.append((title, blocks))
    return sections


def _needs(blocks: list[str]) -> list[str]:
    return [m for block in blocks for m in re.findall(r"^# needs: ([\w.]+)", block, re.M)]


@pytest.mark.parametrize("title,blocks", _sections(), ids=[t for t, _ in _sections()])
def test_integration_section_runs(title: str, blocks: list[str], tmp_path: Path, monkeypatch) -> None:
    missing = [m for m in _needs(blocks) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{title}: needs {', '.join(missing)}")
    (tmp_path / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    namespace: dict = {"__name__": "__integrations__"}
    for number, code in enumerate(blocks, 1):
        exec(compile(code, f"integrations.md [{title} #{number}]", "exec"), namespace)  # noqa: S102
