"""Document ids to corpus ordinals, many at a time, without a Python object per corpus id.

A served rerank looks up each request's ~1,000 candidate docnos among the corpus's ids. A dict of every
id does it one Python lookup at a time, and each lookup follows pointers into scattered memory (the
dict's index, its entry, the id's string object): a chain of cache misses that nothing overlaps. On the
H200 host the 1,000 lookups of a served request took 0.49 ms against a 20,000-id corpus, and 0.7 ms on
2 cores against 195,215 ids (`python benchmarks/probe_id_lookup.py`). `IdLookup` keeps the ids as the
corpus already holds them (one Arrow array: UTF-8 bytes and offsets) beside an open-addressing table of
their hashes (linear probing, at most half full) and answers a whole list with numpy: one hash per
docno (Python's own string hash), a few gathers into the table, then an exact comparison of every
found docno's bytes with the id it matched. The gathers' misses are independent, so the memory system
serves them together. The answer is exact: a docno is found only where its bytes equal the id's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

# Ids hashed per call to ``to_pylist`` while building (bounds the transient Python strings).
_BUILD_CHUNK = 1 << 20


class IdLookup:
    """Corpus ordinals of document ids: ``lookup(docnos)`` -> int64 ordinals, -1 where absent.

    ``ids`` is the corpus's ids in ordinal order, unique (as a corpus checks when it opens). Memory:
    about 16 bytes a table slot, 2 to 4 slots an id, beside the ids' own bytes.
    """

    def __init__(self, ids: pa.Array) -> None:
        ids = ids.cast(pa.large_string())
        n = len(ids)
        self._size = n
        offsets = np.frombuffer(ids.buffers()[1], dtype=np.int64, count=ids.offset + n + 1)
        self._offsets = offsets[ids.offset :]
        data = ids.buffers()[2]
        self._data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
        hashes = np.empty(n, dtype=np.int64)
        for start in range(0, n, _BUILD_CHUNK):
            chunk = ids.slice(start, _BUILD_CHUNK).to_pylist()
            hashes[start : start + len(chunk)] = np.fromiter(
                map(hash, chunk), dtype=np.int64, count=len(chunk)
            )
        # Buckets by the hash's low bits, at least as many as ids (1 id a bucket on average): each
        # bucket's ids lie together, in `_hashes` and `_ordinals` from `_starts[b]` to `_starts[b + 1]`.
        buckets = 1 << max(3, (n - 1).bit_length())
        self._mask = buckets - 1
        bucket = hashes & self._mask
        order = np.argsort(bucket, kind="stable")
        self._hashes = hashes[order]
        self._ordinals = order.astype(np.int32 if n < 2**31 else np.int64)
        self._starts = np.zeros(buckets + 1, dtype=np.int64)
        np.cumsum(np.bincount(bucket, minlength=buckets), out=self._starts[1:])
        # Two ids with one hash (Python's string hash is a keyed SipHash: not seen in practice): a docno
        # matches the first of them, and the others are looked up in a dict of their own.
        shared = self._hashes[1:][self._hashes[1:] == self._hashes[:-1]]
        self._shared: dict[str, int] = {}
        for ordinal in np.flatnonzero(np.isin(hashes, shared)).tolist() if len(shared) else ():
            self._shared[ids[ordinal].as_py()] = ordinal

    def __len__(self) -> int:
        return self._size

    def lookup(self, docnos: Sequence[str]) -> np.ndarray:
        """Each docno's corpus ordinal (int64), -1 for one that is not a corpus id."""
        n = len(docnos)
        hashes = np.fromiter(map(hash, docnos), dtype=np.int64, count=n)
        bucket = hashes & self._mask
        first = self._starts[bucket]
        count = self._starts[bucket + 1] - first
        width = int(count.max()) if n else 0
        if not width:
            return np.full(n, -1, dtype=np.int64)
        # every entry of each docno's bucket at once: [n, width], past a bucket's end masked off
        at = first[:, None] + np.arange(width)
        inside = at < (first + count)[:, None]
        np.minimum(at, len(self._hashes) - 1, out=at)
        match = inside & (self._hashes[at] == hashes[:, None])
        column = match.argmax(axis=1)
        rows = np.arange(n)
        out = np.where(match[rows, column], self._ordinals[at[rows, column]], -1).astype(np.int64)
        self._verify(docnos, out)
        if self._shared:
            for i, docno in enumerate(docnos):
                if out[i] < 0 and docno in self._shared:
                    out[i] = self._shared[docno]
        return out

    def _verify(self, docnos: Sequence[str], out: np.ndarray) -> None:
        """Unset (-1) every found docno whose UTF-8 bytes differ from its matched id's (a docno outside
        the corpus that shares an id's hash)."""
        text = "".join(docnos).encode("utf-8", "surrogatepass")
        lengths = np.fromiter(map(len, docnos), dtype=np.int64, count=len(docnos))
        if len(text) != int(lengths.sum()):  # not all ASCII: count bytes, not characters
            encoded = (d.encode("utf-8", "surrogatepass") for d in docnos)
            lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(docnos))
        found = out >= 0
        id_starts = self._offsets[out]  # (-1: the last offset, unused)
        same = found & (self._offsets[out + 1] - id_starts == lengths)
        out[found & ~same] = -1
        starts = np.cumsum(lengths) - lengths
        if not same.all():  # compare only the bytes of the docnos still matched
            keep = np.flatnonzero(same)
            lengths, starts, id_starts = lengths[keep], starts[keep], id_starts[keep]
        else:
            keep = None
        total = int(lengths.sum())
        if not total:
            return
        packed = np.cumsum(lengths) - lengths  # each kept docno's first byte among the kept bytes
        within = np.arange(total, dtype=np.int64) - np.repeat(packed, lengths)
        request_bytes = np.frombuffer(text, dtype=np.uint8)
        ours = request_bytes if keep is None else request_bytes[np.repeat(starts, lengths) + within]
        equal = ours == self._data[np.repeat(id_starts, lengths) + within]
        if not equal.all():
            owner = np.repeat(np.arange(len(lengths)), lengths)[~equal]
            bad = np.unique(owner)
            out[bad if keep is None else keep[bad]] = -1
