"""Changing a corpus folder: `add_shards`, `delete_ids`, `compact` (`maxsim add`, `delete`, `compact`).

Each call is one commit of a new generation (`maxsim_cli.shards.generations`), made the same way:

1. the writer lock is taken (`WriterLock`: a second writer is refused in one line), and what an earlier
   writer that was killed left is removed: a staging folder, a generation folder that the pointer never
   named, a temp file of the pointer; then old generations that no reader holds are cleaned up;
2. the committed generation is read and the change is checked in full before anything is written.
   `delete` and `add` find ids through the shards' id indexes (`maxsim_cli.shards.id_index`), never
   opening the corpus: their work is that of the ids they are given. An index that is missing or
   damaged is built again from its shard (a warning), and a generation whose manifest does not record
   its ids unique (one made before id indexes) has them checked once, through the indexes;
3. the new generation's files (added shards, hard-linked or copied; compacted shards; deletion sets;
   its manifest) are written into a hidden staging folder ``generations/.staging-XXXX``;
4. the commit: the staging folder is renamed ``generations/<n>``, then the pointer ``index.json`` is
   replaced by a rename (`maxsim_cli.lifeline.commit_point`: a stop signal from the first rename on is
   held, and the command finishes). A reader opens the old pointer or the new one, nothing between;
5. old generations whose files no reader of this machine holds are removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.lifeline import commit_point
from maxsim_cli.shards.corpus import Corpus, open_corpus, read_manifest_state
from maxsim_cli.shards.files import (
    atomic_temp,
    file_sha256,
    list_shard_files,
    remove_quietly,
    staging_dir,
    write_error,
)
from maxsim_cli.shards.format import MANIFEST_NAME, concat_ids, input_error, show_id
from maxsim_cli.shards.generations import (
    GENERATION_MANIFEST,
    GENERATIONS_DIR,
    ShardEntry,
    State,
    WriterLock,
    generation_dir,
    generation_text,
    manifest_path,
    numbered_generations,
    pointer_text,
    read_pointer,
    read_state,
    try_lock_generation,
)
from maxsim_cli.shards.id_index import (
    ID_INDEX_SUFFIX,
    IdIndex,
    IdIndexError,
    IndexedShard,
    build_index,
    check_unique,
    find_ids,
    index_bytes,
    parallel_map,
    read_index,
)

# Tokens read at once while a shard is compacted: ~16 MiB of float16 values at dim 128.
COMPACT_BATCH_BYTES = 16 << 20
DEFAULT_THRESHOLD = 0.2
# Quantizations that add, delete and compact take: full precision and int8 (codes below 8 bits come
# from `maxsim quantize`, which makes them again from the changed corpus).
_EDITABLE = ("none", "int8-per-token")
STAGING_PREFIX = ".staging-"


@dataclass
class Change:
    """What a command committed: the new generation (None when nothing changed) and its counts."""

    generation: int | None
    num_docs: int  # live documents after the change
    num_deleted: int  # deleted rows kept in shards after the change
    added: int = 0  # documents added
    deleted: int = 0  # documents deleted by this change
    unknown: int = 0  # ids asked to delete that the corpus does not hold
    compacted: int = 0  # shards rewritten
    removed: int = 0  # files of old generations removed


def _check_folder(directory: str) -> str:
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        what = "no such folder" if not os.path.exists(directory) else "is a file, not a corpus folder"
        raise InputError(f"{directory}: {what}; add, delete and compact change a corpus folder")
    return directory


def _gen0_state(directory: str) -> State:
    """Generation 0: the shards of a format_version 1 manifest (with their id indexes, and whether it
    records the ids unique), or the folder's shard files."""
    if os.path.exists(os.path.join(directory, MANIFEST_NAME)):
        raw, ids_unique = read_manifest_state(directory)
        entries = [
            ShardEntry(
                e["relpath"],
                int(e["num_docs"]),
                int(e["num_tokens"]),
                e.get("sha256"),
                ids_path=e["ids_path"],
                ids_sha256=e["ids_sha256"],
            )
            for e in raw
        ]
        state = State(0, entries)
        if ids_unique:
            from maxsim_cli.shards.generations import entries_digest

            state.unique_ids = entries_digest(entries)
        return state
    from maxsim_cli.shards.readers import open_shard

    out = []
    for path in list_shard_files(directory):
        with open_shard(path) as shard:
            out.append(ShardEntry(os.path.basename(path), shard.num_docs, shard.num_tokens, None))
    return State(0, out)


