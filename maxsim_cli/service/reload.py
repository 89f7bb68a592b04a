"""`maxsim serve` follows its corpus: a newer committed generation loaded beside the one served, then
swapped in.

`Reloader.reload` (``POST /reload``; with ``--watch``, a change of a corpus folder's ``index.json``)
opens the latest generation of the folders the served corpus was opened from, checks that it fits
beside the generation served (its bytes against the free memory of each device it is to be resident
on: the generation served holds its own until the swap), makes it resident where the served one is,
builds its id lookup, and only then swaps the batcher's `Scorer` on the event loop. A batch that started
on the old generation finishes on it (`Scorer.in_use`); once the last one ends, the old generation's
device memory and reader locks are let go (`Scorer.retire`), so `maxsim compact` may remove its files.
One reload at a time. A generation that does not fit is refused in one line (logged; ``/reload``
answers 507 with it) and the old one goes on answering; so is one that cannot be opened (409).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from maxsim_cli.errors import MaxsimError
from maxsim_cli.service.batching import Batcher, Scorer
from maxsim_cli.service.schema import RequestError

if TYPE_CHECKING:
    from maxsim_cli.api import Corpus

logger = logging.getLogger("maxsim.serve")

# How often --watch looks at the corpus folders' index.json (seconds).
WATCH_INTERVAL_S = 1.0


def room_for(fresh: Corpus, served: Corpus) -> str | None:
    """None when ``fresh`` fits on the devices ``served`` is resident on, beside it; else the one line
    that says why not. A corpus that streams from its files needs no room."""
    from maxsim_cli.shards.resident import assign_shards, available_bytes, shard_bytes
    from maxsim_cli.units import format_size

    if served.placement is not None:
        devices = [part.device for part in served.placement]
        shares = assign_shards([s.num_tokens for s in fresh.shards], len(devices))
    elif served.residency is not None:
        devices = [served.residency.device]
        shares = [list(range(len(fresh.shards)))]
    else:
        return None
    for device, share in zip(devices, shares, strict=True):
        need = sum(shard_bytes(fresh.shards[i]) for i in share)
        free = available_bytes(device)
        if need > free:
            return (
                f"reload: generation {fresh.generation} needs {format_size(need)} on {device} beside "
                f"generation {served.generation}, but only {format_size(free)} is free there; kept "
                f"generation {served.generation} (free memory, or restart the server on the new one)"
            )
    return None


class Reloader:
    """Reloads of the corpus ``batcher`` serves (module doc). ``owned``: whether the server opened the
    corpus served now (and ``exact_owned`` its exact tier); a corpus it opened is closed once replaced,
    a caller's own is only released from its devices."""

    def __init__(
        self,
        batcher: Batcher,
        *,
        owned: bool = True,
        exact_owned: bool = True,
        on_swap: Callable[[Corpus], None] | None = None,
    ) -> None:
        self.batcher = batcher
        self._on_swap = on_swap  # told of each generation swapped in (the /metrics corpus gauges)
        scorer = batcher.scorer
        # the corpora this server opened (by id): closed when replaced or when the server stops
        self._mine = {id(c) for c, own in ((scorer.corpus, owned), (scorer.exact, exact_owned)) if own and c}
        self._lock = asyncio.Lock()
        self._watching: asyncio.Task | None = None

    @property
    def corpus(self) -> Corpus:
        return self.batcher.scorer.corpus

    async def reload(self) -> dict[str, Any]:
        """Serve the latest generation: ``{"generation", "previous", "changed"}``. Raises `RequestError`
        (409: nothing to reload, or the new generation cannot be opened; 507: it does not fit)."""
        async with self._lock:
            old = self.batcher.scorer
            served = old.corpus
            if not served.folders:
                nothing = "was not opened from a corpus folder; there is nothing to reload"
                raise RequestError(409, f"reload: {served.name} {nothing}")
            loop = asyncio.get_running_loop()
            fresh, fresh_exact = await loop.run_in_executor(None, self._load, old)
            if fresh is None:
                return {"generation": served.generation, "previous": served.generation, "changed": False}
            self.batcher.scorer = Scorer(fresh, device=old.device, counters=old.counters, exact=fresh_exact)
            self._mine.update(id(c) for c in (fresh, fresh_exact) if c is not None)
            old.retire(lambda: self._let_go(old.corpus, old.exact if fresh_exact is not old.exact else None))
            if self._on_swap is not None:
                self._on_swap(fresh)
            logger.info(
                "serving generation %d of %s (%d documents, %d deleted); generation %d is let go after "
                "its last request", fresh.generation, fresh.name, fresh.num_live, fresh.num_deleted,
                served.generation,
            )  # fmt: skip
            return {"generation": fresh.generation, "previous": served.generation, "changed": True}

    def _load(self, old: Scorer) -> tuple[Corpus | None, Corpus | None]:
        """The latest generation (and exact tier), resident where the one served is; (None, None) when
        the one served is the latest. Runs on a thread: the server goes on answering meanwhile."""
        served = old.corpus
        try:
            fresh = served.latest()
        except MaxsimError as exc:
            raise self._refused(409, f"reload: cannot open the new generation: {exc}") from None
        exact = old.exact
        fresh_exact = exact.latest() if exact is not None else None
        if fresh is None and fresh_exact is None:
            return None, None
        try:
            if fresh is None:  # only the exact tier changed: the compressed one is opened again beside
                fresh = served.reopen()
            if fresh_exact is None:
                fresh_exact = exact
            if fresh_exact is not None:
                from maxsim_cli.scoring.two_stage import check_pair

                check_pair(fresh, fresh_exact, fresh.name, fresh_exact.name)
            line = room_for(fresh, served)
            if line is not None:
                raise self._refused(507, line)
            devices = served.device.split(",") if served.device is not None else []
            if devices:
                fresh.to(devices if len(devices) > 1 else devices[0])
            _index_ids(fresh)  # built before the swap, as at the server's start (`app.index_ids`)
            if fresh_exact is not None and fresh_exact is not exact:
                _index_ids(fresh_exact)
        except RequestError:
            _close(fresh, fresh_exact if fresh_exact is not exact else None)
            raise
        except MaxsimError as exc:
            _close(fresh, fresh_exact if fresh_exact is not exact else None)
            status = 507 if "free there" in str(exc) else 409
            raise self._refused(status, f"reload: {exc}; kept generation {served.generation}") from None
        return fresh, fresh_exact

    @staticmethod
    def _refused(status: int, line: str) -> RequestError:
        line = " ".join(line.split())
        logger.warning("%s", line)
        return RequestError(status, line)

    def _let_go(self, corpus: Corpus, exact: Corpus | None) -> None:
        """The replaced generation's last batch has ended: its device memory and reader locks go."""
        for replaced in (corpus, exact):
            if replaced is None:
                continue
            if id(replaced) in self._mine:
                self._mine.discard(id(replaced))
                replaced.close()
            else:
                replaced.release()
        logger.info("generation %d let go", corpus.generation)

    def close(self) -> None:
        """At the server's end: stop watching, close the corpora the server opened."""
        if self._watching is not None:
            self._watching.cancel()
        scorer = self.batcher.scorer
        for corpus in (scorer.corpus, scorer.exact):
            if corpus is not None and id(corpus) in self._mine:
                corpus.close()

    # ----------------------------------------------------------------------------------------------
    # --watch

    def watch(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        """Start looking at the corpus folders' ``index.json`` every ``interval_s`` (on the running
        loop): a change (mtime, inode, size) reloads."""
        self._watching = asyncio.get_running_loop().create_task(self._watch(interval_s))

    async def _watch(self, interval_s: float) -> None:
        seen = self._stamps()
        while True:
            await asyncio.sleep(interval_s)
            now = self._stamps()
            if now == seen:
                continue
            seen = now
            with contextlib.suppress(RequestError):  # refused: logged, the old generation kept
                await self.reload()

    def _stamps(self) -> list[tuple[int, int, int] | None]:
        folders = list(self.corpus.folders)
        exact = self.batcher.scorer.exact
        if exact is not None:
            folders += exact.folders
        stamps: list[tuple[int, int, int] | None] = []
        for folder in folders:
            try:
                st = os.stat(os.path.join(folder, "index.json"))
                stamps.append((st.st_mtime_ns, st.st_ino, st.st_size))
            except OSError:
                stamps.append(None)
        return stamps


def _index_ids(corpus: Corpus) -> None:
    corpus.id_lookup()
    for part in corpus.placement or ():
        part.corpus.id_lookup()


def _close(*corpora: Corpus | None) -> None:
    for corpus in corpora:
        if corpus is not None:
            corpus.close()
