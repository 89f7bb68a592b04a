"""Output paths: checked before any work, written atomically (or streamed), cleaned up on every exit path.

- `check_output(path, inputs, option=..., folder=False)`, called before any work: refuses an output that
  is one of the inputs (the same file by (st_dev, st_ino): the same path, through a symlink or a hard
  link; for a folder output, an input folder or a folder inside one) with a `UsageError`, and so a
  directory where a file is expected (or a file where a folder is) and a missing parent folder; a folder
  in which no file can be created (read-only file system, no permission) is a `MaxsimError`.
- `OutputFile(path)`: a regular file (or a new path; a symlink is followed to the file it names) is
  written to a temp file ``.NAME.XXXX.tmp`` next to it, with the permissions a plain `open` would give,
  and moved into place with `os.replace` only when everything was written; a FIFO, a device
  (``/dev/null``) or a file descriptor's path (``/dev/stdout``) is opened and written through, never
  replaced.
- `write_error(path, exc)`: an `OSError` met while writing (ENOSPC, EROFS, EACCES, EDQUOT, EISDIR, ...)
  as a one-line `OutputWriteError` naming the path.
- `staging_dir` (a working folder that becomes an output folder), `swap_corpus_files` (a new corpus in
  place of an old one) and `write_text_atomic`.

The step that puts a command's output in place (`OutputFile(path, commits=True)`'s rename, the last
rename of `swap_corpus_files`) is a commit point (`maxsim_cli.lifeline.commit_point`): a stop signal
from then on no longer stops the command, whose output is complete.

Temp files and folders are removed by ``except BaseException`` / ``__exit__`` paths, so an error,
Ctrl-C and SIGTERM / SIGHUP (which the CLI turns into `SystemExit`, see `maxsim_cli.cli`) all leave no
temp file behind and the previous output as it was.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable
from typing import IO

from maxsim_cli.errors import MaxsimError, Option, UsageError
from maxsim_cli.lifeline import commit_point
from maxsim_cli.shards.format import MANIFEST_NAME, SHARD_SUFFIXES

# What the user can do about a write error, by errno.
_HINTS = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EDQUOT: "free some space or write elsewhere",
    errno.EFBIG: "write elsewhere",
    errno.EROFS: "write elsewhere",
    errno.EACCES: "check the permissions or write elsewhere",
    errno.EPERM: "check the permissions or write elsewhere",
}


class OutputWriteError(MaxsimError):
    """An output could not be written (exit code 1). ``path`` is the output named to the user."""

    def __init__(self, path: str, reason: str, hint: str = "", *, nothing_written: bool = True) -> None:
        self.path, self.reason, self.hint, self.nothing_written = path, reason, hint, nothing_written
        tail = "; nothing was written" if nothing_written else ""
        super().__init__(f"{path}: cannot write: {reason}{'; ' + hint if hint else ''}{tail}")

    def naming(self, path: str) -> OutputWriteError:
        """The same error, naming ``path`` (an output folder rather than a file in its staging folder)."""
        return OutputWriteError(path, self.reason, self.hint, nothing_written=self.nothing_written)


def _reason(exc: OSError) -> str:
    if exc.errno:
        text = os.strerror(exc.errno)
    else:  # pyarrow's IO errors may carry no errno
        text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:1].lower() + text[1:]


def write_error(path: str, exc: OSError, *, nothing_written: bool = True) -> OutputWriteError:
    """``exc``, met while writing the output ``path``, as a one-line error naming it."""
    return OutputWriteError(
        path, _reason(exc), _HINTS.get(exc.errno or 0, ""), nothing_written=nothing_written
    )


def current_umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _stat(path: str) -> os.stat_result | None:
    """``os.stat`` (following symlinks), or None when nothing is there or it cannot be looked at."""
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


def _is_special(st: os.stat_result) -> bool:
    return not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))


# A file descriptor named as a path: written through whatever it is (a FIFO, a terminal, or the regular
# file a shell redirected it to, which an atomic replace would take away from under the shell).
_FD_PATH = re.compile(r"/(dev/(stdout|stderr|fd/\d+)|proc/(self|thread-self|\d+)/fd/\d+)")


def is_stream(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is written through, never replaced: an existing FIFO, device or socket, or a
    file descriptor's path (``/dev/stdout``, ``/dev/fd/N``, ``/proc/self/fd/N``)."""
    name = os.fspath(path)
    if _FD_PATH.fullmatch(os.path.abspath(name)):
        return True
    st = _stat(name)
    return st is not None and _is_special(st)


