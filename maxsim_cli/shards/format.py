"""The shard format v1: its constants, metadata keys and the rules every shard obeys, with the checks
that readers and writers share (metadata, ids, offsets, counts, values), and the data types
`ShardInfo` and `DocBatch`. The byte layout of the containers and every rule is in `docs/format.md`.

Importing this module imports no torch: the value checks are given tensors (torch is loaded by then),
and `torch_dtypes()` imports it on first use.
"""

from __future__ import annotations

import functools
import os
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxsim_cli.arrays import array_values, strings_array
from maxsim_cli.codecs import (
    CODE_QUANTIZATIONS,
    CODEBOOK_KEY,
    CODEBOOK_SHA256_KEY,
    CODES_VERSION,
    CODES_VERSION_KEY,
    NUM_CENTROIDS_KEY,
    SOURCE_DOCS_KEY,
    SOURCE_GENERATION_KEY,
    SOURCE_IDS_KEY,
    code_width,
    has_scales,
)
from maxsim_cli.errors import InputError

if TYPE_CHECKING:
    import torch

FORMAT_NAME = "maxsim-shard"
FORMAT_VERSION = "1"
CORPUS_FORMAT_NAME = "maxsim-corpus"
CORPUS_FORMAT_VERSION = 1
MANIFEST_NAME = "index.json"

DTYPES = ("float16", "bfloat16", "float32", "int8", "uint8")  # uint8: codes below 8 bits (codecs.py)
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
QUANTIZATIONS = ("none", "int8-per-token", *CODE_QUANTIZATIONS)
FORMATS = ("safetensors", "arrow", "parquet", "arrow-stream")
SHARD_SUFFIXES = {".safetensors": "safetensors", ".arrow": "arrow", ".parquet": "parquet"}

# Arrow list offsets are int32 and count tokens (the inner fixed_size_list holds one token's `dim`
# values), so an Arrow or Parquet shard holds at most 2^31 - 1 tokens.
MAX_ARROW_TOKENS = 2**31 - 1
# safetensors refuses headers above 100 MB; ours are a few hundred bytes.
MAX_SAFETENSORS_HEADER = 100_000_000
# A token counts as L2-normalised when | ||x||_2 - 1 | <= this. bf16 rounds each component with relative
# error <= 2^-9, which moves the norm of a unit vector by at most ~2e-3; 1e-2 leaves room for that.
NORM_TOLERANCE = 1e-2
# Optional metadata of image-patch shards (ColPali): the patch grid "ROWSxCOLS", and the index of the token
# of the first patch (tokens before it, and past the grid, are not patches). docs/format.md, "Metadata".
PATCH_GRID_KEY = "patch_grid"
PATCH_START_KEY = "patch_start"


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """The torch dtype of each shard dtype: a function, not a constant, so that importing the format
    imports no torch (commands that score nothing start without it)."""
    import torch

    return {
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "int8": torch.int8,
        "uint8": torch.uint8,
    }


