"""Every process-wide setting the product applies, each with the measurement that decided it.

They change the whole process (Python's switch interval and garbage collector, torch's host threads and
pinned allocator, Triton's cache key), so only the product's own entry points apply them: the ``maxsim``
command line (`maxsim_cli.cli.main`, which also runs ``maxsim serve`` and torchrun's ranks), `serve`
(`maxsim_cli.service.app.serve`, which holds its process until it stops) and the HTTP worker processes
(`maxsim_cli.service.front`). ``cli.main`` marks its process with `one_shot_process`; the library's
own code applies the settings that depend on the run (`pause_until_pass`, `use_threaded_host_register`,
`remember_triton_key`) only in such a process, so a caller of ``maxsim_cli.search`` or ``rerank`` gets
none of them. Two are scoped to a thread the product starts and handed back when it ends: the switch
interval while the kernels' warm-up thread runs (`maxsim_cli.scoring.warmup`) and while rank threads score.

Figures are from the H200 machine unless said otherwise; the stories are in docs/kernel-notes.md.
This module imports nothing heavy: the command line calls it before torch is loaded.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from maxsim_cli import settings

THREAD_SWITCH_S = 0.0005
"""Python's lock handed over every 0.5 ms instead of 5 ms where threads share it (rank threads, serve's
event loop and scoring thread, the warm-up beside the set-up): two GPUs from one host 1.34x one GPU
against 0.90x without it (benchmarks/results/scaling/multigpu-10gb-h200x2-variants.json)."""

THREADED_HOST_REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
"""PyTorch's pinned allocator page-locks by malloc + cudaHostRegister over 8 threads instead of
cudaHostAlloc: 0.49 GiB locked in 0.086-0.091 s against 0.19-0.31 s (benchmarks/results/host/pin-h200.txt)."""

_ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
_threaded_register_done = False
_lock = threading.Lock()
_one_shot = False  # set by the process's entry point (`one_shot_process`)
_paused = False  # the collector is off until `pass_begins`


# --------------------------------------------------------------------------------------------------
# the entry point's mark


def one_shot_process() -> None:
    """The process is the product's own (``maxsim_cli.cli.main``: it runs one command and exits): the
    settings below that depend on a run may be applied."""
    global _one_shot
    _one_shot = True


def in_one_shot_process() -> bool:
    """Whether an entry point marked this process with `one_shot_process` (False in a caller's own)."""
    return _one_shot


# --------------------------------------------------------------------------------------------------
# Python's garbage collector


def pause_until_pass() -> None:
    """A one-shot ``maxsim score``'s start: the collector off until `pass_begins` (or `command_ended`).
    A fresh process holds ~200K objects once torch, triton and pyarrow are imported, and made three full
    collections of 16-29, 36-70 and 68-113 ms before or in its pass (benchmarks/pass_trace.py).
    ``MAXSIM_GC_PAUSE=0`` leaves the collector as Python runs it."""
    global _paused
    if _one_shot and gc.isenabled() and settings.gc_pause():
        with _lock:
            gc.disable()
            _paused = True


def pass_begins() -> None:
    """A pass begins: if the collector was paused for the set-up, what exists is frozen (`gc.freeze`: out
    of the collector's sight) and the collector runs again, so the pass's collections scan only what the
    pass makes. Objects are freed by reference counting meanwhile; the pause keeps only the imports' and
    the set-up's cycles, a one-off amount."""
    global _paused
    with _lock:
        if not _paused:
            return
        _paused = False
        gc.freeze()
        gc.enable()


def command_ended() -> None:
    """The command has ended (`maxsim_cli.cli.main`): the collector on again if no pass began."""
    global _paused
    with _lock:
        if _paused:
            _paused = False
            gc.enable()


def freeze_collector() -> None:
    """A server's start-up objects (the corpus, its id index, the imported modules) out of the collector's
    generations, so its full collections do not walk them while requests wait: with one torch host
    thread, serve's step to 1,072 search queries/s, p99 97.1 ms with 4 workers (docs/history.md)."""
    gc.collect()
    gc.freeze()


# --------------------------------------------------------------------------------------------------
# threads


@contextlib.contextmanager
def quick_thread_switches() -> Iterator[None]:
    """Python's switch interval at most `THREAD_SWITCH_S` inside, handed back after."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, THREAD_SWITCH_S))
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def one_torch_host_thread() -> None:
    """One thread for torch's CPU operations in a server whose corpus is on GPUs: a request's are a few
    small tensors, and the idle pool's threads spun after each one, taking cores from the HTTP workers
    (the scoring process's CPU per search request 5.95 -> 1.06 ms with 4 workers)."""
    import torch

    torch.set_num_threads(1)


# --------------------------------------------------------------------------------------------------
# PyTorch's pinned allocator


def use_threaded_host_register() -> bool:
    """Switch PyTorch's pinned allocator to threaded registration (`THREADED_HOST_REGISTER`) once per
    process; returns whether it is on. A user's own allocator configuration (any of `_ALLOC_CONF_VARS`
    set) is left as it is, as are builds without the setting."""
    import warnings

    import torch

    global _threaded_register_done
    if _threaded_register_done:
        return True
    if any(os.environ.get(name) for name in _ALLOC_CONF_VARS) or torch.version.hip is not None:
        return False
    # PyTorch has no public call for this: the binding its deprecated `_set_allocator_settings` wraps,
    # else that function itself with its FutureWarning silenced (stderr carries only our own lines).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        if setter is not None:
            setter(THREADED_HOST_REGISTER)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                torch.cuda.memory._set_allocator_settings(THREADED_HOST_REGISTER)
    except (AttributeError, RuntimeError):
        return False
    _threaded_register_done = True
    return True


# --------------------------------------------------------------------------------------------------
# Triton's cache key


def remember_triton_key(triton_cache: Any) -> bool:
    """Make Triton's compile-cache key a saved copy instead of a hash of Triton's own files.

    ``triton.runtime.cache.triton_key`` hashes Triton's compiler, backend and language sources and its
    500 MB library, once a process: 0.42-0.82 s, the longest wait before a fresh process's first launch
    (docs/benchmarks.md, "What a fresh process pays once").
    The key only changes when one of those files does, so it is saved, beside Triton's own cache
    (``TRITON_CACHE_DIR``, else ~/.triton/cache), under a fingerprint of every such file's path, size
    and modification time (~5 ms of ``stat``), Triton's version and Python's; a process that finds it
    there hands it out through a function put in place of ``triton_key`` wherever Triton's modules hold
    it. A missing, unreadable or unwritable copy is computed as before. Returns whether the key was
    handed out that way (False: Triton's own function is left as it is)."""
    original = getattr(triton_cache, "triton_key", None)
    if original is None:
        return False
    version = getattr(sys.modules.get("triton"), "__version__", "")
    try:
        fingerprint = _triton_fingerprint(triton_cache, version)
    except OSError:
        return False
    path = os.path.join(_triton_cache_dir(), f"maxsim-triton-key-{fingerprint}")
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read()
    except OSError:
        key = ""
    if not _is_key(key, version):  # absent, or not a key of this Triton: computed and saved
        key = original()
        _save(path, key)
    _hand_out(original, key)
    return True


def _is_key(text: str, version: str) -> bool:
    """Whether ``text`` reads as Triton's key: its version, then sha256 hex digests joined by dashes."""
    import re

    return (
        text.startswith(version)
        and re.fullmatch(r"[0-9a-f]{64}(-[0-9a-f]{64})*", text[len(version) :]) is not None
    )


def _triton_fingerprint(triton_cache: Any, version: str) -> str:
    """A hash of what `triton_key` reads: the path, size and modification time of its own module and of
    every file under Triton's compiler, backends and language folders and its ``_C`` libraries."""
    import hashlib

    root = os.path.dirname(os.path.dirname(os.path.abspath(triton_cache.__file__)))
    digest = hashlib.sha256(f"{version}|{sys.version}".encode())
    paths = [os.path.abspath(triton_cache.__file__)]
    for folder in ("compiler", "backends", "language", "_C"):
        for where, dirs, files in os.walk(os.path.join(root, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")  # bytecode comes and goes
            paths += [os.path.join(where, name) for name in sorted(files)]
    for path in paths:
        st = os.stat(path)
        digest.update(f"{os.path.relpath(path, root)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def _triton_cache_dir() -> str:
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def _save(path: str, key: str) -> None:
    """``key`` written to ``path`` through a temporary file (a reader never sees half of it); nothing
    when the folder cannot be written. A stop signal on the way leaves no temporary file."""
    from maxsim_cli.shards.files import new_file

    made: list[str] = []  # the temporary file, known from the instant it exists (`new_file`'s claim)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, _ = new_file(os.path.dirname(path), ".maxsim-triton-key-", ".tmp", made.append)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(key)
        os.replace(made[0], path)
        made.clear()
    except OSError:
        pass
    finally:
        for tmp in made:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _hand_out(original: Callable[[], str], key: str) -> None:
    """``key`` from every Triton module's ``triton_key`` (those that imported the function by name
    included; modules imported later take it from ``triton.runtime.cache``)."""

    def triton_key() -> str:
        return key

    for name, module in list(sys.modules.items()):
        in_triton = name == "triton" or name.startswith("triton.")
        if in_triton and getattr(module, "triton_key", None) is original:
            module.triton_key = triton_key