def _generation_files(directory: str, number: int) -> set[str]:
    """The files (relative paths) generation ``number``'s manifest names, read leniently (for the
    clean-up: a generation past its use)."""
    import json

    try:
        with open(manifest_path(directory, number), encoding="utf-8") as f:
            doc = json.load(f)
        files = set()
        for raw in doc.get("shards", []):
            files.add(raw["path"])
            for key in ("deleted", "ids"):
                if raw.get(key):
                    files.add(raw[key]["path"])
        return {f for f in files if isinstance(f, str) and ".." not in f.replace("\\", "/").split("/")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def recover(directory: str, committed: int) -> None:
    """Under the writer lock: remove what a killed writer left (a staging folder, a generation folder
    the pointer never named, a temp file of the pointer)."""
    folder = os.path.join(directory, GENERATIONS_DIR)
    for name in os.listdir(folder):
        if name.startswith(STAGING_PREFIX):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    for number in numbered_generations(directory):
        if number > committed:
            shutil.rmtree(generation_dir(directory, number), ignore_errors=True)
    for name in os.listdir(directory):
        if name.startswith(f".{MANIFEST_NAME}.") and name.endswith(".tmp"):
            remove_quietly(os.path.join(directory, name))


def clean_up(directory: str, committed: int) -> int:
    """Remove the files of generations older than ``committed`` that no reader of this machine holds
    (an exclusive lock on each is tried, without waiting) and that no kept generation names; returns
    how many files went."""
    old = [m for m in numbered_generations(directory) if m < committed]
    held: dict[int, int] = {}
    try:
        for number in old:
            fd = try_lock_generation(directory, number)
            if fd is not None:
                held[number] = fd
        keep: set[str] = set()
        for number in [committed, *(m for m in old if m not in held)]:
            keep |= _generation_files(directory, number)
        drop: set[str] = set()
        for number in held:
            drop |= _generation_files(directory, number)
        removed = 0
        for rel in sorted(drop - keep):
            path = os.path.join(directory, rel)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
        for number in held:
            remove_quietly(manifest_path(directory, number))
        for number in numbered_generations(directory):
            if number < committed and not os.path.exists(manifest_path(directory, number)):
                with contextlib.suppress(OSError):
                    os.rmdir(generation_dir(directory, number))  # only once it holds nothing kept
        return removed
    finally:
        for fd in held.values():
            os.close(fd)


class _Commit:
    """One commit of a new generation: files staged, then the pointer flipped (module docstring)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.lock = WriterLock(directory)
        try:
            self.committed = read_pointer(directory) or 0
            recover(directory, self.committed)
            clean_up(directory, self.committed)
            self.number = max([self.committed, *numbered_generations(directory)]) + 1
            if self.committed == 0:
                self.gen0 = _gen0_state(directory)
                self.entries = self.gen0.entries or []
            self.staging = ""
        except BaseException:
            self.lock.release()
            raise

    def stage(self) -> str:
        if not self.staging:
            self.staging = staging_dir(os.path.join(self.directory, GENERATIONS_DIR), STAGING_PREFIX)
        return self.staging

    def rel(self, name: str) -> str:
        """A new file's path in the manifest (inside the generation's folder once committed)."""
        return f"{GENERATIONS_DIR}/{self.number}/{name}"

    def write_deleted(self, name: str, rows: np.ndarray) -> tuple[str, str]:
        """A deletion set into the staging folder: (its manifest path, its sha256)."""
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(rows, dtype=np.int64), allow_pickle=False)
        data = buffer.getvalue()
        path = os.path.join(self.stage(), name)
        try:
            with open(path, "wb") as f:
                f.write(data)
        except OSError as exc:
            raise write_error(self.directory, exc) from None
        return self.rel(name), hashlib.sha256(data).hexdigest()

    def write_index(self, name: str, index: IdIndex) -> tuple[str, str]:
        """An id index into the staging folder: (its manifest path, its sha256)."""
        data = index_bytes(index)
        try:
            with open(os.path.join(self.stage(), name), "wb") as f:
                f.write(data)
        except OSError as exc:
            raise write_error(self.directory, exc) from None
        return self.rel(name), hashlib.sha256(data).hexdigest()

    def current(self) -> State:
        """The committed generation (the writer lock keeps it: no other writer changes or removes it)."""
        if self.committed == 0:  # copies: `self.entries` describes generation 0's files as they are
            return State(0, [dataclasses.replace(e) for e in self.entries], self.gen0.unique_ids)
        return read_state(self.directory, self.committed)

    def commit(self, entries: list[ShardEntry], *, ids_unique: bool = False) -> None:
        """Commit ``entries`` as the new generation; ``ids_unique``: their live ids were checked unique
        (recorded in the manifest, `generation_text`)."""
        directory = self.directory
        if self.committed == 0:  # generation 0 described, so that a later clean-up knows its files
            gen0 = generation_dir(directory, 0)
            try:
                os.makedirs(gen0, exist_ok=True)
                with open(os.path.join(gen0, GENERATION_MANIFEST), "w", encoding="utf-8") as f:
                    f.write(generation_text(0, self.entries))  # what the clean-up reads: the files
            except OSError as exc:
                raise write_error(directory, exc) from None
        staging = self.stage()
        try:
            with open(os.path.join(staging, GENERATION_MANIFEST), "w", encoding="utf-8") as f:
                f.write(generation_text(self.number, entries, ids_unique=ids_unique))
        except OSError as exc:
            raise write_error(directory, exc) from None
        pointer = os.path.join(directory, MANIFEST_NAME)
        fd, tmp = atomic_temp(pointer)
        target = generation_dir(directory, self.number)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pointer_text(self.number).encode("utf-8"))
            with commit_point():
                os.rename(staging, target)
                try:
                    os.replace(tmp, pointer)
                except BaseException:
                    os.rename(target, staging)
                    raise
            self.staging = ""
        except OSError as exc:
            raise write_error(directory, exc) from None
        finally:
            remove_quietly(tmp if os.path.exists(tmp) else None)
        self.committed = self.number

    def close(self) -> int:
        """Remove the staging folder (nothing committed) or the old generations (committed)."""
        try:
            if self.staging:
                shutil.rmtree(self.staging, ignore_errors=True)
                self.staging = ""
                return 0
            return clean_up(self.directory, self.committed)
        finally:
            self.lock.release()


def _open_current(directory: str) -> Corpus:
    corpus = open_corpus([directory])
    if corpus.quantization not in _EDITABLE:
        corpus.close()
        raise InputError(
            f"{directory}: holds {corpus.quantization} codes; add, delete and compact change full-precision "
            "and int8 corpora (change the full-precision corpus, then run maxsim quantize again)"
        )
    return corpus


def _current_entries(commit: _Commit, corpus: Corpus) -> list[ShardEntry]:
    """The committed generation's entries, aligned with ``corpus.shards``."""
    entries = commit.current().entries or []
    by_path = {os.path.realpath(os.path.join(commit.directory, e.path)): e for e in entries}
    return [by_path[os.path.realpath(s.path)] for s in corpus.shards]


