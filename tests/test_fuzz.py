"""The seeded fuzz harness (`tests/fuzzing.py`) at CI size: mutated JSON and Arrow bodies against a real
``maxsim serve``, mutated safetensors and Arrow shards (and Arrow query streams on ``maxsim score -``'s
stdin) opened and scored through the library and the command line, and odd arguments to the Python API.

Each test asserts that its target shows no crash, hang, 5xx answer, internal error, traceback, wrong
answer or error of more than one line; on failure the message is the report, with one line per kind of
failure and the command that reproduces its first case (``python -m tests.fuzz --seed S --target T
--case=I -v``). ``MAXSIM_FUZZ_SEED`` changes the seed (default 1), ``MAXSIM_FUZZ_CASES`` the number of
cases drawn and shared among the three targets (default 240; ``python -m tests.fuzz --cases 20000`` for a
long run). Every run also makes the cases built on purpose from inputs that once failed (numbered -N..-1).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fuzzing import TARGETS, default_cases, run_fuzz  # noqa: E402

SEED = int(os.environ.get("MAXSIM_FUZZ_SEED", "1"))
CASES = int(os.environ.get("MAXSIM_FUZZ_CASES", "240"))


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_fuzz(target: str, tmp_path) -> None:
    report = run_fuzz(SEED, {target: default_cases(CASES)[target]}, workdir=tmp_path)
    text = report.text()
    print(text)
    assert not report.harness_errors, text
    assert report.tallies[target].cases > 0
    assert report.failures == 0, text
