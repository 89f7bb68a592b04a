"""Id indexes: each shard's ids as sorted 64-bit hashes, so that a write command finds the ids it is given,
and keeps ids unique across a corpus, in the time of those ids rather than of the corpus's.

`maxsim delete` of 100,000 ids from a corpus of 10M documents spent 6.6 s opening the whole corpus and
hashing every id (benchmarks/results/generations/): work for the corpus, not for the ids. A shard's
**id index** (``<shard file>.idindex``, docs/format.md "Id indexes") holds a 32-bit hash of each of its
ids (the top half of `maxsim_cli.shards.lookup.hash_utf8`), ascending, and beside each hash the row (the
document's number in the shard) whose id it is: 8 bytes a document, all of which a delete of 1% of the
corpus reads and checks (its sha256), so the fewer the better. 32 bits are enough because a hash found
only proposes a document, whose id is then compared: 10M ids give each id looked up ~0.002 false
candidates to compare. `write_manifest` writes one beside each shard, and a
write command (`maxsim add`, `compact`) one for each shard it brings; each is recorded with its sha256 in
the manifest, and the sha256 is checked whenever the file is read, so a damaged file is never used.

- `find_ids`: the (shard, row) of given ids among the live (not deleted) documents. A hash found is only
  a candidate: the id at its row is read from the shard (`shard_ids_at`: for a safetensors shard, the
  pages of the ids asked for) and compared byte for byte, so two ids that share a hash never answer for
  each other. An id live in two shards is an error (the corpus's ids are not unique).
- `check_unique`: whether the live ids of the shards are unique across them: every hash of every
  index, merged, and the ids of equal hashes compared. A write command does this once for a generation
  whose manifest does not record it (a corpus packed before id indexes, or a damaged index rebuilt);
  afterwards the manifest records it (``unique_ids``) and readers trust it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxsim_cli.arrays import array_values, gather_strings, safetensors_bytes, values_array
from maxsim_cli.errors import InputError
from maxsim_cli.shards.format import input_error, one_line, show_id
from maxsim_cli.shards.lookup import encode_docnos, hash_utf8, id_bytes

ID_INDEX_SUFFIX = ".idindex"
ID_INDEX_FORMAT = "maxsim-id-index"
ID_INDEX_VERSION = 1
# The hash, as the file names it (`id_hashes`): a file made with another is built again, never read.
HASH_NAME = "maxsim-utf8-poly64-splitmix64-top32"
_HEADER_LIMIT = 1 << 16


class IdIndexError(InputError):
    """An id index that cannot be used as recorded: missing, damaged, or not the shard's (one line)."""


