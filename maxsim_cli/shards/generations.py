"""Generations of a corpus folder: the committed state a reader opens, and the locks that keep it whole.

A corpus folder that a write command (`maxsim add`, `delete`, `compact`; `maxsim_cli.shards.edit`)
has changed holds, beside its shards (docs/format.md, "Generations"):

- ``index.json``, the *pointer* (``format_version`` 2): the committed generation's number and manifest.
  A commit replaces it with one rename, so a reader sees the old generation or the new one, never a mix;
- ``generations/<n>/manifest.json``: generation n's shards (with counts and sha256) and, per shard, its
  deleted rows: a sorted int64 ``.npy`` file (with its count and sha256) in a generation's folder, and
  its id index (``ids``: `maxsim_cli.shards.id_index`, with its sha256); and ``unique_ids``, the record
  that the writer checked the live ids unique across the generation (`unique_ids_digest`);
- ``generations/<n>/``: the files generation n brought (shards added, shards compacted, deletion sets).

A folder without a pointer (a ``format_version`` 1 ``index.json`` or none) is generation 0, read as
before. `read_state` gives a folder's committed generation; `ReaderLock` is what a reader holds while
it has a generation open: a shared `fcntl.flock` on that generation's manifest (on the folder itself
for generation 0), which the writer's clean-up tries to take exclusively, without waiting, before it
removes a generation's files. `WriterLock` is the one writer's exclusive lock (on ``generations/``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from maxsim_cli.errors import InputError, MaxsimError
from maxsim_cli.shards.format import CORPUS_FORMAT_NAME, MANIFEST_NAME, input_error, one_line

# The pointer: index.json of a folder with generations.
POINTER_VERSION = 2
GENERATIONS_DIR = "generations"
GENERATION_MANIFEST = "manifest.json"
GENERATION_FORMAT_NAME = "maxsim-generation"
GENERATION_FORMAT_VERSION = 1
# A reader that meets a generation being removed (a writer's clean-up holds its lock) reads the pointer
# again; the pointer has moved on by then, so more than a few tries means something else is wrong.
OPEN_TRIES = 50
_NUMBERED = re.compile(r"^(0|[1-9][0-9]{0,17})$")


def generation_dir(directory: str, number: int) -> str:
    return os.path.join(directory, GENERATIONS_DIR, str(number))


def manifest_path(directory: str, number: int) -> str:
    return os.path.join(generation_dir(directory, number), GENERATION_MANIFEST)


@dataclass
class ShardEntry:
    """One shard of a generation: its path relative to the corpus folder, counts, sha256, the rows
    deleted from it (``deleted``: sorted unique int64 rows; ``deleted_path``: their file) and its id
    index (``ids_path``, ``ids_sha256``; None for a shard recorded without one)."""

    path: str
    num_docs: int
    num_tokens: int
    sha256: str | None
    deleted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    deleted_path: str | None = None
    deleted_sha256: str | None = None
    ids_path: str | None = None
    ids_sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "num_docs": self.num_docs, "num_tokens": self.num_tokens}
        out["sha256"] = self.sha256
        if self.deleted_path is not None:
            out["deleted"] = {
                "path": self.deleted_path,
                "count": len(self.deleted),
                "sha256": self.deleted_sha256,
            }
        if self.ids_path is not None:
            out["ids"] = {"path": self.ids_path, "sha256": self.ids_sha256}
        return out

    def files(self) -> list[str]:
        return [self.path] + [p for p in (self.deleted_path, self.ids_path) if p]


# What `unique_ids_digest` hashes first: a digest of another kind or version never matches.
_UNIQUE_IDS_KIND = "maxsim-unique-ids-1\n"
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")


def unique_ids_digest(pairs: list[tuple[str | None, str | None]]) -> str | None:
    """The ``unique_ids`` record of a generation whose shards have, in order, these (id index sha256,
    deletion set sha256 or None): a writer that checked the live ids unique across the shards writes it,
    and a reader that finds it equal to the digest of what the manifest names trusts it (a shard, an id
    index or a deletion set changed by hand since makes them differ). None when a shard has no index."""
    if any(ids is None for ids, _ in pairs):
        return None
    text = _UNIQUE_IDS_KIND + "".join(f"{ids} {deleted or '-'}\n" for ids, deleted in pairs)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def entries_digest(entries: list[ShardEntry]) -> str | None:
    """`unique_ids_digest` of a generation's entries."""
    return unique_ids_digest([(e.ids_sha256, e.deleted_sha256 if e.deleted_path else None) for e in entries])