# safetensors' dtype names: of a shard's dtypes, the reverse, and the bytes per value of every dtype.
SAFETENSORS_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "int8": "I8", "uint8": "U8"}
SAFETENSORS_DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
SAFETENSORS_ITEMSIZE = {
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "I8": 1,
    "I64": 8,
    "U8": 1,
    "F64": 8,
    "I32": 4,
    "I16": 2,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
# Arrow has no bfloat16: bf16 values travel as their raw 16 bits in uint16.
ARROW_VALUE_TYPES = {
    "float16": pa.float16(),
    "bfloat16": pa.uint16(),
    "float32": pa.float32(),
    "int8": pa.int8(),
    "uint8": pa.uint8(),
}
_NUMPY_STORAGE = {
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
    "int8": np.int8,
    "uint8": np.uint8,
}

# What an id may not hold (docs/format.md, "Logical content"): whitespace (`str.isspace()`: TREC fields are
# whitespace-separated), control characters (C0, DEL, C1: a NUL cuts a C string, a newline a run line) and
# the invisible zero-width characters U+200B..U+200D, U+2060, U+FEFF (two ids that print alike but differ).
ID_FORBIDDEN = re.compile(r"[\s\x00-\x1f\x7f-\x9f\u200b-\u200d\u2060\ufeff]")
# The same characters in RE2 syntax (Arrow's regexes): RE2's \s is ASCII only, \p{Z} adds the rest of
# `str.isspace()` beyond the control characters.
ID_FORBIDDEN_RE2 = r"[\s\x00-\x1f\x7f-\x9f\p{Z}\x{200B}-\x{200D}\x{2060}\x{FEFF}]"
# The forbidden characters that are not whitespace: what is left inside a field once a line is split.
ID_FORBIDDEN_NOT_SPACE = re.compile(r"[\x00-\x08\x0e-\x1b\x7f-\x84\x86-\x9f\u200b-\u200d\u2060\ufeff]")
# Former names, kept for code that imported them: they now match every forbidden character.
ID_WHITESPACE = ID_FORBIDDEN
ID_WHITESPACE_RE2 = ID_FORBIDDEN_RE2
_ASCII_FORBIDDEN = np.zeros(256, dtype=bool)
_ASCII_FORBIDDEN[0x00:0x21] = True  # the C0 controls and space (tab, newline, ... among them)
_ASCII_FORBIDDEN[0x7F] = True
ID_RULE = "ids must be non-empty, without whitespace, control or zero-width characters (docs/format.md)"


def id_problem(value: str) -> str | None:
    """What makes ``value`` unfit to be an id (a document id, a query id, a TREC field), or None:
    "is empty", or which forbidden character it holds (`ID_FORBIDDEN`) and where."""
    if not value:
        return "is empty"
    found = ID_FORBIDDEN.search(value)
    if found is None:
        return None
    char = found.group()
    if char.isspace():
        kind = "whitespace"
    elif unicodedata.category(char) == "Cc":
        kind = "a control character"
    else:
        kind = "an invisible zero-width character"
    name = unicodedata.name(char, "")
    return f"contains {kind}, U+{ord(char):04X}{f' {name}' if name else ''}, at character {found.start()}"


def check_id(path: str, value: str, position: str, *, what: str = "id") -> None:
    """Raise `InputError` (one line: ``path``, the id shown with escapes, ``position`` such as
    "at index 7" or "on line 3") when `id_problem` finds something; the one id check every reader and
    writer shares."""
    if not value:
        raise input_error(path, f"empty {what} {position}; every document needs an id")
    problem = id_problem(value)
    if problem is not None:
        raise input_error(path, f"{what} {show_id(value)} {position} {problem}; {ID_RULE}")


def read_id_file(path: str, label: str = "") -> list[str]:
    """The ids of a file of ids, one a line (``-``: standard input), as ``maxsim delete --ids`` and the
    filters' ``--include-ids`` / ``--exclude-ids`` take them: blank lines skipped, spaces around an id
    and a UTF-8 byte-order mark ignored, each id checked as a shard's are (`check_id`, naming the line).
    Messages start with ``label`` (the option) and the file's name."""
    name = "<stdin>" if path == "-" else path
    where = f"{label} {name}" if label else name
    fix = "give a file of ids, one a line, or '-' for standard input"
    try:
        if path == "-":
            import sys

            if sys.stdin is None or not hasattr(sys.stdin, "buffer"):
                raise InputError(f"{where}: no standard input to read the ids from; {fix}")
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except FileNotFoundError:
        raise InputError(f"{where}: cannot read it: no such file; {fix}") from None
    except IsADirectoryError:
        raise InputError(f"{where}: cannot read it: is a folder; {fix}") from None
    except OSError as exc:
        raise InputError(f"{where}: cannot read it ({exc.strerror or type(exc).__name__}); {fix}") from None
    ids = _plain_ids(data)
    if ids is not None:
        return ids
    ids = []
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise InputError(f"{where}: line {number} is not valid UTF-8; give one id a line") from None
        if number == 1:
            text = text.removeprefix("\ufeff")
        if text:
            check_id(where, text, f"on line {number}")
            ids.append(text)
    return ids


# Line breaks of Python's str.splitlines that bytes.splitlines (the lines `read_id_file` numbers) does not
# break at; ids hold none of them (they are whitespace or control characters)
_OTHER_BREAKS = re.compile("[\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def _plain_ids(data: bytes) -> list[str] | None:
    """`read_id_file`'s ids when every line is valid (one decode, one split, one check of all the ids:
    ~2x faster for 100,000 ids); None when a line is not, for the line-by-line reading that names it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if _OTHER_BREAKS.search(text):
        return None
    ids = [line.strip() for line in text.splitlines()]
    if ids:
        ids[0] = ids[0].removeprefix("\ufeff")
    ids = [i for i in ids if i]
    return None if ID_FORBIDDEN.search("".join(ids)) else ids


def one_line(text: object, limit: int = 200) -> str:
    """Collapse a library's (possibly multi-line) message into one short line."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def input_error(path: str, message: str) -> InputError:
    """An `InputError` whose one line names the file (or stream) first: `path: message`."""
    return InputError(f"{path}: {message}")


def show_id(doc_id: str) -> str:
    """An id for an error message: quoted, escapes visible, never more than one line."""
    text = repr(doc_id)
    return text if len(text) <= 80 else text[:77] + "..."


# ----------------------------------------------------------------------------------------------------
# Public data types
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardInfo:
    """What a shard holds, from its metadata (checked against its contents on open)."""

    path: str
    format: str  # "safetensors" | "arrow" | "parquet" | "arrow-stream"
    num_docs: int
    num_tokens: int
    dim: int
    dtype: str  # one of DTYPES
    quantization: str  # "none" | "int8-per-token"
    normalized: bool
    encoder: str | None
    patch_grid: tuple[int, int] | None = None  # (rows, cols) of image patches, from `patch_grid`
    patch_start: int = 0  # the token of the first patch, from `patch_start`
    # residual2 codes (docs/format.md, "Codes below 8 bits"): the codebook file beside the shard, its
    # sha256 and number of centroids, from the metadata
    codebook: str | None = None
    codebook_sha256: str | None = None
    num_centroids: int = 0
    # a quantized shard: the corpus it was made from, (documents, sha256 of the ids in order)
    source: tuple[int, str] | None = None
    # ... and that corpus's committed generation (None: not recorded, a tier quantized before generations)
    source_generation: int | None = None

    @property
    def width(self) -> int:
        """Values (bytes, for codes) a token takes in `embeddings`: dim except for codes below 8 bits."""
        return code_width(self.quantization, self.dim)

    @property
    def scaled(self) -> bool:
        """Whether the shard carries one fp32 scale a token (int8 and int4)."""
        return has_scales(self.quantization)


@dataclass
class DocBatch:
    """Consecutive (or gathered) documents, packed: document i is `embeddings[offsets[i]:offsets[i+1]]`.

    `embeddings` is a contiguous CPU tensor `[T, dim]` in the shard's dtype; `offsets` int64 `[n+1]` with
    `offsets[0] == 0` and `offsets[-1] == T`; `scales` float32 `[T]` for int8 shards (`x ≈ q * scale`),
    else None; `first_doc` is the index of `ids[0]` in its shard. `encoder` and `normalized` are what the
    metadata of the file it came from says (a query file's, for the checks against a corpus), None when
    unknown (vectors from memory).
    """

    ids: list[str]
    embeddings: torch.Tensor
    offsets: torch.Tensor
    scales: torch.Tensor | None
    first_doc: int = 0
    encoder: str | None = None
    normalized: bool | None = None

    @property
    def num_docs(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return int(self.embeddings.shape[0])

    def lengths(self) -> torch.Tensor:
        """Tokens per document, int64 `[n]`."""
        return self.offsets[1:] - self.offsets[:-1]


# ----------------------------------------------------------------------------------------------------
# Validation shared by readers and writers
# ----------------------------------------------------------------------------------------------------


def parse_metadata(path: str, meta: dict[str, str] | None, where: str) -> dict[str, Any]:
    """Check the format v1 metadata keys; return them typed. `where` says where they live."""
    if not meta:
        raise input_error(path, f"no {where}; not a maxsim shard (see docs/format.md)")
    fmt = meta.get("format")
    if fmt != FORMAT_NAME:
        raise input_error(
            path,
            f"unknown format {fmt!r} in {where} (expected {FORMAT_NAME!r}); "
            "convert the file with `maxsim pack`",
        )
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise input_error(
            path,
            f"unsupported format_version {version!r} (this maxsim reads version "
            f"{FORMAT_VERSION}); upgrade maxsim or rewrite the shard",
        )
    dtype = meta.get("dtype")
    if dtype not in DTYPES:
        raise input_error(
            path, f"unsupported dtype {dtype!r} in {where} (expected one of {', '.join(DTYPES)})"
        )
    quantization = meta.get("quantization", "none")
    expected_q = "int8-per-token" if dtype == "int8" else "none"
    if dtype == "uint8":
        expected_q = quantization if quantization in CODE_QUANTIZATIONS else " or ".join(CODE_QUANTIZATIONS)
    if quantization != expected_q:
        raise input_error(
            path, f"quantization {quantization!r} does not fit dtype {dtype!r} (expected {expected_q!r})"
        )
    normalized = meta.get("normalized", "false")
    if normalized not in ("true", "false"):
        raise input_error(path, f"normalized must be 'true' or 'false', not {normalized!r}")
    values: dict[str, Any] = {
        "dtype": dtype,
        "quantization": quantization,
        "normalized": normalized == "true",
        "encoder": meta.get("encoder") or None,
    }
    for key in ("dim", "num_docs", "num_tokens"):
        text = meta.get(key)
        # ASCII digits only: str.isdigit() takes '²' too, which int() refuses
        if text is None or not (text.isascii() and text.isdigit()):
            raise input_error(path, f"{key} in {where} must be a non-negative integer, not {text!r}")
        values[key] = int(text)
    if values["dim"] < 1:
        raise input_error(path, "dim is 0 in metadata; a shard needs vectors of at least one value")
    values.update(_code_metadata(path, meta, where, quantization, values["dim"]))
    values["patch_grid"], values["patch_start"] = parse_patch_grid(
        meta.get(PATCH_GRID_KEY), meta.get(PATCH_START_KEY), f"{path}: {where}"
    )
    return values


def _code_metadata(
    path: str, meta: dict[str, str], where: str, quantization: str, dim: int
) -> dict[str, Any]:
    """The keys of a codes shard (docs/format.md, "Codes below 8 bits"), checked; `width`, the values a
    token takes in `embeddings`, and the `source` a quantized shard records, for every shard."""
    values: dict[str, Any] = {"width": code_width(quantization, dim), "codebook": None}
    values.update(codebook_sha256=None, num_centroids=0, source=_source(path, meta, where))
    generation = meta.get(SOURCE_GENERATION_KEY)
    if generation is not None and not (generation.isascii() and generation.isdigit()):
        raise input_error(
            path, f"{SOURCE_GENERATION_KEY} {generation!r} in {where} is not a whole number; quantize again"
        )
    values["source_generation"] = int(generation) if generation is not None else None
    if quantization not in CODE_QUANTIZATIONS:
        return values
    if meta.get(CODES_VERSION_KEY) != CODES_VERSION:
        raise input_error(
            path,
            f"{CODES_VERSION_KEY} {meta.get(CODES_VERSION_KEY)!r} in {where}: this maxsim reads codes "
            f"version {CODES_VERSION}; upgrade maxsim or quantize the float corpus again",
        )
    step = 2 if quantization == "int4-per-token" else 4
    if dim % step:
        raise input_error(
            path, f"dim {dim} of {quantization} codes is not a multiple of {step}; the file is damaged"
        )
    if quantization in ("residual2-kmeans", "int2-grid"):
        sha = meta.get(CODEBOOK_SHA256_KEY, "")
        count = meta.get(NUM_CENTROIDS_KEY, "")
        if not meta.get(CODEBOOK_KEY) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise input_error(
                path,
                f"{quantization} shard without {CODEBOOK_KEY} and {CODEBOOK_SHA256_KEY} (64 hex digits) in "
                f"{where}; quantize the float corpus again",
            )
        if quantization == "int2-grid":  # a grid, no centroids
            values.update(codebook=meta[CODEBOOK_KEY], codebook_sha256=sha)
            return values
        if not (count.isascii() and count.isdigit() and 0 < int(count) <= 2**32):
            raise input_error(path, f"{NUM_CENTROIDS_KEY} {count!r} in {where} is not a positive integer")
        values.update(codebook=meta[CODEBOOK_KEY], codebook_sha256=sha, num_centroids=int(count))
    return values


def _source(path: str, meta: dict[str, str], where: str) -> tuple[int, str] | None:
    """The source corpus a quantized shard records (`SOURCE_DOCS_KEY`, `SOURCE_IDS_KEY`), or None."""
    docs, sha = meta.get(SOURCE_DOCS_KEY), meta.get(SOURCE_IDS_KEY)
    if docs is None and sha is None:
        return None
    if not (docs and docs.isascii() and docs.isdigit() and sha and re.fullmatch(r"[0-9a-f]{64}", sha)):
        raise input_error(
            path,
            f"{SOURCE_DOCS_KEY} {docs!r} and {SOURCE_IDS_KEY} {sha!r} in {where}: expected a document count "
            "and 64 hex digits; the file is damaged: quantize again",
        )
    return int(docs), sha


def parse_patch_grid(grid: Any, start: Any, where: str) -> tuple[tuple[int, int] | None, int]:
    """The ``patch_grid`` ("ROWSxCOLS", or a (rows, cols) pair) and ``patch_start`` (a decimal string or
    an int, default 0) metadata as (rows, cols) or None, and the start; `InputError` naming ``where``
    for anything else."""
    if grid is None:
        if start is not None:
            raise InputError(f"{where}: {PATCH_START_KEY} without {PATCH_GRID_KEY}; give both or neither")
        return None, 0
    if isinstance(grid, str):
        found = re.fullmatch(r"([1-9][0-9]{0,5})x([1-9][0-9]{0,5})", grid)
        rows_cols = (int(found.group(1)), int(found.group(2))) if found else None
    elif (
        isinstance(grid, (tuple, list))
        and len(grid) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < 10**6 for n in grid)
    ):
        rows_cols = (int(grid[0]), int(grid[1]))
    else:
        rows_cols = None
    if rows_cols is None:
        raise InputError(
            f"{where}: {PATCH_GRID_KEY} {grid!r} is not ROWSxCOLS (two positive integers, e.g. '32x32')"
        )
    if start is None:
        return rows_cols, 0
    if isinstance(start, int) and not isinstance(start, bool) and start >= 0:
        return rows_cols, start
    if isinstance(start, str) and start.isascii() and start.isdigit() and len(start) <= 9:
        return rows_cols, int(start)
    raise InputError(f"{where}: {PATCH_START_KEY} {start!r} is not a non-negative integer")


def check_ids(path: str, ids: Sequence[str], *, what: str = "id") -> None:
    """Ids: `check_id` for each (non-empty, no whitespace, control or zero-width character), unique within
    the shard."""
    if not all(ids) or ID_FORBIDDEN.search("".join(ids)):
        for i, doc_id in enumerate(ids):
            check_id(path, doc_id, f"at index {i}", what=what)
    if len(set(ids)) != len(ids):
        first: dict[str, int] = {}
        for i, doc_id in enumerate(ids):
            if doc_id in first:
                raise input_error(
                    path,
                    f"duplicate {what} {show_id(doc_id)} at indices {first[doc_id]} and {i}; "
                    "ids must be unique",
                )
            first[doc_id] = i


class ArrowIds(Sequence[str]):
    """An Arrow string array read as a sequence of Python strings, one at a time (for messages that
    name a document, without a Python string per id)."""

    def __init__(self, array: pa.Array) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index):  # noqa: ANN001, ANN204
        if isinstance(index, slice):
            return self.array[index].to_pylist()
        return self.array[index].as_py()


def decode_ids(path: str, data: np.ndarray, id_offsets: np.ndarray) -> pa.Array:
    """Split the concatenated UTF-8 id bytes at `id_offsets` (int64 [N+1]) and check each id: the ids as
    an Arrow array (Python strings are made only where `Shard.ids` is asked for)."""
    n = len(id_offsets) - 1
    if n < 0 or id_offsets[0] != 0:
        raise input_error(path, "id_offsets must start at 0")
    steps = np.diff(id_offsets)
    if np.any(steps < 0):
        i = int(np.flatnonzero(steps < 0)[0])
        raise input_error(
            path,
            f"id_offsets are not monotonic at index {i} ({int(id_offsets[i])} then {int(id_offsets[i + 1])})",
        )
    if id_offsets[-1] != len(data):
        raise input_error(path, f"id_offsets end at {int(id_offsets[-1])} but ids hold {len(data)} bytes")
    if np.any(steps == 0):
        raise input_error(
            path, f"empty id at index {int(np.flatnonzero(steps == 0)[0])}; every document needs an id"
        )
    strings = pa.LargeStringArray.from_buffers(
        n, pa.py_buffer(np.ascontiguousarray(id_offsets, dtype=np.int64)), pa.py_buffer(data.tobytes())
    )
    try:
        strings.validate(full=True)
    except pa.ArrowInvalid:
        for i in range(n):
            raw = data[int(id_offsets[i]) : int(id_offsets[i + 1])].tobytes()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                raise input_error(
                    path,
                    f"id at index {i} (bytes {int(id_offsets[i])}..{int(id_offsets[i + 1])}) "
                    f"is not valid UTF-8: {raw[:40]!r}",
                ) from None
        raise
    if not _ids_pass(strings):
        check_ids(path, strings.to_pylist())  # names the offending id
    return strings


def _ids_pass(ids: pa.Array) -> bool:
    """Whether non-empty ids have no null, no forbidden character (`ID_FORBIDDEN`) and no duplicate,
    checked without a Python object per id; `check_ids` then names what fails. Duplicates: equal
    neighbours once sorted. 12.8K ids: 0.7 ms against 3.6 ms for Python's regex and set."""
    if len(ids) == 0:
        return True
    if ids.null_count or has_forbidden_chars(ids):
        return False
    return not has_equal_neighbours(ids.take(pc.sort_indices(ids)))


def string_bytes(strings: pa.Array) -> np.ndarray:
    """The concatenated UTF-8 values of an Arrow (large) string array, as a uint8 view of its data buffer
    (no copy)."""
    _, offsets_buffer, data_buffer = strings.buffers()
    if len(strings) == 0 or data_buffer is None:
        return np.zeros(0, dtype=np.uint8)
    width = np.int64 if pa.types.is_large_string(strings.type) else np.int32
    offsets = np.frombuffer(offsets_buffer, dtype=width)[strings.offset : strings.offset + len(strings) + 1]
    return np.frombuffer(data_buffer, dtype=np.uint8)[int(offsets[0]) : int(offsets[-1])]


def has_forbidden_chars(strings: pa.Array) -> bool:
    """Whether any value holds a character that ids may not hold (`ID_FORBIDDEN`): a byte table over the
    data when every byte is ASCII, Arrow's regex (`ID_FORBIDDEN_RE2`) otherwise."""
    data = string_bytes(strings)
    if len(data) and int(data.max()) < 0x80:
        # ASCII: the forbidden bytes (`_ASCII_FORBIDDEN`) are those up to the space, and DEL
        return int(data.min()) <= 0x20 or bool((data == 0x7F).any())
    return bool(pc.any(pc.match_substring_regex(strings, ID_FORBIDDEN_RE2)).as_py())


has_whitespace = has_forbidden_chars  # the former name


# Sorting the ids shard by shard pays from this many threads, or from this many ids on fewer threads:
# 8.8M ids 1.40 s against 3.64 for one sort on the 16-core H200 host
# (benchmarks/results/host/id-sort-h200-host.json), but 244K ids 0.094 s against 0.077 on 2 cores
# (docs/kernel-notes.md, "`maxsim score`: the host-side constants").
BY_SHARD_SORT_MIN_THREADS = 4
BY_SHARD_SORT_MIN_IDS = 1_000_000


def concat_ids(shard_ids: Sequence[pa.Array]) -> pa.Array:
    """Per-shard id arrays as one large_string array, in order."""
    if not shard_ids:
        return strings_array([])
    return pa.concat_arrays([a.cast(pa.large_string()) for a in shard_ids])


def sorted_id_order(shard_ids: Sequence[pa.Array]) -> tuple[pa.Array, np.ndarray, pa.Array]:
    """(all ids as one large_string array, the ordinals sorted by id (ascending UTF-8 bytes: Python's str
    order and trec_eval's strcmp), the ids in that order) for per-shard id arrays.

    With enough threads or ids, each shard's ids are sorted in a thread of their own (Arrow releases the
    GIL) and the concatenated sorted runs are sorted once more, which Arrow does ~3x faster than ids in
    no order. The order is the same as one sort of all ids, as long as the ids are unique (equal ids
    are refused by the caller)."""
    arrays = [a.cast(pa.large_string()) for a in shard_ids]
    ids = concat_ids(arrays)
    threads = min(len(arrays), os.cpu_count() or 1)
    if threads < 2 or (threads < BY_SHARD_SORT_MIN_THREADS and len(ids) < BY_SHARD_SORT_MIN_IDS):
        order = pc.sort_indices(ids)
        return ids, array_values(order).astype(np.int64), ids.take(order)

    def sort_run(values: pa.Array) -> tuple[np.ndarray, pa.Array]:
        run_order = pc.sort_indices(values)
        return array_values(run_order).astype(np.int64), values.take(run_order)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, thread_name_prefix="maxsim-ids") as pool:
        runs = list(pool.map(sort_run, arrays))
    starts = np.cumsum([0] + [len(a) for a in arrays[:-1]])
    ordinal_of_run = np.concatenate([order + start for (order, _), start in zip(runs, starts, strict=True)])
    sorted_runs = pa.concat_arrays([values for _, values in runs])
    order = pc.sort_indices(sorted_runs)
    return ids, ordinal_of_run[array_values(order)], sorted_runs.take(order)