def _with_deleted(
    commit: _Commit, entries: list[ShardEntry], new_rows: dict[int, np.ndarray]
) -> list[ShardEntry]:
    """``entries`` with ``new_rows`` (per entry index) deleted too; a shard left with no document is
    dropped."""
    out = []
    for i, entry in enumerate(entries):
        rows = new_rows.get(i)
        if rows is None or not len(rows):
            out.append(entry)
            continue
        merged = np.union1d(entry.deleted, rows).astype(np.int64)
        if len(merged) == entry.num_docs:
            continue  # every document deleted: the shard leaves the generation
        path, sha = commit.write_deleted(f"{i:05d}.deleted.npy", merged)
        out.append(dataclasses.replace(entry, deleted=merged, deleted_path=path, deleted_sha256=sha))
    return out


def _shard_metadata(path: str) -> dict[str, Any]:
    """A shard's metadata (dim, dtype, quantization, encoder, num_docs), from its header alone where it
    is a safetensors file."""
    from maxsim_cli.shards.readers import open_shard, shard_kind
    from maxsim_cli.shards.safetensors_shard import shard_metadata

    if shard_kind(path) == "safetensors":
        return shard_metadata(path)
    with open_shard(path) as shard:
        info = shard.info
        return {"dim": info.dim, "dtype": info.dtype, "quantization": info.quantization,
                "encoder": info.encoder, "num_docs": info.num_docs}  # fmt: skip


