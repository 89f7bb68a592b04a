"""Python's cyclic garbage collector in a one-shot `maxsim score` process: paused until the pass, then
frozen.

Once torch, triton and pyarrow are imported a process holds some 200K objects that live as long as it
does, and each full collection scans all it holds: a fresh `maxsim score` process made three on the H200
machine's host, of 16-29, 36-70 and 68-113 ms, the last one in the set-up or the pass
(`benchmarks/pass_trace.py`; docs/kernel-notes.md, "The fresh process's pass"). The process's command
(`maxsim_cli.cli.main`, so never a caller's own process) pauses the collector while it imports and sets
up (`maxsim score`: `pause_until_pass`; `main` turns it on again when a command ends before a pass); when
the pass begins, what exists is frozen (`gc.freeze`: moved where the collector never looks
again) and the collector runs again, so the pass's collections scan only what the pass makes. Objects
are still freed by reference counting meanwhile; what the pause keeps is garbage in cycles made by the
imports and the set-up, a one-off amount that does not grow with the corpus. ``MAXSIM_GC_PAUSE=0`` leaves
the collector as Python runs it.
"""

from __future__ import annotations

import gc
import os
import threading

ENV_SWITCH = "MAXSIM_GC_PAUSE"
_lock = threading.Lock()
_one_shot = False  # set by the process's command line (`maxsim_cli.cli.main`)
_paused = False  # the collector is off until `pass_begins`


def one_shot_process() -> None:
    """This process runs one command and exits: `pause_until_pass` may pause the collector."""
    global _one_shot
    _one_shot = True


def pause_until_pass() -> None:
    """A command's start: in a one-shot process, the collector off until `pass_begins` (or
    `command_ended`)."""
    global _paused
    if _one_shot and gc.isenabled() and os.environ.get(ENV_SWITCH, "1") != "0":
        with _lock:
            gc.disable()
            _paused = True


def pass_begins() -> None:
    """A pass begins: if the collector was paused for the set-up, freeze what exists and resume it."""
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