def parse_unique_record(manifest: str, value: Any) -> str | None:
    """A manifest's ``unique_ids`` (a sha256, lower-cased), or None when it has none."""
    if value is not None and (not isinstance(value, str) or not _SHA256.match(value)):
        raise input_error(manifest, f"'unique_ids' must be a sha256 (64 hex digits), got {value!r}")
    return value.lower() if value is not None else None


def parse_ids_record(manifest: str, directory: str, raw: Any, where: str) -> tuple[str, str]:
    """A shard's ``ids`` record (its id index: path and sha256), checked as a manifest's paths are; the
    file itself may be missing (a write command builds it again)."""
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("sha256"), str)
        or not _SHA256.match(raw["sha256"])
    ):
        raise input_error(
            manifest, f"{where} ids must be an object with a path and a sha256 (64 hex digits), got {raw!r}"
        )
    rel = _relative(manifest, directory, raw.get("path"), f"{where} ids path", must_exist=False)
    return rel, raw["sha256"].lower()


@dataclass
class State:
    """A corpus folder's committed generation: its number and shards (generation 0: the folder as
    packed, ``entries`` None when it has no manifest and its shards are whatever files it holds), and
    its ``unique_ids`` record (None when it has none)."""

    number: int
    entries: list[ShardEntry] | None
    unique_ids: str | None = None

    @property
    def ids_unique(self) -> bool:
        """Whether the manifest records the live ids unique, for the shards, id indexes and deletion sets
        it names (`unique_ids_digest`)."""
        return (
            self.entries is not None
            and self.unique_ids is not None
            and (self.unique_ids == entries_digest(self.entries))
        )

    @property
    def num_deleted(self) -> int:
        return sum(len(e.deleted) for e in self.entries or ())


def _load_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise input_error(path, f"not valid JSON: {one_line(exc)}") from None


def read_pointer(directory: str) -> int | None:
    """The committed generation named by ``directory/index.json``, or None for a folder at generation 0
    (no index.json, or one of format_version 1)."""
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.exists(path):
        return None
    doc = _load_json(path)
    if not isinstance(doc, dict) or doc.get("format") != CORPUS_FORMAT_NAME:
        return None  # read_manifest names the problem
    if doc.get("format_version") != POINTER_VERSION:
        return None
    number = doc.get("generation")
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise input_error(path, f"'generation' must be a positive integer, got {number!r}")
    want = f"{GENERATIONS_DIR}/{number}/{GENERATION_MANIFEST}"
    if doc.get("manifest") != want:
        raise input_error(
            path, f"'manifest' must be {want!r} for generation {number}, got {doc.get('manifest')!r}"
        )
    return number


def pointer_text(number: int) -> str:
    doc = {
        "format": CORPUS_FORMAT_NAME,
        "format_version": POINTER_VERSION,
        "generation": number,
        "manifest": f"{GENERATIONS_DIR}/{number}/{GENERATION_MANIFEST}",
    }
    return json.dumps(doc, indent=1) + "\n"


def _relative(manifest: str, directory: str, rel: Any, what: str, *, must_exist: bool = True) -> str:
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise input_error(
            manifest, f"{what} must be a relative file name inside the corpus folder, got {rel!r}"
        )
    parts = re.split(r"[\\/]", rel)
    if os.path.isabs(rel) or rel.startswith(("/", "\\")) or ".." in parts:
        raise input_error(manifest, f"{what} {rel!r} names a file outside the corpus folder")
    root = os.path.realpath(directory)
    real = os.path.realpath(os.path.join(directory, rel))
    if os.path.commonpath([root, real]) != root:
        raise input_error(
            manifest, f"{what} {rel!r} resolves (through a symlink) to {real}, outside the corpus folder"
        )
    if must_exist and not os.path.isfile(os.path.join(directory, rel)):
        raise input_error(manifest, f"{what} {rel!r}: no such file in {directory}")
    return rel


def _count(manifest: str, entry: dict[str, Any], key: str, where: str) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise input_error(manifest, f"{where} {key} must be a non-negative integer, got {value!r}")
    return value


def read_deleted(path: str, num_docs: int, count: int, sha256: Any, manifest: str) -> np.ndarray:
    """A shard's deleted rows from their ``.npy`` file, checked: sha256 as recorded, one dimension of
    integers, strictly increasing, inside ``0..num_docs-1``, ``count`` of them."""
    with open(path, "rb") as f:
        data = f.read()
    got = hashlib.sha256(data).hexdigest()
    if not isinstance(sha256, str) or got != sha256.lower():
        raise input_error(
            path, f"sha256 {got} does not match {sha256!r} in {manifest}; the file changed or is damaged"
        )
    import io

    try:
        rows = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise input_error(path, f"not a .npy array of rows: {one_line(exc)}") from None
    if rows.ndim != 1 or rows.dtype.kind not in "iu":
        raise input_error(
            path, f"deleted rows must be one dimension of integers, got {rows.dtype} {rows.shape}"
        )
    rows = rows.astype(np.int64)
    if len(rows) != count:
        raise input_error(path, f"holds {len(rows)} rows but {manifest} says {count}")
    if len(rows) and (rows[0] < 0 or rows[-1] >= num_docs or (len(rows) > 1 and (np.diff(rows) <= 0).any())):
        raise input_error(path, f"deleted rows must be strictly increasing and inside 0..{num_docs - 1}")
    return rows


