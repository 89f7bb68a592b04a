"""Commands that score nothing do not import the scoring stack (torch, triton).

Each case runs in a fresh interpreter (this test process has long imported torch): it imports the CLI or
runs `maxsim_cli.cli.main` with some arguments, then reports the exit code and which of the scoring
modules `sys.modules` holds. `maxsim --help` then starts in a fraction of `import torch`'s time
(benchmarks/bench_cli_startup.py measures it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from maxsim_cli.cli import COMMAND_MODULES

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data"
SCORING_STACK = ("torch", "triton")

# The child writes {"exit": code, "imported": [...]} to the file named by its first argument; the second is
# the arguments of `main` (null: only import the CLI), the third the modules to look for.
_CHILD = r"""
import json, sys

out, argv, watched = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
code = 0
if argv is None:
    import maxsim_cli.cli
else:
    from maxsim_cli.cli import main

    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
imported = [name for name in watched if name in sys.modules]
with open(out, "w") as f:
    json.dump({"exit": code, "imported": imported}, f)
"""


def _run_fresh(tmp_path: Path, argv: list[str] | None) -> dict:
    """Run `_CHILD` in a new interpreter; fail with its output if it did not report."""
    out = tmp_path / "child.json"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(out), json.dumps(argv), json.dumps(SCORING_STACK)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.exists(), f"child failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(out.read_text())
    result["output"] = proc.stdout + proc.stderr
    return result


def _assert_light(result: dict) -> None:
    assert result["exit"] == 0, result["output"]
    assert not result["imported"], f"imported {result['imported']}"


@pytest.fixture
def small_runs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A run of the first three queries of sample_data/candidates.trec, and two disjoint halves of it."""
    lines = []
    for line in (SAMPLE / "candidates.trec").read_text().splitlines():
        if line.split()[0] not in ("q001", "q002", "q003"):
            break
        lines.append(line)
    assert lines
    run = tmp_path / "run.trec"
    run.write_text("\n".join(lines) + "\n")
    part0, part1 = tmp_path / "part-0.trec", tmp_path / "part-1.trec"
    part0.write_text("".join(line + "\n" for line in lines[0::2]))
    part1.write_text("".join(line + "\n" for line in lines[1::2]))
    return run, part0, part1


def test_import_cli(tmp_path: Path) -> None:
    _assert_light(_run_fresh(tmp_path, None))


def test_help(tmp_path: Path) -> None:
    _assert_light(_run_fresh(tmp_path, ["--help"]))


def test_version(tmp_path: Path) -> None:
    _assert_light(_run_fresh(tmp_path, ["--version"]))


@pytest.mark.parametrize("name", COMMAND_MODULES)
def test_command_help(tmp_path: Path, name: str) -> None:
    _assert_light(_run_fresh(tmp_path, [name, "--help"]))


def test_eval(tmp_path: Path, small_runs: tuple[Path, Path, Path]) -> None:
    run, _, _ = small_runs
    result = _run_fresh(tmp_path, ["eval", str(run), str(SAMPLE / "qrels.txt"), "--json"])
    _assert_light(result)
    assert "nDCG@10" in result["output"]


def test_merge(tmp_path: Path, small_runs: tuple[Path, Path, Path]) -> None:
    _, part0, part1 = small_runs
    merged = tmp_path / "merged.trec"
    _assert_light(_run_fresh(tmp_path, ["merge", str(part0), str(part1), "-k", "10", "-o", str(merged)]))
    assert len(merged.read_text().splitlines()) == 30


def test_inspect_without_value_checks(tmp_path: Path) -> None:
    result = _run_fresh(tmp_path, ["inspect", str(SAMPLE / "corpus"), "--no-check-values", "--json"])
    _assert_light(result)
    assert '"values_checked": false' in result["output"]


def test_help_defaults_repeated_in_the_commands_agree_with_the_library() -> None:
    """`verify` and `quantize` repeat a default of their library module so that `--help` stays light."""
    from maxsim_cli import quantize, verify
    from maxsim_cli.commands import quantize as quantize_command
    from maxsim_cli.commands import verify as verify_command

    assert verify_command.DEFAULT_BATCH_TOKENS == verify.DEFAULT_BATCH_TOKENS
    assert quantize_command.DEFAULT_BATCH_TOKENS == quantize.DEFAULT_BATCH_TOKENS


def _assert_no_triton(tmp_path: Path, steps: list[list[str]], script: str) -> None:
    """Each CLI command of ``steps`` in a fresh process exits 0 having imported torch and no Triton, and
    ``script`` (API calls) leaves triton out of ``sys.modules``."""
    for argv in steps:
        result = _run_fresh(tmp_path, argv)
        assert result["exit"] == 0, result["output"]
        assert result["imported"] == ["torch"], f"{argv[:2]} imported {result['imported']}"
    script += '\nimport sys\nprint("triton" in sys.modules)\n'
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False"]