def _changed(path: str, holds: int, recorded: int) -> InputError:
    return input_error(
        path, f"num_docs={holds} but the manifest says {recorded}; the shard changed since it was recorded"
    )


def _corpus_metadata(directory: str, entries: list[ShardEntry]) -> dict[str, Any]:
    """What a write command needs of the committed generation's shards, read from their headers: the
    dim, dtype, quantization (one that add, delete and compact take) and encoder they share, each
    shard's document count checked against the manifest's."""
    if not any(e.num_docs for e in entries):  # no shard, or none with a document: open_corpus names it
        open_corpus([directory]).close()
        raise input_error(directory, "holds no documents; a corpus needs at least one document")
    metas = []
    for entry in entries:
        path = os.path.join(directory, entry.path)
        meta = _shard_metadata(path)
        if meta["num_docs"] != entry.num_docs:
            raise _changed(path, meta["num_docs"], entry.num_docs)
        metas.append(meta)
    first = metas[0]
    if first["quantization"] not in _EDITABLE:
        raise InputError(
            f"{directory}: holds {first['quantization']} codes; add, delete and compact change "
            "full-precision and int8 corpora (change the full-precision corpus, then run maxsim quantize "
            "again)"
        )
    encoders = {m["encoder"] for m in metas} - {None}
    return {**first, "encoder": next(iter(encoders), None) if len(encoders) == 1 else first["encoder"]}


def _indexed(
    commit: _Commit, entries: list[ShardEntry], log: Callable[[str], None], skip: Sequence[int] = ()
) -> tuple[list[IndexedShard], bool]:
    """Each entry's id index (but those at positions ``skip``), read (its sha256 checked) or, where it
    is missing or damaged, built from its shard into the new generation (the entry then names the new
    file: a warning says which); and whether every one was read as recorded (nothing built)."""
    from maxsim_cli.shards.readers import open_shard

    def recorded(entry: ShardEntry) -> IdIndex | IdIndexError | None:
        if entry.ids_path is None or entry.ids_sha256 is None:
            return None
        try:
            return read_index(
                os.path.join(commit.directory, entry.ids_path), entry.ids_sha256, entry.num_docs
            )
        except IdIndexError as exc:
            return exc

    chosen = [i for i in range(len(entries)) if i not in skip]
    # reading a file and its sha256 leave the GIL: the shards' indexes are read on every core
    read = parallel_map(recorded, [entries[i] for i in chosen])
    out = []
    as_recorded = True
    for i, index in zip(chosen, read, strict=True):
        entry = entries[i]
        path = os.path.join(commit.directory, entry.path)
        if isinstance(index, IdIndexError):
            log(f"warning: {index}; built again from {path}")
            index = None
        if index is None:
            with open_shard(path) as shard:
                if shard.num_docs != entry.num_docs:
                    raise _changed(path, shard.num_docs, entry.num_docs)
                index = build_index(shard.id_array)
            entry.ids_path, entry.ids_sha256 = commit.write_index(f"{i:05d}{ID_INDEX_SUFFIX}", index)
            as_recorded = False
        out.append(IndexedShard(path, entry.num_docs, index, entry.deleted))
    return out, as_recorded


