"""Compressed tiers of sample_data for the tests: `quantize` through the command line, as a user runs it."""

from __future__ import annotations

from typer.testing import CliRunner

from maxsim_cli.cli import app


def quantize(source: str, folder: str, bits: int, device: str = "cpu") -> None:
    """``maxsim quantize SOURCE -o FOLDER --bits BITS`` on ``device`` (64 centroids for 2 bits), quietly."""
    args = ["quantize", source, "-o", folder, "--bits", str(bits), "-q", "--sample-queries", "0"]
    result = CliRunner().invoke(app, [*args, "--centroids", "64", "--device", device])
    assert result.exit_code == 0, result.output
