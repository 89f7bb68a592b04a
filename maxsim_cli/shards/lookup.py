"""Document ids to corpus ordinals: the lookup of a rerank's candidates, built once per corpus.

A rerank names its candidates by docno; the kernels take corpus ordinals (a document's position over
the shards in order). Looking docnos up by hashing every id of the corpus at each call (Arrow's
``index_in``) cost what the corpus costs: 0.24 s of CPU a call among 1M ids on 2 cores, 1.3 s among 5M,
for 10 candidates as for 1,000. A dict of every id costs nothing per call but ~120 bytes a document for
as long as the corpus lives (571 MiB for 5M ids) and seconds to build
(benchmarks/results/rerank-corpus-size/).

`IdLookup` holds every id's 64-bit hash, sorted, with each one's ordinal beside it and a directory of
the hashes' top bits: 14 to 16 bytes a document (73 MiB for 5M), made from the shards' Arrow id buffers
by numpy, with no Python object per id, in the time of one or two ``index_in`` calls. A lookup hashes
the asked docnos the same way, finds each hash in its bucket of the directory and compares the id found
with the docno byte for byte, so two ids that share a hash never answer for each other: it costs what
the docnos asked cost, not what the corpus costs.

The hash (`hash_utf8`) is a polynomial over each id's UTF-8 bytes modulo 2**64 with its length mixed
in, finished by splitmix64's mixer. Its top 32 bits are also what the shards' id indexes hold on disk
(`maxsim_cli.shards.id_index`, docs/format.md "Id indexes"): a change to it is a change of that format.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxsim_cli.arrays import array_values, values_array

# The hash's multiplier (odd, so invertible modulo 2**64), its inverse, and the mixer's constants.
_MULTIPLIER = 0x9E3779B97F4A7C15
_INVERSE = pow(_MULTIPLIER, -1, 1 << 64)
_LENGTH_MIX = np.uint64(0xD6E8FEB86659FD93)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
# Bytes hashed at once: each byte takes a few uint64 temporaries, and the tables of powers reach this
# length (16 bytes an entry), so the corpus's ids are hashed in pieces of this many bytes (at least one
# id a piece), whatever the corpus's size.
HASH_CHUNK_BYTES = 1 << 18
# The fullest bucket the directory serves: about 13 for 5M ids of a good hash; more means ids made to
# collide, looked up by binary search instead.
MAX_BUCKET_WIDTH = 64

# M**i and M**-i modulo 2**64 for i < len: grown on demand, up to a piece's bytes
_tables = (np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64))


def _power_tables(count: int) -> tuple[np.ndarray, np.ndarray]:
    """M**i and M**-i for i < at least ``count``: kept up to a piece's length, made for the call alone
    past it (a piece of one id longer than a piece), so that the tables stay small."""
    global _tables
    tables = _tables
    if len(tables[0]) < count:
        size = max(count, min(2 * len(tables[0]), HASH_CHUNK_BYTES + 1), 64)
        tables = (_powers(_MULTIPLIER, size), _powers(_INVERSE, size))
        if size <= HASH_CHUNK_BYTES + 1:
            _tables = tables
    return tables


def _powers(base: int, count: int) -> np.ndarray:
    out = np.empty(count, dtype=np.uint64)
    out[0] = 1
    np.cumprod(np.full(count - 1, base, dtype=np.uint64), out=out[1:])  # wraps modulo 2**64
    return out


def hash_utf8(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """uint64 hashes of the byte strings ``data[offsets[i]:offsets[i + 1]]`` (``data`` uint8, ``offsets``
    int64 [n + 1], non-decreasing): ``h = sum(byte_j * M**j) mod 2**64`` (j counted from the string's
    first byte) with the length mixed in, then splitmix64's mixer. A piece of bytes is weighted by
    ``M**p`` of its positions p in one product and one running sum; a string's sum is then shifted back
    to its own first byte by ``M**-start`` (M is odd), so the hashes do not depend on the pieces."""
    n = len(offsets) - 1
    out = np.empty(max(n, 0), dtype=np.uint64)
    if n <= 0:
        return out
    lengths = np.diff(offsets)
    last = int(offsets[n])
    a = 0
    while a < n:
        lo = int(offsets[a])
        if last - lo <= HASH_CHUNK_BYTES:  # the rest in one piece (a request's docnos: all of them)
            b = n
        else:
            b = int(np.searchsorted(offsets, lo + HASH_CHUNK_BYTES, side="right")) - 1
            b = min(max(b, a + 1), n)
        hi = int(offsets[b])
        powers, inverses = _power_tables(hi - lo + 1)
        sums = np.zeros(hi - lo + 1, dtype=np.uint64)
        np.cumsum(np.multiply(data[lo:hi], powers[: hi - lo], dtype=np.uint64), out=sums[1:])
        starts = offsets[a:b] - lo
        piece = sums[offsets[a + 1 : b + 1] - lo]
        piece -= sums[starts]
        piece *= inverses[starts]
        out[a:b] = piece
        a = b
    out ^= lengths.astype(np.uint64) * _LENGTH_MIX
    out ^= out >> np.uint64(30)
    out *= _MIX_1
    out ^= out >> np.uint64(27)
    out *= _MIX_2
    out ^= out >> np.uint64(31)
    return out


def id_bytes(ids: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A (large) string or binary array's bytes (uint8) and int64 offsets into them, without copying the
    bytes."""
    if len(ids) == 0:
        return np.zeros(0, dtype=np.uint8), np.zeros(1, dtype=np.int64)
    _, offsets_buffer, data_buffer = ids.buffers()
    large = pa.types.is_large_string(ids.type) or pa.types.is_large_binary(ids.type)
    width = np.int64 if large else np.int32
    offsets = np.frombuffer(offsets_buffer, dtype=width)[ids.offset : ids.offset + len(ids) + 1]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    return data, offsets.astype(np.int64)


