"""The staging memory of a batch stream (`maxsim_cli.scoring.pipeline`): the page-locked arena of a CUDA pass,
locked piece by piece in a background thread, and the slots (one batch's tensors) carved from it; and the
gathering of documents' rows from a corpus resident in host memory into staging memory (`gather_rows`).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from maxsim_cli import tuning


class PinnedArena:
    """Page-locked host memory for `slots` staging slots, allocated by a background thread in pieces.

    Page-locking costs about 0.17 s per GiB on the H200 machine with PyTorch's threaded registration
    (`tuning.use_threaded_host_register`, turned on by a CUDA arena in the command line's process;
    0.4-0.5 s per GiB with its default cudaHostAlloc), once per process (PyTorch's host allocator caches
    the blocks for later runs). The engine starts the arena before it opens the corpus.
    The arena is `slots` equal shares (``nbytes // slots``, aligned down), locked a piece of whole shares
    (about `PIECE_BYTES`) at a time: a reader waits only for the piece its share is in, so the first
    batches are read while later pieces are still being locked, and the arena never holds more than
    ``nbytes``. The engine sizes batches so that a slot fits a share (`slot_share`); a larger request, or
    one past the last share, gets None (the caller allocates a slot of its own).
    """

    ALIGN = 4096
    PIECE_BYTES = 64 << 20  # about 11 ms to lock on the H200 machine (33 ms with cudaHostAlloc)

    def __init__(self, nbytes: int, slots: int, device: torch.device | None = None) -> None:
        self.share = self.slot_share(nbytes, slots)
        self.slots = max(1, slots)
        self.nbytes = self.share * self.slots
        self.device = device
        self._per_piece = max(1, self.PIECE_BYTES // self.share)
        per_piece = self._per_piece
        self._piece_shares = [min(per_piece, self.slots - i) for i in range(0, self.slots, per_piece)]
        self._pieces: list[torch.Tensor] = []
        self._taken = 0  # shares handed out
        self._error: BaseException | None = None
        self._ready = threading.Condition()
        self.started = time.perf_counter()
        self.ready_s: float | None = None  # seconds from start to the last piece locked
        if device is not None and device.type == "cuda" and tuning.in_one_shot_process():
            tuning.use_threaded_host_register()
        self._thread = threading.Thread(target=self._allocate, name="maxsim-pin", daemon=True)
        self._thread.start()

    @classmethod
    def slot_share(cls, nbytes: int, slots: int) -> int:
        """Bytes of one share: ``nbytes // slots`` aligned down (at least one alignment unit)."""
        return max(cls.ALIGN, int(nbytes) // max(1, slots) // cls.ALIGN * cls.ALIGN)

    def _allocate(self) -> None:
        try:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            for shares in self._piece_shares:
                piece = self._lock_piece(shares * self.share)
                with self._ready:
                    self._pieces.append(piece)
                    if len(self._pieces) == len(self._piece_shares):
                        self.ready_s = time.perf_counter() - self.started
                    self._ready.notify_all()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the thread that takes memory
            with self._ready:
                self._error = exc
                self._ready.notify_all()

    def wait(self) -> float:
        """Block until every piece is locked (or locking failed: raised); returns `ready_s`."""
        with self._ready:
            while self.ready_s is None:
                if self._error is not None:
                    raise self._error
                self._ready.wait()
            return self.ready_s

    def _lock_piece(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` bytes (uint8, aligned) at the start of the next share, or None when they do not fit
        a share or every share is taken."""
        if nbytes > self.share:
            return None
        with self._ready:
            if self._taken >= self.slots:
                return None
            piece, index = divmod(self._taken, self._per_piece)  # every piece but the last is full
            self._taken += 1  # the share is ours before we wait: waiting releases the lock to other takers
            while piece >= len(self._pieces):
                if self._error is not None:
                    raise self._error
                self._ready.wait()
            start = index * self.share
            return self._pieces[piece][start : start + nbytes]


class SlotBuffers:
    """One batch's worth of storage: embeddings, scales, and one int64 vector for offsets + side data.

    Pinned slots are allocated lazily, by the reader thread that first fills them: page-locking a few
    GiB takes a noticeable fraction of a second, which then overlaps the other readers' work instead of
    delaying the first batch.
    """

    def __init__(
        self,
        tokens: int,
        docs: int,
        side: int,
        dim: int,
        dtype: torch.dtype,
        scaled: bool,
        device: torch.device | str,
        pin: bool,
        arena: PinnedArena | None = None,
    ) -> None:
        self._shape = (tokens, docs, side, dim, dtype, scaled, device, pin)
        self._arena = arena
        self.embeddings: torch.Tensor
        self.scales: torch.Tensor | None = None
        self.ints: torch.Tensor
        self.allocated = False
        self.copied: torch.cuda.Event | None = None  # end of the last copy out of this (pinned) slot
        self.released: torch.cuda.Event | None = None  # end of the last scoring of this (device) slot
        if torch.device(device).type != "cpu":
            self.allocate()  # device slots: at once (host slots are filled, and allocated, by readers)

    def allocate(self) -> None:
        """Allocate the tensors (once)."""
        if self.allocated:
            return
        tokens, docs, side, dim, dtype, scaled, device, pin = self._shape
        tokens = max(tokens, 1)
        item = torch.empty(0, dtype=dtype).element_size()
        sizes = (tokens * dim * item, tokens * 4 if scaled else 0, (docs + 1 + side) * 8)
        region = self._arena.take(sum(sizes) + 2 * PinnedArena.ALIGN) if self._arena is not None else None
        if region is not None:
            pieces, start = [], 0
            for size in sizes:
                pieces.append(region[start : start + size])
                start = -(-(start + size) // PinnedArena.ALIGN) * PinnedArena.ALIGN
            self.embeddings = pieces[0].view(dtype).view(tokens, dim)
            self.scales = pieces[1].view(torch.float32) if scaled else None
            self.ints = pieces[2].view(torch.int64)
        else:
            self.embeddings = torch.empty((tokens, dim), dtype=dtype, device=device, pin_memory=pin)
            if scaled:
                self.scales = torch.empty(tokens, dtype=torch.float32, device=device, pin_memory=pin)
            self.ints = torch.empty(docs + 1 + side, dtype=torch.int64, device=device, pin_memory=pin)
        self.allocated = True

    @staticmethod
    def nbytes(tokens: int, docs: int, side: int, dim: int, itemsize: int, scaled: bool) -> int:
        return tokens * (dim * itemsize + (4 if scaled else 0)) + (docs + 1 + side) * 8


def gathered_offsets(host_offsets: np.ndarray, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each document's first row in the residency, int64 [n]; the gathered rows' offsets, int64 [n + 1])
    of documents ``docs`` gathered one after another in that order."""
    starts = host_offsets[docs]
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(host_offsets[docs + 1] - starts, out=offsets[1:])
    return starts, offsets


def gather_rows(
    embeddings: torch.Tensor,
    scales: torch.Tensor | None,
    starts: np.ndarray,
    offsets: np.ndarray,
    a: int,
    b: int,
    out_embeddings: torch.Tensor,
    out_scales: torch.Tensor | None,
) -> None:
    """Rows of documents ``a:b`` of a gather (`gathered_offsets`' ``starts`` and ``offsets``) from the host
    ``embeddings`` (and ``scales``) into ``out_embeddings[: rows]`` (and ``out_scales``), one
    `torch.index_select` over the rows: a copy of their bytes on torch's intra-op threads."""
    lengths = torch.from_numpy(offsets[a + 1 : b + 1] - offsets[a:b])
    rows = int(offsets[b] - offsets[a])
    if rows == 0:
        return
    # each gathered row's row in the residency: its document's first row plus its place in the document
    shift = torch.from_numpy(starts[a:b] - offsets[a:b])
    index = torch.repeat_interleave(shift, lengths, output_size=rows)
    index += torch.arange(int(offsets[a]), int(offsets[b]), dtype=torch.int64)
    torch.index_select(embeddings, 0, index, out=out_embeddings[:rows])
    if scales is not None and out_scales is not None:
        torch.index_select(scales, 0, index, out=out_scales[:rows])