def has_equal_neighbours(values: pa.Array) -> bool:
    """Whether two consecutive values are equal (in sorted values: a duplicate)."""
    return len(values) > 1 and pc.any(pc.equal(values.slice(1), values.slice(0, len(values) - 1))).as_py()


def check_offsets(path: str, offsets: np.ndarray, ids: Sequence[str], num_tokens: int) -> None:
    """offsets int64 [N+1]: start at 0, end at T, strictly increasing (no empty document)."""
    if offsets.ndim != 1 or len(offsets) != len(ids) + 1:
        raise input_error(
            path,
            f"offsets has {len(offsets)} entries but the shard has {len(ids)} ids; expected num_docs + 1",
        )
    if offsets[0] != 0:
        raise input_error(
            path, f"offsets start at {int(offsets[0])}, not 0 (offset 0 of document {show_id(ids[0])})"
        )
    steps = np.diff(offsets)
    bad = np.flatnonzero(steps <= 0)
    if bad.size:
        i = int(bad[0])
        if steps[i] < 0:
            raise input_error(
                path,
                f"offsets are not monotonic: offsets[{i + 1}] = {int(offsets[i + 1])} < "
                f"offsets[{i}] = {int(offsets[i])} (document {show_id(ids[i])}, index {i})",
            )
        raise input_error(
            path,
            f"document {show_id(ids[i])} (index {i}, offset {int(offsets[i])}) has zero "
            "tokens; every document needs at least one token vector",
        )
    if offsets[-1] != num_tokens:
        raise input_error(path, f"offsets end at {int(offsets[-1])} but embeddings hold {num_tokens} tokens")


