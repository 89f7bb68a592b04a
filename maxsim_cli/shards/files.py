"""Atomic output: a temp file (or working folder) next to the target, on the same filesystem, with the
permissions a plain `open` (or `mkdir`) would give, moved into place with `os.replace`.
"""

from __future__ import annotations

import os
import tempfile

from maxsim_cli.errors import InputError, MaxsimError


def current_umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def staging_dir(parent: str, prefix: str) -> str:
    """A new private working folder in `parent` (same filesystem as the output, so renames are atomic),
    with the mode `mkdir` would give rather than mkdtemp's 0700: it becomes the user's output folder."""
    workdir = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(workdir, 0o777 & ~current_umask())
    return workdir


def _atomic_temp(path: str) -> tuple[int, str]:
    """A temp file next to `path` (same filesystem, so `os.replace` is atomic) with the permissions a
    plain `open(path, "w")` would give, not mkstemp's 0600."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise InputError(f"{path}: directory {directory} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise MaxsimError(f"{path}: cannot write here: {exc.strerror}; check the directory") from None
    os.fchmod(fd, 0o666 & ~current_umask())
    return fd, tmp


def _remove_quietly(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` via a temp file in the same directory and `os.replace`."""
    fd, tmp = _atomic_temp(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