def _byte_views(ids: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A large_binary array's bytes (uint8) and int64 offsets, both views of its buffers (no copy)."""
    if len(ids) == 0:
        return np.zeros(0, dtype=np.uint8), np.zeros(1, dtype=np.int64)
    _, offsets_buffer, data_buffer = ids.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[ids.offset : ids.offset + len(ids) + 1]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    return data, offsets


# Joins the docnos of a lookup: a control character, which no id holds, so that where it also stands
# inside a docno (which then matches nothing) the docnos are measured one by one instead.
_SEPARATOR = "\x1f"


def encode_docnos(docnos: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Docnos as UTF-8 bytes and int64 offsets (`_encode_docnos`)."""
    data, offsets, _ = _encode_docnos(docnos)
    return data, offsets


def join_docnos(docnos: Sequence[str]) -> str | None:
    """``docnos`` joined on `_SEPARATOR`, as a lookup encodes them (`IdLookup.locate`'s ``joined``), or
    None where one is not a ``str``: the join is also the check of their type, in one pass over them."""
    try:
        return _SEPARATOR.join(docnos)
    except TypeError:
        return None


def _encode_docnos(
    docnos: Sequence[str], joined: str | None = None
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Docnos as UTF-8 bytes, int64 offsets, and whether every byte is ASCII: one join on `_SEPARATOR`
    (``joined``, where the caller made it: `join_docnos`), whose separators numpy finds (the bounds) and
    drops (the bytes), where a Python ``len`` a docno cost more than the joins (22 against 34 us for
    1,000 docnos, 2-core machine, alternating calls), and a second join without separators cost a pass
    over every docno's string again. A lone surrogate, which no id holds, is kept as its bytes and so
    matches nothing."""
    count = len(docnos)
    if joined is None:
        joined = _SEPARATOR.join(docnos)
    ascii_only = joined.isascii()
    encoding, errors = ("ascii", "strict") if ascii_only else ("utf-8", "surrogatepass")
    apart = np.frombuffer(joined.encode(encoding, errors), dtype=np.uint8)
    offsets = np.empty(count + 1, dtype=np.int64)
    offsets[0] = 0
    if count <= 1:
        offsets[count] = len(apart)
        return apart, offsets, ascii_only
    # UTF-8 continuation bytes are >= 0x80, never the separator: docno i starts after the i-th
    # separator, with i separators before it
    is_cut = apart == ord(_SEPARATOR)
    cuts = np.flatnonzero(is_cut)
    if len(cuts) == count - 1:
        offsets[1:count] = cuts - np.arange(count - 1)
        data = apart[~is_cut]
    else:  # a docno holds the separator itself: joined without separators, measured one by one
        data = np.frombuffer("".join(docnos).encode(encoding, errors), dtype=np.uint8)
        lengths = [len(docno.encode(encoding, errors)) for docno in docnos]
        np.cumsum(lengths, out=offsets[1:])
    offsets[count] = len(data)
    return data, offsets, ascii_only


class IdLookup:
    """Corpus ordinals of document ids (module docstring), built once from ``ids``: every id of the
    corpus in ordinal order as one Arrow (large) string array, unique (`open_corpus` checks it). The
    array is kept (not copied) to compare ids with.

    A hash is found through a directory of its top bits (about one entry a bucket, at most `width`):
    it is searched for among its bucket's few entries, so a docno's search reads two or three cache lines
    where a binary search over the sorted hashes reads ~20 (1.3 ms against 0.2 ms for 1,000 docnos among
    5M ids, after other work has evicted the caches)."""

    def __init__(self, ids: pa.Array) -> None:
        # the ids as bytes (a view of the same buffers), for comparing the id a hash finds with the docno
        self._ids = ids.cast(pa.large_binary())
        # its bytes and int64 offsets as numpy views of the same buffers: a lookup compares ids with docnos
        # byte for byte in numpy (`_same_bytes`)
        self._id_data, self._id_offsets = _byte_views(self._ids)
        hashes = hash_utf8(*id_bytes(ids))
        order = np.argsort(hashes, kind="stable")
        self.num_ids = len(hashes)
        index = np.int32 if self.num_ids < 2**31 else np.int64
        self.hashes = hashes[order]  # uint64 [N], ascending
        self.ordinals = order.astype(index)  # the ordinal of each hash
        del hashes, order
        bits = max(1, self.num_ids.bit_length() - 1)  # 2**bits buckets: N / 2**bits in [1, 2) a bucket
        self._shift = np.uint64(64 - bits)
        counts = np.bincount((self.hashes >> self._shift).astype(np.intp), minlength=1 << bits)
        self._bucket_start = np.zeros((1 << bits) + 1, dtype=index)  # [2**bits + 1]
        np.cumsum(counts, out=self._bucket_start[1:])
        self.width = int(counts.max()) if self.num_ids else 0  # the fullest bucket's entries

    @property
    def nbytes(self) -> int:
        """Host memory the lookup adds to the corpus's own ids: 14 to 16 bytes a document (8 for
        its hash, 4 for its ordinal, 2 to 4 for the directory; 20 to 24 past 2**31 ids)."""
        return self.hashes.nbytes + self.ordinals.nbytes + self._bucket_start.nbytes

    def _first_at_least(self, wanted: np.ndarray) -> np.ndarray:
        """``np.searchsorted(self.hashes, wanted)`` (int64), through the directory: a binary search of
        each hash's bucket, all hashes at once, in the few halvings the fullest bucket takes (`width`:
        4 for 200K or 5M ids of a good hash), where comparing every entry of the bucket took `width`
        reads a hash (1,000 docnos among 200K ids: 65 against 160 us, 2-core machine, alternating
        calls). A directory whose fullest bucket is unusually full (ids made to collide) falls back to
        the binary search of every hash."""
        if self.width > MAX_BUCKET_WIDTH:
            return np.searchsorted(self.hashes, wanted)
        bucket = (wanted >> self._shift).astype(np.intp)
        lo = self._bucket_start[bucket].astype(np.int64)
        hi = self._bucket_start[bucket + 1].astype(np.int64)
        # entries before lo are below the hash and entries from hi on at least it (later buckets hold
        # larger hashes), so an empty range (mid = lo = hi) stays as it is; but where hi is past the last
        # entry, which is clipped to, lo may step past it, and is brought back after
        for _ in range(self.width.bit_length()):  # a range of `width` entries halves to none in these
            mid = lo + hi
            mid >>= 1
            below = np.take(self.hashes, mid, mode="clip") < wanted
            lo = np.where(below, mid + 1, lo)
            hi = np.where(below, hi, mid)
        return np.minimum(lo, self.num_ids, out=lo)

    def ordinals_of(self, docnos: Sequence[str]) -> np.ndarray:
        """The corpus ordinal of each of ``docnos`` (int64, in their order), -1 for one not in the
        corpus. A docno asked twice is looked up twice."""
        return self.locate(docnos)[0]

    def locate(
        self, docnos: Sequence[str], joined: str | None = None
    ) -> tuple[np.ndarray, pa.Array, np.ndarray]:
        """`ordinals_of` ``docnos``; the docnos as the lookup compared them: an Arrow large_string array
        (large_binary where one is not ASCII) of their UTF-8 bytes, in their order (a found docno's
        bytes are its id's: a caller takes the rows it answers with from it, a small array, not from the
        corpus's ids); and their uint64 hashes (`hash_utf8`: equal docnos have equal hashes, which
        `first_repeat` uses). ``joined``: ``docnos`` joined by `join_docnos`, where the caller has it."""
        count = len(docnos)
        data, offsets, ascii_only = _encode_docnos(docnos, joined)
        asked = pa.Array.from_buffers(
            pa.large_binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
        )
        # ASCII is UTF-8: the docnos as the strings they are, without a check of each byte
        docnos_array = asked.view(pa.large_string()) if ascii_only else asked
        wanted = hash_utf8(data, offsets)
        if count == 0 or self.num_ids == 0:
            return np.full(count, -1, dtype=np.int64), docnos_array, wanted
        at = self._first_at_least(wanted)
        np.minimum(at, self.num_ids - 1, out=at)
        found = self.ordinals[at].astype(np.int64)
        # the id of the first entry of each hash (or of the next larger hash), compared with the docno:
        # where they are equal that is the document, ids being unique
        if self._same_bytes(found, data, offsets):  # every docno found, the common case
            return found, docnos_array, wanted
        same = pc.equal(self._ids.take(values_array(found)), asked)  # an Arrow index: no pandas probe
        if same.true_count == count:  # every docno found, the common case
            return found, docnos_array, wanted
        same = array_values(same.cast(pa.uint8())).view(bool)
        result = np.where(same, found, -1)
        missed = np.flatnonzero(~same)
        # where the hash was there but its first id is another, a later id of the same hash may be it
        for i in missed[self.hashes[at[missed]] == wanted[missed]].tolist():
            result[i] = self._among_equal_hashes(int(at[i]), bytes(data[offsets[i] : offsets[i + 1]]))
        return result, docnos_array, wanted

    def _same_bytes(self, found: np.ndarray, data: np.ndarray, offsets: np.ndarray) -> bool:
        """Whether the id of ordinal ``found[i]`` is docno i (bytes ``data[offsets[i]:offsets[i + 1]]``)
        for every i: the lengths, then every byte against its id's, a few numpy operations where Arrow's
        take and compare of the ids cost ~3 times as much (1,000 docnos among 200K ids, 2-core machine)."""
        starts = self._id_offsets[found]
        lengths = np.diff(offsets)
        if not np.array_equal(self._id_offsets[found + 1] - starts, lengths):
            return False
        starts -= offsets[:-1]  # where each docno's bytes start in the ids' bytes, less where in ``data``
        at = np.repeat(starts, lengths)
        at += np.arange(len(data))
        return bool(np.array_equal(np.take(self._id_data, at), data))

    def _among_equal_hashes(self, start: int, docno: bytes) -> int:
        """The ordinal of ``docno`` among the ids whose hash is ``self.hashes[start]``, or -1."""
        value = self.hashes[start]
        stop = int(np.searchsorted(self.hashes, value, side="right"))
        for at in range(start + 1, stop):
            ordinal = int(self.ordinals[at])
            if self._ids[ordinal].as_py() == docno:
                return ordinal
        return -1


def first_repeat(hashes: np.ndarray, counts: np.ndarray, docnos: Sequence[str]) -> int:
    """The index of the first docno of ``docnos`` that an earlier one of the same group repeats, or -1:
    groups of ``counts[i]`` docnos one after another, ``hashes`` their `hash_utf8` hashes (as
    `IdLookup.locate` gives them). Equal docnos have equal hashes, so the hashes, sorted within their
    group, show every docno that may repeat another; those few are then compared as strings (two
    docnos may share a hash). One sort of 64-bit integers, where a set of the docno strings cost 2-4
    times as much (1,000 docnos, 2-core machine)."""
    if len(hashes) < 2:
        return -1
    if len(counts) == 1:
        sorted_hashes = np.sort(hashes)
        if not (sorted_hashes[1:] == sorted_hashes[:-1]).any():  # the common case: no index needed
            return -1
        order = np.argsort(hashes, kind="stable")
        sorted_hashes = hashes[order]
        pairs = np.flatnonzero(sorted_hashes[1:] == sorted_hashes[:-1])
    else:
        group = np.repeat(np.arange(len(counts)), counts)
        order = np.lexsort((hashes, group))
        sorted_hashes, sorted_group = hashes[order], group[order]
        pairs = np.flatnonzero(
            (sorted_hashes[1:] == sorted_hashes[:-1]) & (sorted_group[1:] == sorted_group[:-1])
        )
    if len(pairs) == 0:
        return -1
    suspects = np.union1d(order[pairs], order[pairs + 1])  # ascending
    groups = np.searchsorted(np.cumsum(counts), suspects, side="right")
    seen: set[tuple[int, str]] = set()
    for i, g in zip(suspects.tolist(), groups.tolist(), strict=True):
        if (g, docnos[i]) in seen:
            return i
        seen.add((g, docnos[i]))
    return -1