def _checked_unique(commit: _Commit, state: State, log: Callable[[str], None]) -> list[IndexedShard]:
    """The committed generation's shards with their id indexes (`_indexed`); its live ids checked
    unique across them, once, where its manifest does not record it (or an index was built again)."""
    assert state.entries is not None
    trusted = state.ids_unique
    shards, as_recorded = _indexed(commit, state.entries, log)
    if not (trusted and as_recorded):
        check_unique(shards)
    return shards


def _rows_by_shard(shard: np.ndarray, rows: np.ndarray) -> dict[int, np.ndarray]:
    """Rows (of the shards ``shard``, one each) grouped by shard, sorted."""
    out: dict[int, np.ndarray] = {}
    for s in np.unique(shard).tolist():
        out[s] = np.sort(rows[shard == s])
    return out


# --------------------------------------------------------------------------------------------------
# add


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
        shutil.copyfile(source, target)


def add_shards(
    directory: str,
    sources: Sequence[str],
    *,
    replace: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> Change:
    """Add the shards of ``sources`` (shard files and/or folders) to the corpus folder ``directory`` in
    one commit. Their ids must be new to the corpus (``replace``: the documents they name are deleted in
    the same commit, an upsert), their dim, dtype, quantization and encoder the corpus's; everything is
    checked before anything is written. The shards are hard-linked into the new generation's folder
    (copied where a link cannot be made)."""
    directory = _check_folder(directory)
    if not sources:
        raise UsageError("maxsim add: give at least one shard file or folder to add")
    root = os.path.realpath(directory)
    for source in sources:
        real = os.path.realpath(source)
        if os.path.exists(source) and os.path.commonpath([root, real]) == root:
            raise InputError(
                f"{source}: lies inside the corpus folder {directory}; add shards from elsewhere"
            )
    commit = _Commit(directory)
    try:
        state = commit.current()
        entries = state.entries or []
        meta = _corpus_metadata(directory, entries)
        with open_corpus(list(sources)) as new:
            if new.num_deleted:
                raise InputError(
                    f"{new.name}: has {new.num_deleted} deleted documents; compact it first "
                    "(maxsim compact --threshold 0) or add its documents from a fresh pack"
                )
            for key in ("dim", "dtype", "quantization"):
                if getattr(new, key) != meta[key]:
                    raise input_error(
                        new.shards[0].path,
                        f"{key}={getattr(new, key)} but the corpus {directory} has "
                        f"{key}={meta[key]}; added shards need the corpus's dim, dtype and "
                        "quantization",
                    )
            if new.encoder is not None and meta["encoder"] is not None and new.encoder != meta["encoder"]:
                raise input_error(
                    new.shards[0].path,
                    f"made by encoder {new.encoder!r} but the corpus {directory} by {meta['encoder']!r}; "
                    "their scores cannot be compared",
                )
            shards = _checked_unique(commit, state, log)
            new_ids = concat_ids([s.id_array for s in new.shards])
            found_shard, found_row = find_ids(shards, new_ids)
            present = np.flatnonzero(found_shard >= 0)
            if len(present) and not replace:
                i = int(present[0])
                s = int(np.searchsorted(new.doc_starts, i, side="right") - 1)
                raise input_error(
                    new.shards[s].path,
                    f"id {show_id(new_ids[i].as_py())} (document {i - int(new.doc_starts[s])}) is already "
                    f"in the corpus {directory} ({len(present)} such ids); give new ids, or --replace to "
                    "replace those documents",
                )
            num_live = sum(e.num_docs - len(e.deleted) for e in entries)
            entries = _with_deleted(commit, entries, _rows_by_shard(found_shard[present], found_row[present]))
            staging = commit.stage()
            for k, shard in enumerate(new.shards):
                name = f"{k:05d}-{os.path.basename(shard.path)}"
                target = os.path.join(staging, name)
                try:
                    _link_or_copy(shard.path, target)
                except OSError as exc:
                    raise write_error(directory, exc) from None
                entry = ShardEntry(commit.rel(name), shard.num_docs, shard.num_tokens, file_sha256(target))
                entry.ids_path, entry.ids_sha256 = commit.write_index(
                    name + ID_INDEX_SUFFIX, build_index(shard.id_array)
                )
                entries.append(entry)
            change = Change(
                commit.number,
                num_live - len(present) + new.num_live,
                sum(len(e.deleted) for e in entries),
                added=new.num_live,
                deleted=len(present),
            )
        # the live ids were unique, the added ones are (open_corpus) and new to them (or replaced)
        commit.commit(entries, ids_unique=True)
        change.removed = commit.close()
        return change
    except BaseException:
        commit.close()
        raise


# --------------------------------------------------------------------------------------------------
# delete


def delete_ids(
    directory: str,
    ids: Sequence[str],
    *,
    strict: bool = False,
    source: str = "ids",
    log: Callable[[str], None] = lambda _: None,
) -> Change:
    """Delete the documents ``ids`` name from the corpus folder ``directory`` in one commit. Ids the
    corpus does not hold are warned about through ``log`` (``strict``: an error, nothing committed)."""
    directory = _check_folder(directory)
    commit = _Commit(directory)
    try:
        state = commit.current()
        entries = state.entries or []
        _corpus_metadata(directory, entries)
        shards = _checked_unique(commit, state, log)
        wanted = list(dict.fromkeys(ids))
        found_shard, found_row = find_ids(shards, wanted)
        unknown = np.flatnonzero(found_shard < 0)
        if len(unknown):
            first = show_id(wanted[int(unknown[0])])
            fact = (
                f"{source}: {len(unknown)} of {len(wanted)} ids are not in the corpus {directory} "
                f"(first: {first})"
            )
            if strict:
                raise InputError(f"{fact}; nothing was deleted (leave out --strict to delete the others)")
            log(f"warning: {fact}; they are ignored (--strict makes this an error)")
        found = found_shard >= 0
        num_live = sum(e.num_docs - len(e.deleted) for e in entries)
        num_deleted = sum(len(e.deleted) for e in entries)
        change = Change(None, num_live, num_deleted, deleted=int(found.sum()), unknown=len(unknown))
        if not found.any():
            commit.close()
            return change
        if change.deleted == num_live:
            raise InputError(
                f"{source}: would delete every document of the corpus {directory}; a corpus needs at "
                "least one document"
            )
        entries = _with_deleted(commit, entries, _rows_by_shard(found_shard[found], found_row[found]))
        change = Change(
            commit.number,
            num_live - change.deleted,
            sum(len(e.deleted) for e in entries),
            deleted=change.deleted,
            unknown=len(unknown),
        )
        commit.commit(entries, ids_unique=True)  # deleting keeps the live ids unique
        change.removed = commit.close()
        return change
    except BaseException:
        commit.close()
        raise


# --------------------------------------------------------------------------------------------------
# compact


class _MetadataRows:
    """The metadata columns of a shard's documents, asked for in increasing document order: one record
    batch / row group of them held at a time (`Shard.metadata_tables`, each validated as it is read)."""

    def __init__(self, shard: Any, schema: Any) -> None:
        self.path = shard.path
        self.chunks = shard.metadata_tables(schema.names)
        self.first = 0
        self.table: Any = None

    def take(self, docs: np.ndarray) -> Any:
        """The rows of documents ``docs`` (shard indices, increasing, each past those asked before)."""
        import pyarrow as pa

        pieces = []
        i = 0
        while i < len(docs):
            while self.table is None or docs[i] >= self.first + self.table.num_rows:
                chunk = next(self.chunks, None)
                if chunk is None:
                    raise input_error(self.path, f"no metadata columns for document index {int(docs[i])}")
                self.first, self.table = chunk
            end = int(np.searchsorted(docs, self.first + self.table.num_rows))
            pieces.append(self.table.take(pa.array(docs[i:end] - self.first)))
            i = end
        return pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)


