"""A corpus: shards scored together, given as files and/or directories (with an optional `index.json`
manifest). `open_corpus` opens them, refuses a dim/dtype/quantization mismatch and duplicate ids across
shards, and checks the manifest's counts (and, when asked, checksums) against the shards. Shards holding
no documents are left out of the corpus and listed in `Corpus.skipped`.

`input_notes` lists what is valid but most likely a mistake when queries meet a corpus (shards skipped for
holding no documents, a query file without queries, queries and corpus from different encoders or with
different normalisation); `report_notes` turns them into warnings, or into an error under ``strict``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa

from maxsim_cli.codecs import Codebook, corpus_codebook
from maxsim_cli.errors import STRICT, InputError, MaxsimError, UsageError, in_python_terms
from maxsim_cli.shards.files import file_sha256, list_shard_files
from maxsim_cli.shards.format import (
    CORPUS_FORMAT_NAME,
    CORPUS_FORMAT_VERSION,
    MANIFEST_NAME,
    DocBatch,
    concat_ids,
    has_equal_neighbours,
    input_error,
    one_line,
    show_id,
    sorted_id_order,
)
from maxsim_cli.shards.generations import (
    ReaderLock,
    manifest_path,
    open_state,
    parse_ids_record,
    parse_unique_record,
    unique_ids_digest,
)
from maxsim_cli.shards.lookup import IdLookup
from maxsim_cli.shards.memory import IN_MEMORY_CORPUS, MemoryShard
from maxsim_cli.shards.readers import open_shard
from maxsim_cli.shards.shard import Shard

if TYPE_CHECKING:
    import torch

    from maxsim_cli.shards.resident import Residency


# What to do about a shard of a folder that a symlink takes outside it (the one rule for folders with
# and without a manifest; a shard file named as a corpus path itself is read wherever it lies).
_OUTSIDE_REMEDY = "copy the shard into it, or name the file itself as a corpus path"


def _outside(root: str, path: str) -> str | None:
    """The real path of ``path`` (a file in a folder whose real path is ``root``) when a symlink takes
    it outside that folder, else None."""
    real = os.path.realpath(path)
    return real if os.path.commonpath([root, real]) != root else None


def read_manifest(directory: str) -> list[dict[str, Any]]:
    """Entries of `directory/index.json`, each with a checked `path` (inside the directory) made absolute."""
    return read_manifest_state(directory)[0]


def read_manifest_state(directory: str) -> tuple[list[dict[str, Any]], bool]:
    """`read_manifest`'s entries (each with its id index, when recorded, as ``ids_path`` and
    ``ids_sha256``), and whether the manifest records the ids unique across its shards (its
    ``unique_ids`` equals the digest of their id indexes: `unique_ids_digest`)."""
    manifest = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(manifest, encoding="utf-8") as f:
            doc = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise input_error(manifest, f"not valid JSON: {one_line(exc)}") from None
    if not isinstance(doc, dict) or doc.get("format") != CORPUS_FORMAT_NAME:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise input_error(manifest, f"unknown format {got!r} (expected {CORPUS_FORMAT_NAME!r})")
    if doc.get("format_version") != CORPUS_FORMAT_VERSION:
        raise input_error(
            manifest,
            f"unsupported format_version {doc.get('format_version')!r} "
            f"(this maxsim reads version {CORPUS_FORMAT_VERSION})",
        )
    entries = doc.get("shards")
    if not isinstance(entries, list) or not entries:
        raise input_error(manifest, "'shards' must be a non-empty list")
    root = os.path.realpath(directory)
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise input_error(manifest, f"shards[{i}] needs a 'path' string")
        rel = entry["path"]
        if "\0" in rel:
            raise input_error(
                manifest,
                f"shards[{i}] path {rel!r} contains a NUL character, which no file name holds; "
                "rebuild the manifest with write_manifest",
            )
        parts = re.split(r"[\\/]", rel)
        if not rel or os.path.isabs(rel) or rel.startswith(("/", "\\")) or ".." in parts:
            raise input_error(
                manifest,
                f"shards[{i}] path {rel!r} names a file outside the corpus directory; "
                "manifest paths must be relative names inside it",
            )
        full = os.path.join(directory, rel)
        real = _outside(root, full)
        if real is not None:
            raise input_error(
                manifest,
                f"shards[{i}] path {rel!r} resolves (through a symlink) to {real}, outside "
                f"the corpus directory; {_OUTSIDE_REMEDY}",
            )
        if not os.path.isfile(full):
            raise input_error(manifest, f"shards[{i}] path {rel!r}: no such file in {directory}")
        for key in ("num_docs", "num_tokens"):
            if key in entry and not (isinstance(entry[key], int) and entry[key] >= 0):
                raise input_error(manifest, f"shards[{i}] {key} must be a non-negative integer")
        ids_path = ids_sha256 = None
        if entry.get("ids") is not None:
            ids_path, ids_sha256 = parse_ids_record(manifest, directory, entry["ids"], f"shards[{i}]")
        out.append({**entry, "path": full, "relpath": rel, "ids_path": ids_path, "ids_sha256": ids_sha256})
    recorded = parse_unique_record(manifest, doc.get("unique_ids"))
    digest = unique_ids_digest([(e["ids_sha256"], None) for e in out])
    return out, digest is not None and recorded == digest


def mark_deleted(shard: Shard, rows: np.ndarray, number: int) -> None:
    """Record a shard's deleted rows on it (``shard.deleted_rows``) and give each of them an id that no
    document can have (a NUL, then the shard's ``number`` in its corpus and the row): a rerank's
    candidate never finds a deleted document (it is missing), and an id deleted here may be added
    again in another shard without counting as a duplicate. The new ids array is the old one's bytes
    copied around the deleted rows' (a slice a run of live ids): no mask over every id, and no
    ``pa.array``, whose first call imports pandas."""
    from maxsim_cli.shards.lookup import id_bytes

    deleted = np.asarray(rows, dtype=np.int64)
    shard.deleted_rows = deleted  # type: ignore[attr-defined]
    if not len(deleted):
        return
    data, offsets = id_bytes(shard.id_array.cast(pa.large_string()))
    hidden = [f"\0{number}\0{row}".encode() for row in deleted.tolist()]
    lengths = np.diff(offsets)
    lengths[deleted] = [len(name) for name in hidden]
    new_offsets = np.zeros(len(offsets), dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    # the live runs between deleted rows: bytes [offsets[after previous deleted], offsets[deleted])
    run_starts = offsets[np.concatenate([[0], deleted + 1])].tolist()
    run_stops = offsets[np.concatenate([deleted, [len(offsets) - 1]])].tolist()
    view = memoryview(data)
    parts = []
    for a, b, name in zip(run_starts, run_stops, [*hidden, b""], strict=True):
        parts += (view[a:b], name)
    shard._id_array = pa.LargeStringArray.from_buffers(
        len(lengths), pa.py_buffer(new_offsets), pa.py_buffer(b"".join(parts))
    )
    shard._ids = None


@dataclass
class ResidentPart:
    """One device's share of a corpus spread over several (`Corpus.to` with a list): ``corpus`` holds
    the shards ``shards`` (indices into the whole corpus's shards), resident on ``device``."""

    device: torch.device
    corpus: Corpus
    shards: list[int]


class Corpus:
    """Shards that are scored together: one dim, dtype and quantization, ids unique across all shards.

    Documents are numbered globally in shard order: shard s holds `doc_starts[s]:doc_starts[s+1]`.
    ``len(corpus)`` counts documents, ``corpus.ids`` lists their ids in that order. ``corpus.to(device)``
    makes it *resident*: every shard read once into that device's memory (`residency`), so scoring reads
    nothing from disk; otherwise batches stream from the files. A corpus made by `from_embeddings` has no
    files (``paths`` is empty): its one `MemoryShard`'s tensors are its residency, on their device.
    """

    def __init__(self, shards: list[Shard], *, ids_unique: bool = False) -> None:
        """``ids_unique``: the ids are known unique across the shards (a corpus folder whose manifest
        records it: `open_corpus`), so they are not sorted to check it."""
        if not shards:
            raise InputError("corpus: no shards given")
        first = shards[0].info
        for shard in shards[1:]:
            info = shard.info
            for key in ("dim", "dtype", "quantization"):
                if getattr(info, key) != getattr(first, key):
                    raise input_error(
                        info.path,
                        f"{key} mismatch: {key}={getattr(info, key)} here but "
                        f"{key}={getattr(first, key)} in {first.path}; a corpus needs "
                        "one dim, dtype and quantization",
                    )
        encoders = {s.info.encoder for s in shards} - {None}
        if len(encoders) > 1:
            named = sorted(encoders)
            raise input_error(
                shards[0].path,
                f"shards were made by different encoders ({', '.join(map(repr, named))}); "
                "their scores cannot be compared",
            )
        self.shards = shards
        self.dim = first.dim
        self.dtype = first.dtype
        self.quantization = first.quantization
        self.normalized = all(s.info.normalized for s in shards)
        self.encoder = next(iter(encoders), None)
        self.doc_starts = np.concatenate([[0], np.cumsum([s.num_docs for s in shards])]).astype(np.int64)
        self.num_docs = int(self.doc_starts[-1])
        self.num_tokens = sum(s.num_tokens for s in shards)
        self._index: dict[str, tuple[int, int]] | None = None
        self._ordinals: dict[str, int] | None = None
        self._id_order: tuple[pa.Array, np.ndarray, pa.Array] | None = None
        self._rank_of_ordinal: np.ndarray | None = None
        self._lookup: IdLookup | None = None
        self.skipped: list[str] = []  # shards left out by `open_corpus` for holding no documents
        self.residency: Residency | None = None  # every shard on one device (`to`)
        self.placement: list[ResidentPart] | None = None  # shares of the shards on several devices
        # residual2 codes: the codebook beside the shards, checked against what they record
        self.codebook: Codebook | None = corpus_codebook([s.info for s in shards])
        # the committed generation opened (0: a folder without generations, or shard files), the reader
        # locks that keep its files, and what `refresh` opens again (set by `open_corpus`)
        self.generation = 0
        self._locks: list[ReaderLock] = []
        self._paths: list[str] = []
        self._generations: list[int | None] = []  # of each path: its generation open (None: a file)
        self._verify_checksums = False
        self._deleted: np.ndarray | None = None
        self._deleted_ordinals: np.ndarray | None = None
        self.num_deleted = sum(len(getattr(s, "deleted_rows", ())) for s in shards)
        if not ids_unique:
            self._check_unique_ids()  # refuses duplicate ids across shards now, not at scoring time

    def deleted_mask(self) -> np.ndarray | None:
        """Which documents are deleted (bool ``[len(corpus)]``, corpus ordinal order), or None when none
        is. A deleted document keeps its ordinal, but no search, rerank or count sees it."""
        if not self.num_deleted:
            return None
        if self._deleted is None:
            mask = np.zeros(self.num_docs, dtype=bool)
            for start, shard in zip(self.doc_starts[:-1].tolist(), self.shards, strict=True):
                rows = getattr(shard, "deleted_rows", None)
                if rows is not None:
                    mask[start + rows] = True
            self._deleted = mask
        return self._deleted

    def deleted_ordinals(self) -> np.ndarray:
        """The deleted documents' ordinals, ascending (int64; empty when none is), computed once: a
        search finds each score block's deleted documents among them."""
        if self._deleted_ordinals is None:
            mask = self.deleted_mask()
            found = np.flatnonzero(mask) if mask is not None else np.zeros(0)
            self._deleted_ordinals = found.astype(np.int64)
        return self._deleted_ordinals

    @property
    def num_live(self) -> int:
        """Documents that are not deleted."""
        return self.num_docs - self.num_deleted

    def refresh(self) -> bool:
        """Open the latest committed generation of the folders this corpus was opened from, in place of
        the one open now: True when it changed (the corpus is then the new generation, released from
        any device: `to` again), False when it is the one open. A corpus made in memory or from shard
        files alone has nothing to refresh."""
        fresh = self.latest()
        if fresh is None:
            return False
        self.close()
        self.__dict__.update(fresh.__dict__)
        return True

    @property
    def folders(self) -> list[str]:
        """The corpus folders this corpus was opened from (what `latest` and `refresh` look at)."""
        return [p for p in self._paths if os.path.isdir(p)]

    def latest(self) -> Corpus | None:
        """The latest committed generation of the folders this corpus was opened from, opened as a new
        corpus (streamed from its files) beside this one, which is left as it is; None when the
        generation open is the latest, or the corpus was made in memory or from shard files alone."""
        from maxsim_cli.shards.generations import read_pointer

        opened = [(p, g) for p, g in zip(self._paths, self._generations, strict=True) if g is not None]
        if all((read_pointer(p) or 0) == g for p, g in opened):
            return None
        return open_corpus(self._paths, verify_checksums=self._verify_checksums)

    def reopen(self) -> Corpus:
        """The generation this corpus is, opened again as a new corpus (a second reader of the same
        files, streamed from them), whatever has been committed since; a corpus made in memory cannot
        be."""
        if not self._paths:
            raise MaxsimError("a corpus made in memory cannot be opened again from files")
        return open_corpus(
            self._paths, verify_checksums=self._verify_checksums, generations=self._generations
        )

    def _check_unique_ids(self) -> None:
        # Each shard's ids are unique already; across shards, equal neighbours in the sorted ids (no
        # Python object per id, and the sort is the one `id_order` keeps for writing runs). The id ->
        # (shard, doc) index, which exhaustive scoring never needs, is built only to name a duplicate.
        if len(self.shards) > 1 and has_equal_neighbours(self.id_order()[2]):
            self.id_index()  # raises, naming both documents

    def id_order(self) -> tuple[pa.Array, np.ndarray, pa.Array]:
        """All ids as one Arrow array (corpus ordinal order), the ordinals sorted by id (ascending UTF-8
        bytes: Python's str order and trec_eval's strcmp), and the ids in that order; computed once."""
        if self._id_order is None:
            self._id_order = sorted_id_order([s.id_array for s in self.shards])
        return self._id_order

    def rank_of_ordinal(self) -> np.ndarray:
        """The inverse of `id_order`'s permutation: each document's position among the ids sorted by
        bytes (int64 [docs], corpus ordinal order); computed once."""
        if self._rank_of_ordinal is None:
            ordinal_of_rank = self.id_order()[1]
            ranks = np.empty(len(ordinal_of_rank), dtype=np.int64)
            ranks[ordinal_of_rank] = np.arange(len(ordinal_of_rank), dtype=np.int64)
            deleted = self.deleted_mask()
            if deleted is not None:
                ranks[deleted] = -1  # `order_keys` puts these below every document: never in a run
            self._rank_of_ordinal = ranks
        return self._rank_of_ordinal

    @classmethod
    def from_embeddings(
        cls,
        ids: Sequence[str | int],
        embeddings: Any,
        mask: Any = None,
        *,
        scales: Any = None,
        normalized: bool | None = None,
        encoder: str | None = None,
        name: str = IN_MEMORY_CORPUS,
    ) -> Corpus:
        """A corpus held in memory, from an encoder's output: what `write_shard` takes, without the file.

        ``embeddings``: a list of ``[len, dim]`` arrays/tensors, one per document (PyLate, stanford
        ColBERT), or a padded ``[n, L, dim]`` array/tensor with ``mask`` ``[n, L]`` (colpali-engine; True/1
        marks a real token, masked tokens are left out exactly). numpy arrays or torch tensors on any
        device: the documents are packed once on the device the tensors are on and stay there, resident
        (``corpus.device``; ``corpus.to(device)`` moves them). float16, bfloat16 and float32 are kept,
        float64 and integers become float32; int8 values need ``scales`` (one float32 per token, shaped as
        the mask, ``x ≈ q * scale``). The rules and messages are the writer's (ids unique, non-empty,
        without whitespace; no empty document; one dim; no NaN/Inf; ``normalized=True`` asserted, None
        measured; all-zero token rows warned about), each message starting with ``name``. Scores are
        those of a shard written from the same embeddings, bit for bit.

        >>> import numpy as np
        >>> docs = [np.ones((3, 8), np.float16), np.ones((2, 8), np.float16)]
        >>> corpus = Corpus.from_embeddings(["d1", 7], docs)
        >>> corpus, corpus.ids, corpus.paths
        (Corpus(2 documents, 5 tokens, dim 8, float16, in memory on cpu), ['d1', '7'], [])
        """
        from maxsim_cli.shards.memory import memory_shard

        shard = memory_shard(
            ids, embeddings, mask, scales=scales, normalized=normalized, encoder=encoder, name=name
        )
        corpus = cls([shard])
        corpus.residency = shard.residency()
        return corpus

    @property
    def in_memory(self) -> bool:
        """Whether the corpus was made from embeddings in memory (`from_embeddings`), not from files."""
        return any(isinstance(s, MemoryShard) for s in self.shards)

    @property
    def paths(self) -> list[str]:
        """The shard files (none for a corpus made in memory)."""
        return [s.path for s in self.shards if not isinstance(s, MemoryShard)]

    def id_lookup(self) -> IdLookup:
        """Docnos to corpus ordinals (`maxsim_cli.shards.lookup.IdLookup`: 16 bytes a document), built at
        the first call and kept with the corpus, so that every later lookup costs what its docnos cost,
        not what the corpus's ids cost: the candidates of a rerank, from the Python API, `maxsim score
        --candidates` and `maxsim serve` alike."""
        if self._lookup is None:
            # every id in ordinal order, one array: `id_order`'s when it is made (at open for several
            # shards, unless the manifest records the ids unique), else the shards' concatenated
            if self._id_order is not None:
                ids = self._id_order[0]
            elif len(self.shards) == 1:
                ids = self.shards[0].id_array
            else:
                ids = concat_ids([s.id_array for s in self.shards])
            self._lookup = IdLookup(ids)
        return self._lookup

    def candidate_index(self, docnos: Iterable[str]) -> Mapping[str, tuple[int, int]]:
        """`id_index` for `docnos`: a mapping that holds those of them in the corpus (the whole `id_index`
        when it has been built; else only those), found through `id_lookup`, not a Python dict of every
        id."""
        if self._index is not None:  # the dict of every id is there already: as it is
            return self._index
        wanted = list(dict.fromkeys(docnos))
        if not wanted:
            return {}
        ordinals = self.id_lookup().ordinals_of(wanted)
        present = np.flatnonzero(ordinals >= 0)
        shard = np.searchsorted(self.doc_starts, ordinals[present], side="right") - 1
        local = ordinals[present] - self.doc_starts[shard]
        return {
            wanted[i]: (s, d)
            for i, s, d in zip(present.tolist(), shard.tolist(), local.tolist(), strict=True)
        }

    def id_index(self) -> dict[str, tuple[int, int]]:
        """doc id -> (shard index, document index in that shard); built once. A dict of every id: for
        looking up some ids, `candidate_index` is faster and smaller."""
        if self._index is None:
            index: dict[str, tuple[int, int]] = {}
            for s, shard in enumerate(self.shards):
                if not index.keys().isdisjoint(shard.ids):
                    d, doc_id = next((d, i) for d, i in enumerate(shard.ids) if i in index)
                    other = index[doc_id]
                    raise input_error(
                        shard.path,
                        f"duplicate id {show_id(doc_id)}: document {d} here and document {other[1]} of "
                        f"{self.shards[other[0]].path}; ids must be unique across a corpus",
                    )
                index.update(zip(shard.ids, zip(itertools.repeat(s), range(shard.num_docs)), strict=False))
            self._index = index
        return self._index

    def ordinal_index(self) -> dict[str, int]:
        """doc id -> corpus ordinal (its position over the shards in order, as a resident corpus and the
        kernels number documents); built once. A dict of every id (~120 bytes a document): to look up
        some ids, `id_lookup` answers the same in 16. Ids are unique across the corpus (checked at open)."""
        if self._ordinals is None:
            ids = self.id_order()[0].to_pylist()
            self._ordinals = dict(zip(ids, range(len(ids)), strict=True))
        return self._ordinals

    def __len__(self) -> int:
        return self.num_docs

    def __repr__(self) -> str:
        where = f", resident on {self.residency.device}" if self.residency is not None else ""
        held = f"{len(self.shards)} shards{where}"
        if self.in_memory:
            held = f"in memory on {self.residency.device}" if self.residency is not None else "closed"
        return (
            f"Corpus({self.num_docs:,} documents, {self.num_tokens:,} tokens, dim {self.dim}, "
            f"{self.dtype}, {held})"
        )

    @property
    def ids(self) -> list[str]:
        """Every document's id, in corpus order."""
        if self._id_order is not None:
            return self._id_order[0].to_pylist()
        return concat_ids([s.id_array for s in self.shards]).to_pylist()

    @property
    def device(self) -> str | None:
        """The device the corpus is resident on (``"cuda:0"``, ``"cpu"``; several devices joined by
        commas), or None when it streams."""
        if self.placement is not None:
            return ",".join(str(part.device) for part in self.placement)
        return str(self.residency.device) if self.residency is not None else None

    @in_python_terms
    def to(self, device: str | Sequence[str]) -> Corpus:
        """Make the corpus resident on ``device`` (``cuda``, ``cuda:N``, ``cpu``, ``auto``) and return it:
        every shard is read once into that device's memory, values checked as on every read. A list of
        devices spreads the shards over them, balanced by tokens: each device holds its share, and scoring
        runs on all of them and merges. Raises `MaxsimError` (one line: how much is needed, how much is
        free) when a share does not fit. A corpus resident elsewhere is released first. An in-memory
        corpus (`from_embeddings`) moves its tensors to the one device named."""
        from maxsim_cli.devices import resolve_device
        from maxsim_cli.shards.resident import assign_shards, make_resident

        names = [device] if isinstance(device, str) else list(device)
        if not names:
            raise UsageError("Corpus.to: no device given; pass a device or a list of devices")
        targets = [resolve_device(str(name)) for name in names]
        if self.in_memory:
            return self._move(targets)
        if len(targets) == 1:
            if self.residency is not None and self.residency.device == targets[0]:
                return self
            self.release()
            self.residency = make_resident(self.shards, targets[0], name=self.name)
            return self
        if self.placement is not None and [p.device for p in self.placement] == targets:
            return self
        self.release()
        parts: list[ResidentPart] = []
        for target, indices in zip(targets, assign_shards([s.num_tokens for s in self.shards], len(targets)),
                                   strict=True):  # fmt: skip
            if not indices:  # more devices than shards
                continue
            share = Corpus([self.shards[i] for i in indices])
            try:
                share.residency = make_resident(share.shards, target, name=share.name)
            except BaseException:
                for part in parts:
                    part.corpus.release()
                raise
            parts.append(ResidentPart(target, share, indices))
        self.placement = parts
        return self

    def _move(self, targets: list[torch.device]) -> Corpus:
        """`to` for an in-memory corpus: its tensors move to the one device named."""
        if len(targets) != 1:
            raise UsageError(
                f"Corpus.to: {self.name} is in memory, one block of tensors on one device; pass one "
                "device, or write it as shards (write_shard) to spread them over several"
            )
        shard = self.shards[0]
        assert isinstance(shard, MemoryShard)
        if self.residency is None or self.residency.device != targets[0]:
            shard.move(targets[0])
            self.residency = shard.residency()
        return self

    @property
    def name(self) -> str:
        """The corpus as messages name it: its first shard (an in-memory corpus's name), and how many more."""
        first = self.shards[0].path
        return first if len(self.shards) == 1 else f"{first} and {len(self.shards) - 1} more"

    def release(self) -> None:
        """Free the device memory of a resident corpus; later scoring streams from the files again. An
        in-memory corpus keeps its tensors: they are the corpus, until `close`."""
        if self.in_memory:
            return
        self.residency = None
        for part in self.placement or ():
            part.corpus.release()  # its shards are this corpus's: released, not closed
        self.placement = None

    def close(self) -> None:
        self.release()
        self.residency = None  # an in-memory corpus's tensors go with its shard
        for shard in self.shards:
            shard.close()
        for lock in self._locks:
            lock.release()

    def __enter__(self) -> Corpus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pack_hint(folder: str) -> str:
    """For a folder of embeddings that are not shards yet (.npy files, a Hugging Face dataset): the
    `maxsim pack` command to run."""
    names = os.listdir(folder)
    if any(n.endswith(".npy") for n in names) or "dataset_dict.json" in names or "data" in names:
        return f"; it holds embeddings to pack first: maxsim pack {shlex.quote(folder)} -o corpus/"
    return ""


def _expand_generation(
    path: str, verify_checksums: bool, locks: list[ReaderLock], generation: int | None = None
) -> list[tuple[str, dict[str, Any] | None]]:
    """A folder's committed generation (docs/format.md, "Generations"), or generation ``generation``,
    opened under a reader lock (appended to ``locks``); generation 0 as a folder without generations is
    read."""
    state, lock = open_state(path, generation)
    locks.append(lock)
    if state.entries is None:
        return _expand(path, verify_checksums, [], plain=True)
    out: list[tuple[str, dict[str, Any] | None]] = []
    ids_unique = state.ids_unique
    for e in state.entries:
        full = os.path.join(path, e.path)
        if verify_checksums:
            if e.ids_path is not None:
                _verify_file(
                    os.path.join(path, e.ids_path), e.ids_sha256, f"generation {state.number}'s manifest"
                )
            if e.sha256 is None:
                raise input_error(
                    full, f"no sha256 in generation {state.number}'s manifest; cannot verify checksums"
                )
            got = file_sha256(full)
            if got != e.sha256.lower():
                raise input_error(
                    full,
                    f"sha256 {got} does not match {e.sha256} in generation {state.number}'s manifest; the "
                    "file changed or is damaged",
                )
        entry = {"num_docs": e.num_docs, "num_tokens": e.num_tokens, "deleted": e.deleted,
                 "generation": state.number, "manifest": manifest_path(path, state.number),
                 "ids_unique": ids_unique}  # fmt: skip
        out.append((full, entry))
    return out


def _verify_file(path: str, sha256: str | None, manifest: str) -> None:
    """`verify_checksums` for a file that a manifest names with its sha256 (an id index)."""
    if not os.path.isfile(path):
        raise input_error(path, f"no such file, named by {manifest}; maxsim compact builds it again")
    got = file_sha256(path)
    if got != (sha256 or "").lower():
        raise input_error(
            path, f"sha256 {got} does not match {sha256} in {manifest}; the file changed or is damaged"
        )


def _expand(
    path: str,
    verify_checksums: bool,
    locks: list[ReaderLock] | None = None,
    *,
    plain: bool = False,
    generation: int | None = None,
) -> list[tuple[str, dict[str, Any] | None]]:
    if not os.path.exists(path):
        raise input_error(path, "no such file or directory")
    if not os.path.isdir(path):
        return [(path, None)]
    if not plain and locks is not None:
        return _expand_generation(path, verify_checksums, locks, generation)
    if os.path.exists(os.path.join(path, MANIFEST_NAME)):
        entries, ids_unique = read_manifest_state(path)
        if verify_checksums:
            manifest = os.path.join(path, MANIFEST_NAME)
            for entry in entries:
                if entry["ids_path"] is not None:
                    _verify_file(os.path.join(path, entry["ids_path"]), entry["ids_sha256"], manifest)
                want = entry.get("sha256")
                if not isinstance(want, str):
                    raise input_error(
                        manifest, f"no sha256 for shard {entry['relpath']!r}; cannot verify checksums"
                    )
                got = file_sha256(entry["path"])
                if got != want.lower():
                    raise input_error(
                        entry["path"],
                        f"sha256 {got} does not match {want} in {manifest}; the file changed or is damaged",
                    )
        return [(e["path"], {**e, "ids_unique": ids_unique}) for e in entries]
    files = list_shard_files(path)
    if not files:
        raise input_error(
            path, "no shards (*.safetensors, *.arrow, *.parquet) in this directory" + _pack_hint(path)
        )
    root = os.path.realpath(path)
    for file in files:
        real = _outside(root, file)
        if real is not None:
            raise input_error(
                file,
                f"resolves (through a symlink) to {real}, outside the corpus directory {path}; "
                f"{_OUTSIDE_REMEDY}",
            )
    return [(f, None) for f in files]


def open_corpus(
    paths: Sequence[str | os.PathLike[str]],
    *,
    verify_checksums: bool = False,
    generations: Sequence[int | None] | None = None,
) -> Corpus:
    """Open shards given as files and/or directories (with an optional `index.json` manifest).

    Refuses a dim/dtype/quantization mismatch between shards and duplicate ids across them. Manifest counts
    are checked against the shards; sha256 only with `verify_checksums=True` (it reads every byte). A
    shard with no documents is left out and named in `Corpus.skipped` (the callers warn about it:
    `input_notes`); a corpus whose shards all hold none is an `InputError`. ``generations``, one a path:
    the generation to open of each folder (`committed_generations`, which holds them open), None for
    its committed one (and for a file).
    """
    if not paths:
        raise InputError("corpus: no shard files or directories given")
    pins = generations if generations is not None else [None] * len(paths)
    listed: list[tuple[str, dict[str, Any] | None]] = []
    locks: list[ReaderLock] = []
    opened: list[int | None] = []  # each path's generation (None: a shard file)
    try:
        for p, pin in zip(paths, pins, strict=True):
            entries = _expand(os.fspath(p), verify_checksums, locks, generation=pin)
            listed.extend(entries)
            numbers = [e["generation"] for _, e in entries if e and "generation" in e]
            opened.append((numbers[0] if numbers else 0) if os.path.isdir(p) else None)
        # one folder whose manifest records its ids unique: not sorted again to check it
        ids_unique = len(paths) == 1 and bool(listed) and all(e and e.get("ids_unique") for _, e in listed)
        corpus = _open_listed(listed, ids_unique)
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    corpus._locks = locks
    corpus._paths = [os.fspath(p) for p in paths]
    corpus._generations = opened
    corpus._verify_checksums = verify_checksums
    corpus.generation = max((g for g in opened if g is not None), default=0)
    return corpus


def _open_listed(listed: list[tuple[str, dict[str, Any] | None]], ids_unique: bool = False) -> Corpus:
    seen: dict[str, str] = {}
    for path, _ in listed:
        real = os.path.realpath(path)
        if real in seen:
            raise input_error(
                path, f"the same shard is listed twice (also as {seen[real]}); name each shard once"
            )
        seen[real] = path
    shards: list[Shard] = []
    try:
        for path, entry in listed:
            shard = open_shard(path)
            shards.append(shard)
            if entry is not None:
                for key in ("num_docs", "num_tokens"):
                    if key in entry and entry[key] != getattr(shard, key):
                        manifest = entry.get("manifest") or os.path.join(os.path.dirname(path), MANIFEST_NAME)
                        raise input_error(
                            path,
                            f"{key}={getattr(shard, key)} but the manifest "
                            f"{manifest} says "
                            f"{entry[key]}; rebuild it with write_manifest",
                        )
                if len(entry.get("deleted", ())):
                    mark_deleted(shard, entry["deleted"], len(shards) - 1)
        empty = [shard for shard in shards if shard.num_docs == 0]
        if len(empty) == len(shards):
            names = shards[0].path if len(shards) == 1 else f"all {len(shards)} shards, {shards[0].path}, ..."
            raise input_error(names, "holds no documents; a corpus needs at least one document to score")
        for shard in empty:
            shards.remove(shard)
            shard.close()
        corpus = Corpus(shards, ids_unique=ids_unique)
        corpus.skipped = [shard.path for shard in empty]
        return corpus
    except BaseException:
        for shard in shards:
            shard.close()
        raise


def check_same_dim(queries: DocBatch, query_path: str, corpus: Corpus) -> None:
    """Queries and corpus must share `dim` (the score is a sum of dot products), one the kernels take."""
    dim = int(queries.embeddings.shape[1])
    if dim != corpus.dim:
        raise input_error(
            query_path,
            f"queries have dim {dim} but the corpus ({corpus.shards[0].path}) has dim "
            f"{corpus.dim}; encode both with the same model",
        )
    check_kernel_dim(corpus)


def check_kernel_dim(corpus: Corpus) -> None:
    """The corpus's `dim` is one the kernels take (a multiple of 8 up to their maximum)."""
    from maxsim_kernels import MAX_DIM

    dim = corpus.dim
    if dim % 8 or not 8 <= dim <= MAX_DIM:
        raise input_error(
            corpus.shards[0].path,
            f"dim {dim}: the kernels take dims that are multiples of 8 from 8 to {MAX_DIM}; pad every "
            "query and document vector with zeros up to a multiple of 8 (the scores do not change)",
        )


class InputNote(NamedTuple):
    """Something valid but most likely a mistake: ``fact`` (one clause naming the file), what is done
    about it (``consequence``, for the warning) and what to do (``remedy``, for the ``strict`` error)."""

    fact: str
    consequence: str
    remedy: str

    def warning(self) -> str:
        return f"{self.fact}; {self.consequence} ({STRICT.given(True)} makes this an error)"

    def error(self) -> str:
        return f"{self.fact}; {self.remedy}"


def input_notes(
    corpus: Corpus, queries: DocBatch | None = None, query_name: str = "queries", *, skipped: bool = True
) -> list[InputNote]:
    """What to warn about when ``queries`` (a query file's batch, or None) are scored against ``corpus``:
    the corpus shards skipped for holding no documents (``skipped=False`` leaves them out, for callers
    that reported them when the corpus was opened), a query file without queries, an encoder named in
    the queries' metadata that differs from the corpus's, and queries L2-normalised where the corpus
    is not (or the reverse). Metadata that is not recorded (vectors from memory) is not compared."""
    notes = []
    if skipped:
        for path in corpus.skipped:
            notes.append(
                InputNote(
                    f"{path}: holds no documents",
                    "skipped",
                    f"drop it from the corpus, or leave out {STRICT.given(True)}",
                )
            )
    if queries is None:
        return notes
    if queries.num_docs == 0:
        notes.append(
            InputNote(
                f"{query_name}: holds no queries",
                "the run is empty",
                f"give a query file with queries, or leave out {STRICT.given(True)}",
            )
        )
    corpus_name = corpus.shards[0].path if len(corpus.shards) == 1 else f"{corpus.shards[0].path}, ..."
    if queries.encoder is not None and corpus.encoder is not None and queries.encoder != corpus.encoder:
        notes.append(
            InputNote(
                f"{query_name}: the queries were made by encoder {queries.encoder!r} but the corpus "
                f"({corpus_name}) by {corpus.encoder!r}",
                "scores of vectors from two models mean nothing",
                f"encode the queries with the corpus's model, or leave out {STRICT.given(True)}",
            )
        )
    if queries.normalized is not None and queries.normalized != corpus.normalized:
        how = {True: "L2-normalised", False: "not L2-normalised"}
        notes.append(
            InputNote(
                f"{query_name}: the queries are {how[queries.normalized]} but the corpus ({corpus_name}) "
                f"is {how[corpus.normalized]} (the shards' normalized metadata)",
                "scored as they are",
                f"normalise both the same way (maxsim pack --normalize), or leave out {STRICT.given(True)}",
            )
        )
    return notes


def report_notes(notes: Sequence[InputNote], *, strict: bool, log: Callable[[str], None]) -> None:
    """Each note as a ``warning: ...`` line through ``log`` (the engine's logger: one line on stderr,
    a `MaxsimWarning` in the Python API), or with ``strict`` the first one as an `InputError`."""
    if strict and notes:
        raise InputError(notes[0].error())
    for note in notes:
        log(f"warning: {note.warning()}")