def read_generation(directory: str, number: int) -> list[ShardEntry]:
    """Generation ``number``'s shards from its manifest, every path and deletion set checked."""
    return read_state(directory, number).entries or []


def read_state(directory: str, number: int) -> State:
    """Generation ``number`` from its manifest (`read_generation`), with its ``unique_ids`` record."""
    manifest = manifest_path(directory, number)
    if not os.path.isfile(manifest):
        raise input_error(
            manifest, f"no such file: the pointer names generation {number}, whose manifest is missing"
        )
    doc = _load_json(manifest)
    if not isinstance(doc, dict) or doc.get("format") != GENERATION_FORMAT_NAME:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise input_error(manifest, f"unknown format {got!r} (expected {GENERATION_FORMAT_NAME!r})")
    if doc.get("format_version") != GENERATION_FORMAT_VERSION:
        raise input_error(
            manifest,
            f"unsupported format_version {doc.get('format_version')!r} (this maxsim reads version "
            f"{GENERATION_FORMAT_VERSION})",
        )
    if doc.get("generation") != number:
        raise input_error(
            manifest, f"says generation {doc.get('generation')!r}, but its folder is generation {number}"
        )
    shards = doc.get("shards")
    if not isinstance(shards, list) or not shards:
        raise input_error(manifest, "'shards' must be a non-empty list")
    out = []
    for i, raw in enumerate(shards):
        if not isinstance(raw, dict):
            raise input_error(manifest, f"shards[{i}] must be an object")
        rel = _relative(manifest, directory, raw.get("path"), f"shards[{i}] path")
        num_docs = _count(manifest, raw, "num_docs", f"shards[{i}]")
        entry = ShardEntry(
            rel, num_docs, _count(manifest, raw, "num_tokens", f"shards[{i}]"), raw.get("sha256")
        )
        deleted = raw.get("deleted")
        if deleted is not None:
            if not isinstance(deleted, dict):
                raise input_error(manifest, f"shards[{i}] deleted must be an object (path, count, sha256)")
            entry.deleted_path = _relative(
                manifest, directory, deleted.get("path"), f"shards[{i}] deleted path"
            )
            entry.deleted_sha256 = deleted.get("sha256")
            entry.deleted = read_deleted(
                os.path.join(directory, entry.deleted_path),
                num_docs,
                _count(manifest, deleted, "count", f"shards[{i}] deleted"),
                entry.deleted_sha256,
                manifest,
            )
        if raw.get("ids") is not None:
            entry.ids_path, entry.ids_sha256 = parse_ids_record(
                manifest, directory, raw["ids"], f"shards[{i}]"
            )
        out.append(entry)
    return State(number, out, parse_unique_record(manifest, doc.get("unique_ids")))


def generation_text(number: int, entries: list[ShardEntry], *, ids_unique: bool = False) -> str:
    """Generation ``number``'s manifest; ``ids_unique``: the writer checked the live ids unique across
    ``entries``, which the manifest then records (``unique_ids``, when every shard has an id index)."""
    doc: dict[str, Any] = {
        "format": GENERATION_FORMAT_NAME,
        "format_version": GENERATION_FORMAT_VERSION,
        "generation": number,
        "num_docs": sum(e.num_docs - len(e.deleted) for e in entries),
        "num_deleted": sum(len(e.deleted) for e in entries),
        "shards": [e.to_json() for e in entries],
    }
    digest = entries_digest(entries) if ids_unique else None
    if digest is not None:
        doc["unique_ids"] = digest
    return json.dumps(doc, indent=1) + "\n"


# --------------------------------------------------------------------------------------------------
# locks