def compact(
    directory: str,
    threshold: float = DEFAULT_THRESHOLD,
    *,
    progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> Change:
    """Rewrite, in one commit, the shards of the corpus folder ``directory`` whose deleted share reaches
    ``threshold`` (0 to 1; 0: every shard with a deleted document) without their deleted documents,
    read and written a bounded batch at a time (the shard writers). Nothing to rewrite: no commit, but
    what killed writers left and old generations no reader holds are still removed."""
    directory = _check_folder(directory)
    if not 0.0 <= threshold <= 1.0:
        raise UsageError(f"--threshold {threshold}: give the deleted share as a number from 0 to 1")
    from maxsim_cli.shards.readers import open_shard
    from maxsim_cli.shards.writers import ShardWriter

    commit = _Commit(directory)
    try:
        with _open_current(directory) as corpus:
            entries = _current_entries(commit, corpus)
            chosen = [
                i for i, e in enumerate(entries)
                if len(e.deleted) and len(e.deleted) >= threshold * e.num_docs
            ]  # fmt: skip
            change = Change(None, corpus.num_live, corpus.num_deleted)
            if not chosen:
                change.removed = commit.close()
                return change
            total = sum(entries[i].num_tokens for i in chosen)
            done = 0
            staging = commit.stage()
            for i in chosen:
                shard, entry = corpus.shards[i], entries[i]
                info = shard.info
                itemsize = 1 if info.dtype == "int8" else 2 if info.dtype in ("float16", "bfloat16") else 4
                batch_tokens = max(1, COMPACT_BATCH_BYTES // (info.width * itemsize))
                live = np.setdiff1d(np.arange(entry.num_docs, dtype=np.int64), entry.deleted)
                name = f"{i:05d}-{os.path.basename(entry.path)}"
                target = os.path.join(staging, name)
                # the metadata columns (Arrow, Parquet) come along, the surviving documents' rows
                carried = shard.metadata_schema()
                carried = carried if carried is not None and len(carried) else None
                metadata = None if carried is None else _MetadataRows(shard, carried)
                with ShardWriter(
                    target,
                    info.dim,
                    info.dtype,
                    encoder=info.encoder,
                    format=info.format,
                    patch_grid=info.patch_grid,
                    patch_start=info.patch_start,
                    quantization=info.quantization,
                    warn_zero_rows=False,
                    metadata_columns=carried,
                ) as writer:
                    a = 0
                    while a < len(live):
                        start = int(shard.offsets[live[a]])
                        b = int(np.searchsorted(shard.offsets[live + 1], start + batch_tokens, side="right"))
                        b = min(max(b, a + 1), len(live))
                        batch = shard.read_doc_indices(live[a:b])
                        writer.add(
                            batch.ids,
                            batch.embeddings,
                            offsets=batch.offsets,
                            scales=batch.scales,
                            metadata_columns=None if metadata is None else metadata.take(live[a:b]),
                        )
                        a = b
                    written = writer.close()
                done += entry.num_tokens
                if progress is not None:
                    progress(done, total)
                entries[i] = ShardEntry(
                    commit.rel(name), written.num_docs, written.num_tokens, file_sha256(target)
                )
                with open_shard(target) as rewritten:
                    index = build_index(rewritten.id_array)
                entries[i].ids_path, entries[i].ids_sha256 = commit.write_index(name + ID_INDEX_SUFFIX, index)
            _indexed(commit, entries, log, skip=chosen)  # every shard indexed: the ids recorded unique
            change = Change(
                commit.number, corpus.num_live, sum(len(e.deleted) for e in entries), compacted=len(chosen)
            )
        # the live ids were unique (open_corpus checks them, or their record), and compacting keeps them
        commit.commit(entries, ids_unique=True)
        change.removed = commit.close()
        return change
    except BaseException:
        commit.close()
        raise