def test_cpu_scoring_of_float_and_int8_corpora_imports_no_triton(tmp_path: Path) -> None:
    """`maxsim quantize` and `maxsim score` of float and int8 corpora on the CPU run no Triton kernel and
    import no Triton (~0.15 s of the quickstart's int8 `score` on the 2-core machine); the int8 API's
    paths on CPU tensors (a few query rows, many, argmax, candidates) neither."""
    int8_dir, run = tmp_path / "int8", tmp_path / "run.trec"
    steps = [
        ["quantize", str(SAMPLE / "corpus"), "-o", str(int8_dir)],
        ["score", str(SAMPLE / "queries.safetensors"), str(SAMPLE / "corpus"), "-k", "5", "-o", str(run)],
        ["score", str(SAMPLE / "queries.safetensors"), str(int8_dir), "-k", "5", "-o", str(run)],
    ]
    script = """
import torch
import maxsim_kernels as mk
from maxsim_kernels.int8_host import quantize_per_token

gen = torch.Generator().manual_seed(0)
docs, queries = torch.randn(50, 40, generator=gen), torch.randn(300, 40, generator=gen)
d8, sd = quantize_per_token(docs)
d_off, few, many = torch.tensor([0, 20, 50]), torch.tensor([0, 3, 7]), torch.tensor([0, 150, 300])
mk.maxsim_varlen(queries[:7], few, d8, d_off, doc_scales=sd)
mk.maxsim_varlen(queries, many, d8, d_off, doc_scales=sd)
mk.maxsim_varlen(queries[:7], few, d8, d_off, doc_scales=sd, return_argmax=True)
cand_off, cand_docs = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
mk.maxsim_candidates(queries[:7], few, d8, d_off, cand_off, cand_docs, doc_scales=sd)
"""
    _assert_no_triton(tmp_path, steps, script)
    assert run.stat().st_size > 0


def test_cpu_scoring_of_4_and_2_bit_corpora_imports_no_triton(tmp_path: Path) -> None:
    """`maxsim quantize --bits 4` and `--bits 2`, `maxsim score` of those tiers and the two-stage search
    from the 2-bit tier on the CPU import no Triton (~0.15 s a run on the 2-core machine); the codes API's
    paths on CPU tensors (int4, int2 and residual2; a few query rows, many, candidates) neither."""
    bits4, bits2, run = tmp_path / "bits4", tmp_path / "bits2", tmp_path / "run.trec"
    queries, corpus = str(SAMPLE / "queries.safetensors"), str(SAMPLE / "corpus")
    steps = [
        ["quantize", corpus, "-o", str(bits4), "--bits", "4"],
        ["quantize", corpus, "-o", str(bits2), "--bits", "2"],
        ["score", queries, str(bits4), "-k", "5", "-o", str(run)],
        ["score", queries, str(bits2), "-k", "5", "-o", str(run)],
        ["score", queries, str(bits2), "-k", "5", "--exact-from", corpus, "-o", str(run)],
    ]
    script = """
import torch
import maxsim_kernels as mk
from maxsim_kernels.code_packing import (
    Int2Levels, ResidualCodebook, encode_int2, encode_int4, encode_residual2,
)

gen = torch.Generator().manual_seed(0)
docs, queries = torch.randn(50, 40, generator=gen), torch.randn(300, 40, generator=gen)
c4, s4 = encode_int4(docs)
levels = Int2Levels(torch.zeros(40), torch.full((40,), 0.5))
c2, s2 = encode_int2(docs, levels)
weights, cutoffs = torch.tensor([-1.0, -0.3, 0.3, 1.0]), torch.tensor([-0.5, 0.0, 0.5])
book = ResidualCodebook(torch.randn(3, 40, generator=gen).half(), weights.repeat(40, 1))
ids = torch.randint(0, 3, (50,), generator=gen)
r2 = encode_residual2(docs, ids, book.centroids, cutoffs.repeat(40, 1))
d_off, few, many = torch.tensor([0, 20, 50]), torch.tensor([0, 3, 7]), torch.tensor([0, 150, 300])
cand_off, cand_docs = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
tiers = [(c4, {"doc_scales": s4}), (c2, {"doc_scales": s2, "codebook": levels}), (r2, {"codebook": book})]
for codes, kw in tiers:
    mk.maxsim_varlen(queries[:7], few, codes, d_off, **kw)
    mk.maxsim_varlen(queries, many, codes, d_off, **kw)
    mk.maxsim_candidates(queries[:7], few, codes, d_off, cand_off, cand_docs, **kw)
"""
    _assert_no_triton(tmp_path, steps, script)
    assert run.stat().st_size > 0
