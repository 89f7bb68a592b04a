"""Compressed tiers of sample_data for the tests: `quantize` through the command line, as a user runs it;
the shard surgery their fault tests share, the check of codes' scores against a float64 reference, and the
stream kernel's configurations with and without a producer warp that the codes' GPU tests compare."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.errors import InputError
from maxsim_cli.shards import open_corpus

# `maxsim_int8_hopper_stream.stream_with_tiles` keywords: the ring filled by a producer warp or by the
# scanning warps, with each walk of one query, short programs and a shallow ring
PRODUCER_CONFIGS = (
    dict(producer=False),
    dict(producer=True, table=False),
    dict(producer=True, table=True),
    dict(producer=True, items_per_prog=1),
    dict(producer=True, items_per_prog=8, stages=3),
    dict(producer=True, items_per_prog=32, stages=2),
)


def quantize(source: str, folder: str, bits: int, device: str = "cpu", codec: str = "residual2") -> None:
    """``maxsim quantize SOURCE -o FOLDER --bits BITS`` on ``device`` (2 bits: ``codec``, residual2 with 64
    centroids), quietly."""
    args = ["quantize", source, "-o", folder, "--bits", str(bits), "-q", "--sample-queries", "0"]
    if bits == 2:
        args += ["--codec", codec, *(["--centroids", "64"] if codec == "residual2" else [])]
    result = CliRunner().invoke(app, [*args, "--device", device])
    assert result.exit_code == 0, result.output


def rewrite_metadata(path: str, changes: dict[str, str]) -> None:
    """Change metadata values of a safetensors shard in place (same header length: values padded)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header["__metadata__"].update(changes)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    data[8 : 8 + length] = text + b" " * (length - len(text))
    with open(path, "wb") as f:
        f.write(data)


def one_line_open_error(paths: list[str]) -> str:
    """The InputError opening ``paths`` raises, checked to be one line."""
    with pytest.raises(InputError) as err, open_corpus(paths):
        pass
    assert "\n" not in str(err.value)
    return str(err.value)


def check_close(scores: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor) -> None:
    """``scores`` within ``bound`` of the float64 ``reference`` where it is finite, equal where it is not
    (-inf for empty documents)."""
    finite = torch.isfinite(reference)
    assert torch.equal(torch.isfinite(scores), finite)
    assert torch.equal(scores[~finite], reference[~finite].float())
    err = (scores.double() - reference).abs().where(finite, torch.zeros_like(reference))
    assert bool((err <= bound.expand_as(err)).all()), float((err / bound).max())