def check_counts(path: str, meta: dict[str, Any], num_docs: int, num_tokens: int, dim: int) -> None:
    """The metadata's num_docs, num_tokens and dim are what the file holds."""
    for key, actual in (("num_docs", num_docs), ("num_tokens", num_tokens), ("dim", dim)):
        if meta[key] != actual:
            raise input_error(path, f"metadata says {key}={meta[key]} but the file holds {actual}")


def first_nonfinite_row(values: torch.Tensor | np.ndarray) -> int | None:
    """Index of the first row holding NaN/Inf, or None. One float32 sum first: cheap, no mask. Takes a
    numpy array too (`maxsim serve`'s HTTP workers check requests without torch)."""
    if isinstance(values, np.ndarray):
        if values.size == 0 or values.dtype in (np.int8, np.uint8):
            return None
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(values.sum(dtype=np.float32)):
                return None
        bad = np.flatnonzero(~np.isfinite(values.reshape(values.shape[0], -1)).all(axis=1))
        return int(bad[0]) if bad.size else None
    import torch

    if values.numel() == 0 or values.dtype in (torch.int8, torch.uint8):
        return None
    if torch.isfinite(values.sum(dtype=torch.float32)):
        return None
    # The sum is NaN/Inf: find the row (an overflowing sum of finite values finds none).
    flat = values.reshape(values.shape[0], -1)
    chunk = max(1, (1 << 22) // max(1, flat.shape[1]))  # bounded temporary mask
    for start in range(0, flat.shape[0], chunk):
        bad = (~torch.isfinite(flat[start : start + chunk])).any(dim=1).nonzero()
        if bad.numel():
            return start + int(bad[0, 0])
    return None


def check_values(
    path: str,
    embeddings: torch.Tensor | np.ndarray,
    scales: torch.Tensor | np.ndarray | None,
    offsets: np.ndarray,
    ids: Sequence[str],
    first_doc: int,
    *,
    what: str = "document",
) -> None:
    """NaN/Inf in the values (or NaN/Inf/negative int8 scales): name the document (``what``: a
    ``"query"`` for queries from memory or a request) and its token. Torch tensors on the CPU or numpy
    arrays (float values: bfloat16 as float32)."""
    for tensor, problem in ((embeddings, "NaN or Inf values"), (scales, "a NaN or Inf scale")):
        if tensor is None:
            continue
        row = first_nonfinite_row(tensor)
        if row is not None:
            doc = int(np.searchsorted(offsets, row, side="right")) - 1
            raise input_error(
                path,
                f"{what} {show_id(ids[doc])} (index {first_doc + doc}) has {problem} at token "
                f"{row - int(offsets[doc])}; re-encode or drop that {what}",
            )
    if scales is not None and hasattr(scales, "cpu"):  # a tensor, on any device
        scales = scales.cpu()
    negative = None if scales is None else np.flatnonzero(np.asarray(scales) < 0)
    if negative is not None and negative.size:
        row = int(negative[0])
        doc = int(np.searchsorted(offsets, row, side="right")) - 1
        raise input_error(
            path,
            f"{what} {show_id(ids[doc])} (index {first_doc + doc}) has a negative int8 scale "
            f"at token {row - int(offsets[doc])}; scales are max|x|/127 >= 0",
        )