def _target(path: str) -> str:
    """The file an atomic write of ``path`` replaces: what a symlink names (followed), else ``path``."""
    return os.path.realpath(path) if os.path.islink(path) else path


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _corpus_files(folder: str) -> Iterable[str]:
    """The files of a corpus folder that a reader reads: its shards and its manifest."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    return [
        e.path
        for e in entries
        if e.name == MANIFEST_NAME or os.path.splitext(e.name)[1].lower() in SHARD_SUFFIXES
    ]


def _clash(output: str, out_stat: os.stat_result | None, source: str, folder: bool) -> str | None:
    """How the output ``output`` would overwrite the input ``source``, or None."""
    in_stat = _stat(source)
    if in_stat is None:
        return None
    link = "" if os.path.abspath(output) == os.path.abspath(source) else " (the same file through a link)"
    if folder:
        if stat.S_ISDIR(in_stat.st_mode) and _inside(output, source):
            same = os.path.realpath(output) == os.path.realpath(source)
            return f"is {'the input folder' if same else 'inside the input folder'} {source}"
        if out_stat is not None and _same(out_stat, in_stat):
            return f"is the input {source}{link}"
        return None
    if out_stat is None or not stat.S_ISREG(out_stat.st_mode):
        return None
    if stat.S_ISREG(in_stat.st_mode):
        return f"is the input {source}{link}" if _same(out_stat, in_stat) else None
    if stat.S_ISDIR(in_stat.st_mode):
        for path in _corpus_files(source):
            file_stat = _stat(path)
            if file_stat is not None and _same(out_stat, file_stat):
                return f"is {path}, a file of the input folder {source}"
    return None


def new_file(
    directory: str, prefix: str, suffix: str, claim: Callable[[str], None] | None = None
) -> tuple[int, str]:
    """A new file ``PREFIX<random>SUFFIX`` in ``directory``, open for writing: ``(fd, path)``.

    One ``open(O_CREAT | O_EXCL)`` with mode 0o666 (the umask applies, as for a plain `open`), not
    mkstemp then fchmod: should a signal raise in the main thread right after the file is made, the
    file is removed here, so an interrupted caller never leaves a file it did not learn of. ``claim``,
    given, is called with the path once the file exists and before this returns: the caller's cleanup
    knows the file from then on, with no instant between this function's return and the caller's
    assignment at which a signal would leave it unknown (the fault-injection suite found one)."""
    for _ in range(100):
        path = os.path.join(directory, f"{prefix}{secrets.token_hex(6)}{suffix}")
        fd = -1
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            if claim is not None:
                claim(path)
            return fd, path
        except FileExistsError:
            continue
        except OSError:
            raise
        except BaseException:
            if fd >= 0:
                os.close(fd)
            remove_quietly(path)
            raise
    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), directory)


def _probe(folder: str, label: str) -> None:
    """Create and remove a file in ``folder``: a read-only file system or a missing permission shows
    here, before any work, rather than after it (root ignores permission bits, `os.access` would not)."""
    made: list[str] = []  # the probe's path, known before `new_file` returns (its ``claim``)
    try:
        fd, _ = new_file(folder, ".maxsim-probe-", ".tmp", made.append)
        os.close(fd)
    except OSError as exc:
        hint = _HINTS.get(exc.errno or 0, "")
        raise MaxsimError(
            f"{label}: cannot write in {folder}: {_reason(exc)}{'; ' + hint if hint else ''}"
        ) from None
    finally:
        for probe in made:
            remove_quietly(probe)


def check_output(
    path: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    *,
    option: str | Option = "-o",
    folder: bool = False,
) -> None:
    """Refuse, before any work, an output that would overwrite one of ``inputs`` or cannot be written.

    ``path`` is a file (``folder=False``; ``-`` is stdout and passes) or a folder to create or fill;
    ``inputs`` are files and folders (None and ``-`` are skipped). A file output may not be the same file
    as an input file or as a shard or the manifest of an input folder; a folder output may not be an input
    folder or lie inside one. A FIFO or a device passes (it is written through). Raises `UsageError` (exit
    2) naming both paths, or for a directory where a file is expected (or the reverse) or a missing parent
    folder, and `MaxsimError` for a folder where no file can be created. Messages name the output as
    ``option`` takes it: ``-o run.trec``, or an `Option`'s rendering (``path='run.trec'`` in Python).
    """
    name = os.fspath(path)
    if name == "-":
        return
    label = option.given(name) if isinstance(option, Option) else f"{option} {name}"
    out_stat = _stat(name)
    if not folder and is_stream(name):
        if out_stat is not None and not os.access(name, os.W_OK):
            raise MaxsimError(f"{label}: cannot write: permission denied")
        return
    for source in inputs:
        if source is None or os.fspath(source) == "-":
            continue
        clash = _clash(name, out_stat, os.fspath(source), folder)
        if clash is not None:
            raise UsageError(f"{label}: {clash}; write the output elsewhere")
    if out_stat is not None and folder and not stat.S_ISDIR(out_stat.st_mode):
        raise UsageError(f"{label}: exists and is not a directory; give a new or empty folder")
    if out_stat is not None and not folder and stat.S_ISDIR(out_stat.st_mode):
        raise UsageError(f"{label}: is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(name if folder else _target(name)))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise UsageError(f"{label}: folder {parent} {what}; create it first")
    _probe(parent, label)
    if folder and out_stat is not None:
        _probe(name, label)


def staging_dir(parent: str, prefix: str) -> str:
    """A new working folder ``PREFIX<random>`` in `parent` (same filesystem as the output, so renames
    are atomic), with the mode `mkdir` gives: it becomes the user's output folder. Made by one `mkdir`
    whose folder is removed again by whatever interrupts this function (a signal raising in the main
    thread just after the call), so that an interrupted caller never leaves one it did not learn of."""
    for _ in range(100):
        workdir = os.path.join(parent, f"{prefix}{secrets.token_hex(6)}")
        try:
            os.mkdir(workdir)
        except FileExistsError:
            continue
        except OSError as exc:
            raise write_error(parent, exc) from None
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(workdir)
            raise
        return workdir
    raise write_error(parent, FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST)))


def swap_corpus_files(staging: str, output_dir: str, new_names: list[str], old_names: list[str]) -> None:
    """Move the new corpus files ``new_names`` (the manifest last: a corpus appears complete or not at
    all) from ``staging`` into ``output_dir``, in place of ``old_names`` there (the old manifest first: an
    interrupted swap never shows a mixed corpus as whole). On any failure, a stop signal included, the
    new files there are removed and the old ones put back; each rename is noted before it is made, so
    one that a signal follows at once is undone too; the last one is the command's commit point
    (`maxsim_cli.lifeline.commit_point`). Raises `OutputWriteError` naming ``output_dir``, or
    `UsageError` for a new name that appeared there meanwhile. ``staging`` stays the caller's."""
    trash = staging_dir(output_dir, ".maxsim-old-") if old_names else ""
    set_aside: list[str] = []
    moved: list[str] = []
    try:
        for name in old_names:
            set_aside.append(name)
            move_into(os.path.join(output_dir, name), os.path.join(trash, name), output_dir)
        for i, name in enumerate(new_names):
            target = os.path.join(output_dir, name)
            if os.path.exists(target):
                raise UsageError(f"{output_dir}: {name} appeared while writing; nothing was written")
            moved.append(name)  # nothing was there: undoing a rename not made removes nothing
            # the last rename (the manifest) puts the new corpus in place: the command's commit point
            with commit_point() if i == len(new_names) - 1 else contextlib.nullcontext():
                move_into(os.path.join(staging, name), target, output_dir)
    except BaseException:
        for name in moved:
            remove_quietly(os.path.join(output_dir, name))
        for name in reversed(set_aside):
            with contextlib.suppress(OSError):
                os.replace(os.path.join(trash, name), os.path.join(output_dir, name))
        raise
    finally:
        if trash:
            shutil.rmtree(trash, ignore_errors=True)