def id_hashes(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The id index's hash (uint32) of the byte strings ``data[offsets[i]:offsets[i + 1]]``: the top 32
    bits of `hash_utf8`."""
    return (hash_utf8(data, offsets) >> np.uint64(32)).astype(np.uint32)


@dataclass
class IdIndex:
    """One shard's id index: ``hashes`` (uint32 [N], ascending) and ``rows`` (uint32, or int64 past 2**32
    documents: the row of each hash's id)."""

    hashes: np.ndarray
    rows: np.ndarray

    @property
    def num_docs(self) -> int:
        return len(self.hashes)


def index_names(names: Sequence[str]) -> list[str]:
    """The id index file names of shard files ``names`` (beside them)."""
    return [name + ID_INDEX_SUFFIX for name in names]


def build_index(ids: pa.Array) -> IdIndex:
    """The id index of a shard whose ids (in row order) are ``ids``, an Arrow (large) string array."""
    hashes = id_hashes(*id_bytes(ids))
    order = np.argsort(hashes, kind="stable")
    rows = order.astype(np.uint32 if len(order) < 2**32 else np.int64)
    return IdIndex(hashes[order], rows)


def index_bytes(index: IdIndex) -> bytes:
    """The id index file's bytes: a safetensors file of the two arrays, its header's keys in a fixed order
    (the same index, the same bytes and sha256), padded to 8 bytes."""
    hashes = np.ascontiguousarray(index.hashes, dtype="<u4")
    rows = np.ascontiguousarray(index.rows, dtype="<u4" if index.rows.dtype == np.uint32 else "<i8")
    meta = {"format": ID_INDEX_FORMAT, "format_version": str(ID_INDEX_VERSION), "hash": HASH_NAME,
            "num_docs": str(index.num_docs)}  # fmt: skip
    return safetensors_bytes({"hashes": hashes, "rows": rows}, meta)


def write_index(path: str, index: IdIndex) -> str:
    """Write ``index`` to ``path`` atomically (a temp file beside it, then a rename); its sha256."""
    from maxsim_cli.shards.files import atomic_temp, remove_quietly, write_error

    data = index_bytes(index)
    fd, tmp = atomic_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise write_error(path, exc) from None
    finally:
        remove_quietly(tmp if os.path.exists(tmp) else None)
    return hashlib.sha256(data).hexdigest()


def _tensor(path: str, header: dict[str, Any], name: str, dtypes: tuple[str, ...], count: int, size: int):
    entry = header.get(name)
    if not isinstance(entry, dict) or entry.get("dtype") not in dtypes or entry.get("shape") != [count]:
        got = (entry.get("dtype"), entry.get("shape")) if isinstance(entry, dict) else None
        raise IdIndexError(f"{path}: tensor {name!r} must be {'/'.join(dtypes)} [{count}], got {got}")
    span = entry.get("data_offsets")
    width = 4 if entry["dtype"] == "U32" else 8
    if (
        not isinstance(span, list) or len(span) != 2 or not all(isinstance(v, int) for v in span)
        or not 0 <= span[0] <= span[1] <= size or span[1] - span[0] != count * width
    ):  # fmt: skip
        raise IdIndexError(f"{path}: tensor {name!r} has data_offsets {span!r} outside the file")
    return entry["dtype"], span[0]


def read_index(path: str, sha256: str, num_docs: int) -> IdIndex:
    """The id index at ``path``, checked: its sha256 is ``sha256`` (recorded in the manifest), it is an
    id index of this version and hash, of ``num_docs`` documents. Any problem: `IdIndexError`."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise IdIndexError(f"{path}: cannot read the id index: {one_line(exc)}") from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256.lower():
        raise IdIndexError(
            f"{path}: sha256 {got} does not match {sha256} in the manifest; the file is damaged"
        )
    try:
        (length,) = struct.unpack_from("<Q", data)
        if length > _HEADER_LIMIT or 8 + length > len(data):
            raise ValueError(f"a header of {length} bytes")
        header = json.loads(data[8 : 8 + length].decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (struct.error, ValueError) as exc:
        raise IdIndexError(f"{path}: not an id index: {one_line(exc)}") from None
    meta = header.get("__metadata__") if isinstance(header.get("__metadata__"), dict) else {}
    want = {"format": ID_INDEX_FORMAT, "format_version": str(ID_INDEX_VERSION), "hash": HASH_NAME,
            "num_docs": str(num_docs)}  # fmt: skip
    for key, value in want.items():
        if meta.get(key) != value:
            raise IdIndexError(f"{path}: metadata {key}={meta.get(key)!r}, expected {value!r}")
    base, size = 8 + length, len(data) - 8 - length
    _, hashes_at = _tensor(path, header, "hashes", ("U32",), num_docs, size)
    rows_dtype, rows_at = _tensor(path, header, "rows", ("U32", "I64"), num_docs, size)
    hashes = np.frombuffer(data, dtype="<u4", count=num_docs, offset=base + hashes_at)
    rows = np.frombuffer(
        data, dtype="<u4" if rows_dtype == "U32" else "<i8", count=num_docs, offset=base + rows_at
    )
    return IdIndex(hashes, rows)


# --------------------------------------------------------------------------------------------------
# ids read from a shard, by row


def shard_ids_at(path: str, rows: np.ndarray, num_docs: int) -> pa.Array:
    """The ids of documents ``rows`` of the shard at ``path`` (large_binary, in the order of ``rows``): a
    safetensors shard's through a map of its id tensors alone, another container's from the opened
    shard."""
    from maxsim_cli.shards.readers import open_shard, shard_kind
    from maxsim_cli.shards.safetensors_shard import ids_at

    rows = np.asarray(rows, dtype=np.int64)
    if shard_kind(path) == "safetensors":
        return ids_at(path, rows, num_docs)
    with open_shard(path) as shard:
        if shard.num_docs != num_docs:
            raise input_error(path, f"holds {shard.num_docs} documents but the manifest says {num_docs}")
        return shard.id_array.cast(pa.large_binary()).take(values_array(rows))


# --------------------------------------------------------------------------------------------------
# finding ids, and checking them unique


def parallel_map(work: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[work(item) for item in items]``, on a thread a core: the shards' indexes are read, checked and
    searched in numpy, hashlib and Arrow, which leave the GIL."""
    threads = min(len(items), os.cpu_count() or 1)
    if threads < 2:
        return [work(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, thread_name_prefix="maxsim-ids") as pool:
        return list(pool.map(work, items))


@dataclass
class IndexedShard:
    """A shard of a generation with its id index: its file, its documents and its deleted rows."""

    path: str
    num_docs: int
    index: IdIndex
    deleted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def live(self, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` are not deleted (bool)."""
        if not len(self.deleted) or not len(rows):
            return np.ones(len(rows), dtype=bool)
        at = np.minimum(np.searchsorted(self.deleted, rows), len(self.deleted) - 1)
        return self.deleted[at] != rows


def _duplicate(
    shards: Sequence[IndexedShard], docno: bytes, a: tuple[int, int], b: tuple[int, int]
) -> InputError:
    (sa, ra), (sb, rb) = sorted([a, b])
    return input_error(
        shards[sb].path,
        f"duplicate id {show_id(docno.decode('utf-8', 'replace'))}: document {rb} here and document {ra} of "
        f"{shards[sa].path}; ids must be unique across a corpus",
    )


def find_ids(
    shards: Sequence[IndexedShard], docnos: Sequence[str] | pa.Array
) -> tuple[np.ndarray, np.ndarray]:
    """(shard number, row) of each of ``docnos`` (Python strings, or an Arrow string array) among the
    shards' live documents, int64 each; -1 and -1 for one that none holds. An id live in two shards is
    an `InputError` naming both documents."""
    if isinstance(docnos, pa.Array):
        data, offsets = id_bytes(docnos)
    else:
        data, offsets = encode_docnos(docnos)
    count = len(offsets) - 1
    shard_of = np.full(count, -1, dtype=np.int64)
    row_of = np.full(count, -1, dtype=np.int64)
    if count == 0:
        return shard_of, row_of
    wanted = id_hashes(data, offsets)
    order = np.argsort(wanted, kind="stable")  # sorted: each shard's search walks its hashes once
    ascending = wanted[order]

    def found_in(shard: IndexedShard) -> tuple[np.ndarray, np.ndarray]:
        """(asked, row): the docnos (their positions in ``docnos``) live in ``shard``, at these rows."""
        hashes = shard.index.hashes
        none = np.zeros(0, dtype=np.int64)
        if not len(hashes):
            return none, none
        first = np.searchsorted(hashes, ascending, side="left")
        hit = hashes[np.minimum(first, len(hashes) - 1)] == ascending
        if not hit.any():
            return none, none
        asked = order[hit]
        first = first[hit]
        # ids of this shard that share a hash: every entry of the hash is a candidate (rare)
        counts = np.ones(len(first), dtype=np.int64)
        more = np.flatnonzero(hashes[np.minimum(first + 1, len(hashes) - 1)] == ascending[hit])
        more = more[first[more] + 1 < len(hashes)]
        if len(more):
            counts[more] = np.searchsorted(hashes, ascending[hit][more], side="right") - first[more]
        asked = np.repeat(asked, counts)
        at = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        rows = shard.index.rows[at].astype(np.int64)
        keep = shard.live(rows)
        asked, rows = asked[keep], rows[keep]
        if not len(rows):
            return none, none
        got = shard_ids_at(shard.path, rows, shard.num_docs)
        same = pc.equal(got, gather_strings(data, offsets[asked], offsets[asked + 1]))
        same = array_values(same.cast(pa.uint8())).view(bool)
        return asked[same], rows[same]

    for s, (asked, rows) in enumerate(parallel_map(found_in, shards)):
        again = asked[shard_of[asked] >= 0]
        if len(again):
            i = int(again[0])
            docno = data[offsets[i] : offsets[i + 1]].tobytes()
            raise _duplicate(shards, docno, (int(shard_of[i]), int(row_of[i])), (s, int(rows[asked == i][0])))
        shard_of[asked] = s
        row_of[asked] = rows
    return shard_of, row_of


def check_unique(shards: Sequence[IndexedShard]) -> None:
    """An `InputError` naming two documents when the shards' live ids are not unique across them: every
    live hash of every index merged (sorting the concatenated sorted runs merges them), and the ids of
    the hashes found more than once read from their shards and compared."""
    runs = []
    for shard in shards:
        hashes = shard.index.hashes
        if len(shard.deleted):
            hashes = hashes[shard.live(shard.index.rows.astype(np.int64))]
        runs.append(hashes)
    merged = np.sort(np.concatenate(runs) if runs else np.zeros(0, np.uint32), kind="stable")
    repeated = np.unique(merged[1:][merged[1:] == merged[:-1]])
    if not len(repeated):
        return
    ids, places = [], []
    for s, shard in enumerate(shards):
        rows = shard.index.rows[np.isin(shard.index.hashes, repeated)].astype(np.int64)
        rows = rows[shard.live(rows)]
        if len(rows):
            ids.append(shard_ids_at(shard.path, rows, shard.num_docs))
            places.append(np.stack([np.full(len(rows), s), rows], axis=1))
    if not ids:
        return
    candidates = pa.concat_arrays(ids)
    where = np.concatenate(places)
    order = array_values(pc.sort_indices(candidates)).astype(np.int64)
    ordered = candidates.take(values_array(order))
    equal = pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1))
    equal = np.flatnonzero(array_values(equal.cast(pa.uint8())))
    if len(equal):  # a shard's own ids are unique: two equal ones are in two shards
        a, b = order[equal[0]], order[equal[0] + 1]
        docno = candidates[int(a)].as_py()
        raise _duplicate(shards, docno, tuple(where[a].tolist()), tuple(where[b].tolist()))
