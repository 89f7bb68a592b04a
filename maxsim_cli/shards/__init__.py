"""Shards of packed variable-length token embeddings (format v1): read, validate, write.

A shard holds N documents (or queries) with T token vectors of `dim` values in total, stored packed:
document i owns rows `offsets[i]:offsets[i+1]` of the `[T, dim]` matrix `embeddings`, with
`offsets[0] == 0`, `offsets[N] == T` and every document at least one token long. int8 shards carry one
float32 scale per token; a token is `x ≈ q * scale` with `scale = max|x| / 127`. The byte layout of the
three containers (safetensors, Arrow IPC, Parquet) and every rule checked here is in `docs/format.md`.

Readers validate structure on open in O(N) (never touching the T x dim values), read only the
document range they are asked for (memory-mapped safetensors slices, zero-copy Arrow record batches,
one Parquet row group at a time), and check each range they return for NaN/Inf. Writers validate the
same rules and write atomically: a temp file in the target directory, then `os.replace`.

Every problem with a user's file is an `InputError` with a one-line message naming the file and the
document id or offset. Nothing is ever unpickled.

The parts, each importing only those above it:

- `format`: constants, metadata parsing, id / offset / count / value checks, `ShardInfo`, `DocBatch`.
- `shard`: `Shard`, what every reader is, and reading a file's bytes while it may change.
- `safetensors_shard`, `arrow_shards`: `SafetensorsShard`; `ArrowShard` and `ParquetShard`.
- `readers`: `open_shard` (the container sniffed from the file's bytes), `read_queries`.
- `memory`: embeddings from memory packed and checked (`Queries.from_embeddings`,
  `Corpus.from_embeddings`), `MemoryShard`, the shard of an in-memory corpus.
- `corpus`: `Corpus`, `open_corpus`, the `index.json` manifest, `check_same_dim`, `check_kernel_dim`.
- `files`: atomic output (temp file or folder next to the target, then `os.replace`).
- `inputs`: arrays, tensors and masks from users as tensors (`infer_dtype`), the all-zero rows warning.
- `sinks`: the safetensors and Arrow IPC / Parquet file writers under `ShardWriter`, `arrow_schema`.
- `writers`: `ShardWriter`, `write_shard`, `write_manifest`.

Importing this package imports no torch, nor does opening a corpus and reading its ids and offsets
(what `maxsim inspect` does without value checks): torch comes in when token rows are read or written.
Every name is re-exported here; import from `maxsim_cli.shards`.
"""

from maxsim_cli.shards.arrow_shards import ArrowShard, ParquetShard
from maxsim_cli.shards.corpus import (
    Corpus,
    InputNote,
    check_kernel_dim,
    check_same_dim,
    input_notes,
    list_shard_files,
    open_corpus,
    read_manifest,
    report_notes,
)
from maxsim_cli.shards.files import current_umask, staging_dir, write_text_atomic
from maxsim_cli.shards.format import (
    BY_SHARD_SORT_MIN_IDS,
    BY_SHARD_SORT_MIN_THREADS,
    CORPUS_FORMAT_NAME,
    CORPUS_FORMAT_VERSION,
    DTYPES,
    FLOAT_DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    FORMATS,
    ID_FORBIDDEN,
    ID_FORBIDDEN_NOT_SPACE,
    ID_FORBIDDEN_RE2,
    ID_RULE,
    ID_WHITESPACE,
    ID_WHITESPACE_RE2,
    MANIFEST_NAME,
    MAX_ARROW_TOKENS,
    MAX_SAFETENSORS_HEADER,
    NORM_TOLERANCE,
    QUANTIZATIONS,
    SHARD_SUFFIXES,
    DocBatch,
    ShardInfo,
    check_id,
    concat_ids,
    first_nonfinite_row,
    has_forbidden_chars,
    has_whitespace,
    id_problem,
    sorted_id_order,
    string_bytes,
    torch_dtypes,
)
from maxsim_cli.shards.inputs import infer_dtype
from maxsim_cli.shards.memory import MemoryShard
from maxsim_cli.shards.readers import open_shard, read_queries
from maxsim_cli.shards.safetensors_shard import SafetensorsShard
from maxsim_cli.shards.shard import Shard
from maxsim_cli.shards.sinks import arrow_schema
from maxsim_cli.shards.writers import ShardWriter, format_for_path, write_manifest, write_shard


def __getattr__(name: str) -> object:
    # `TORCH_DTYPES`, once a module constant, is made on first use: building it imports torch.
    if name == "TORCH_DTYPES":
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BY_SHARD_SORT_MIN_IDS",
    "BY_SHARD_SORT_MIN_THREADS",
    "CORPUS_FORMAT_NAME",
    "CORPUS_FORMAT_VERSION",
    "DTYPES",
    "FLOAT_DTYPES",
    "FORMATS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ID_FORBIDDEN",
    "ID_FORBIDDEN_NOT_SPACE",
    "ID_FORBIDDEN_RE2",
    "ID_RULE",
    "ID_WHITESPACE",
    "ID_WHITESPACE_RE2",
    "MANIFEST_NAME",
    "MAX_ARROW_TOKENS",
    "MAX_SAFETENSORS_HEADER",
    "NORM_TOLERANCE",
    "QUANTIZATIONS",
    "SHARD_SUFFIXES",
    "ArrowShard",
    "Corpus",
    "DocBatch",
    "InputNote",
    "MemoryShard",
    "ParquetShard",
    "SafetensorsShard",
    "Shard",
    "ShardInfo",
    "ShardWriter",
    "arrow_schema",
    "check_id",
    "check_kernel_dim",
    "check_same_dim",
    "concat_ids",
    "current_umask",
    "first_nonfinite_row",
    "format_for_path",
    "has_forbidden_chars",
    "has_whitespace",
    "id_problem",
    "infer_dtype",
    "input_notes",
    "list_shard_files",
    "open_corpus",
    "open_shard",
    "read_manifest",
    "read_queries",
    "report_notes",
    "sorted_id_order",
    "staging_dir",
    "string_bytes",
    "torch_dtypes",
    "write_manifest",
    "write_shard",
    "write_text_atomic",
]