def move_into(source: str, target: str, output_dir: str) -> None:
    """`os.replace`, an error naming ``output_dir`` (the output being written)."""
    try:
        os.replace(source, target)
    except OSError as exc:
        raise write_error(output_dir, exc) from None


def atomic_temp(path: str, claim: Callable[[str], None] | None = None) -> tuple[int, str]:
    """A temp file next to `path` (same filesystem, so `os.replace` is atomic) with the permissions a
    plain `open(path, "w")` would give, not mkstemp's 0600. A directory, FIFO or device at `path` is
    refused: `os.replace` would put a regular file in its place. ``claim`` as for `new_file`."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{path}: directory {directory} does not exist; create it first")
    existing = _stat(path)
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        what = "a directory" if stat.S_ISDIR(existing.st_mode) else "not a regular file"
        raise UsageError(f"{path}: is {what}; give a file name")
    try:
        return new_file(directory, f".{os.path.basename(path)}.", ".tmp", claim)
    except OSError as exc:
        raise write_error(path, exc) from None


def remove_quietly(path: str | None) -> None:
    """Remove the file at `path` if there is one (None: nothing to remove)."""
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class OutputFile:
    """A binary output file: ``with OutputFile(path) as fh: fh.write(...)``.

    A regular file or a new path is written to a temp file in the folder of the file it names (a symlink
    is followed) and moved into place only when the block ends without an exception; otherwise the temp
    file is removed and whatever was at ``path`` stays as it was. A FIFO or a device is opened and written
    through, never replaced. An `OSError` opening, writing, closing or moving the file becomes
    `write_error` naming ``path`` (a `BrokenPipeError` stays one: the reader went away).
    `open` / `commit` / `abort` do the same by hand. ``commits=True``: the file is the command's output,
    and its rename (or a stream's close) is the command's commit point (`maxsim_cli.lifeline`).
    """

    def __init__(self, path: str | os.PathLike[str], *, commits: bool = False) -> None:
        self.path = os.fspath(path)
        self.commits = commits
        self.stream = is_stream(self.path)
        self._file: IO[bytes] | None = None
        self._tmp: str | None = None
        self._target = self.path

    def open(self) -> IO[bytes]:
        """Open the output; returns the binary file to write to."""
        if self.stream:
            try:
                # appending: a FIFO or a device does not mind, and a file that a shell opened for
                # `>` or `>>` and hands over as /dev/stdout keeps what the shell meant
                self._file = open(self.path, "ab")  # noqa: SIM115 - closed by commit / abort
            except BrokenPipeError:
                raise
            except OSError as exc:
                raise write_error(self.path, exc) from None
            return self._file
        self._target = _target(self.path)
        try:  # a signal anywhere in here (the `with` block has not begun: no __exit__) removes the temp
            fd, self._tmp = atomic_temp(self._target, claim=functools.partial(setattr, self, "_tmp"))
            self._file = os.fdopen(fd, "wb")
        except BaseException:
            self.abort()
            raise
        return self._file

    def commit(self) -> None:
        """Close the file and move it into place."""
        assert self._file is not None
        try:
            self._file.close()
            with commit_point() if self.commits else contextlib.nullcontext():
                if self._tmp is not None:
                    os.replace(self._tmp, self._target)
                    self._tmp = None
        except BrokenPipeError:
            self.abort()
            raise
        except OSError as exc:
            self.abort()
            raise write_error(self.path, exc, nothing_written=not self.stream) from None
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Close the file quietly and remove the temp file: the previous output stays as it was."""
        if self._file is not None:
            try:
                self._file.close()
            except (OSError, ValueError):
                pass
        remove_quietly(self._tmp)
        self._tmp = None

    def __enter__(self) -> IO[bytes]:
        return self.open()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
            return
        self.abort()
        if isinstance(exc, OSError) and not isinstance(exc, BrokenPipeError):
            raise write_error(self.path, exc, nothing_written=not self.stream) from None


def write_text_atomic(path: str, text: str, *, commits: bool = False) -> None:
    """Write `text` to `path` atomically (`OutputFile`: a temp file and `os.replace`, or written
    through to a FIFO or a device). ``commits`` as for `OutputFile`."""
    with OutputFile(path, commits=commits) as fh:
        fh.write(text.encode("utf-8"))


def file_sha256(path: str) -> str:
    """The file's SHA-256, hex (read in 4 MiB pieces)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def list_shard_files(directory: str) -> list[str]:
    """Shard files of a directory (`*.safetensors`, `*.arrow`, `*.parquet`), sorted by name."""
    names = sorted(
        n
        for n in os.listdir(directory)
        if os.path.splitext(n)[1].lower() in SHARD_SUFFIXES and not n.startswith(".")
    )
    return [os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))]