class ReaderLock:
    """A shared `flock` held on an open generation (its manifest; the folder for generation 0) while a
    reader has it open: the writer's clean-up leaves that generation's files alone. `release` (or the
    process's end, a SIGKILL included) lets it go."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)  # closing the descriptor releases its flock
            self.fd = None


def _try_lock(path: str, how: int) -> int | None:
    """A descriptor of ``path`` holding ``flock(how | LOCK_NB)``, or None when another holds it."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if os.path.isdir(path) else 0)
    fd = os.open(path, flags)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def open_state(directory: str, number: int | None = None) -> tuple[State, ReaderLock]:
    """The folder's committed generation, read under a shared lock that the caller holds until it no
    longer reads the generation's files (`ReaderLock.release`). ``number``: that generation instead,
    which another reader of the job holds open (`open_generation`)."""
    if number is not None:
        return open_generation(directory, number)
    for _ in range(OPEN_TRIES):
        number = read_pointer(directory)
        if number is None:  # generation 0: the folder itself is locked
            fd = _try_lock(directory, fcntl.LOCK_SH)
            if fd is None:
                continue
            if read_pointer(directory) is not None:  # converted meanwhile
                os.close(fd)
                continue
            return State(0, None), ReaderLock(fd)
        path = manifest_path(directory, number)
        try:
            fd = _try_lock(path, fcntl.LOCK_SH)
        except FileNotFoundError:
            if read_pointer(directory) == number:  # not a clean-up after a newer commit: it is missing
                raise input_error(
                    path, f"no such file: the pointer names generation {number}, whose manifest is missing"
                ) from None
            continue  # removed by a clean-up after a newer commit: read the pointer again
        if fd is None:
            time.sleep(0.01)  # a writer's clean-up holds it for as long as it removes its files
            continue
        if not _same_file(fd, path):
            os.close(fd)
            continue
        try:
            return read_state(directory, number), ReaderLock(fd)
        except BaseException:
            os.close(fd)
            raise
    raise MaxsimError(f"{directory}: the committed generation kept changing while it was opened; try again")


def open_generation(directory: str, number: int) -> tuple[State, ReaderLock]:
    """Generation ``number`` of the folder, committed or not any longer, read under a shared lock as
    `open_state` reads the committed one. For a generation another reader holds open, so that no
    writer's clean-up removes its files meanwhile: the one rank 0 of a job found, which every rank
    opens; the one a corpus holds, opened again (`Corpus.reopen`). Generation 0 of a folder converted
    since is read from the description its first write left (``generations/0/manifest.json``)."""
    target = directory if number == 0 else manifest_path(directory, number)
    gone = (
        f"generation {number}, which this job opened, is no longer there (a write command committed a "
        "newer one and removed it); run the command again"
    )  # only when no reader held it
    try:
        fd = _try_lock(target, fcntl.LOCK_SH)
    except FileNotFoundError:
        raise input_error(target, gone) from None
    if fd is None:  # a writer's clean-up holds it: it is removing the generation's files
        raise input_error(target, gone)
    try:
        if number == 0 and read_pointer(directory) is None:
            return State(0, None), ReaderLock(fd)
        return read_state(directory, number), ReaderLock(fd)
    except BaseException:
        os.close(fd)
        raise


def committed_generations(paths: Sequence[str]) -> tuple[list[int | None], list[ReaderLock]]:
    """The committed generation of each corpus folder in ``paths`` (None for a file, or a path that is
    not there: opening the corpus reports it), each held open by a lock returned with them, so that
    other processes can open the same generations (`open_generation`) for as long as the locks are
    held."""
    numbers: list[int | None] = []
    locks: list[ReaderLock] = []
    try:
        for path in paths:
            if not os.path.isdir(path):
                numbers.append(None)
                continue
            state, lock = open_state(path)
            locks.append(lock)
            numbers.append(state.number)
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return numbers, locks


class WriterLock:
    """The one writer of a corpus folder: an exclusive `flock` on its ``generations/`` folder (made if
    need be), taken without waiting; a second writer is refused in one line."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        folder = os.path.join(directory, GENERATIONS_DIR)
        try:
            os.makedirs(folder, exist_ok=True)
            fd = _try_lock(folder, fcntl.LOCK_EX)
        except OSError as exc:
            from maxsim_cli.shards.files import write_error

            raise write_error(directory, exc) from None
        if fd is None:
            raise InputError(
                f"{directory}: another maxsim add/delete/compact is changing this corpus; wait for it to "
                "finish and run this command again"
            )
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> WriterLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def numbered_generations(directory: str) -> list[int]:
    """The generation folders present (committed, old, or left by an interrupted commit)."""
    folder = os.path.join(directory, GENERATIONS_DIR)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if _NUMBERED.match(n) and os.path.isdir(os.path.join(folder, n)))


def try_lock_generation(directory: str, number: int) -> int | None:
    """For the writer's clean-up: an exclusive lock on generation ``number`` (no reader of this machine
    holds it), or None. Generation 0's readers lock the folder itself."""
    target = directory if number == 0 else manifest_path(directory, number)
    try:
        return _try_lock(target, fcntl.LOCK_EX)
    except FileNotFoundError:
        return None
