"""Streaming document batches from shards to the scoring device: read, stage, copy, in overlap.

A *plan* names the documents of one batch (ranges or index lists of one or more shards). `BatchStream`
turns a list of plans into batches on the device, in plan order, with three stages overlapping:

1. **Read** - reader threads (a thread pool fed in plan order by one dispatcher thread) fill *staging
   slots*. There are ``reader_threads + 2`` slots, so every reader has one to fill while two filled ones
   wait. Document ranges and a rerank's index lists of safetensors shards are read with `os.preadv`
   straight into the slot (one pass over the bytes, no page faults, no per-shard lock:
   `SafetensorsShard.read_rows_into` / `read_docs_into`, which also turn a shard truncated or rewritten
   during the run into a one-line error); other containers go through `Shard.read_docs` /
   `read_doc_indices` and, on CUDA, are copied into the slot.
   On CUDA the slots are page-locked (carved from one `PinnedArena`); a slot is handed back as soon as its
   copy is *queued*, with the CUDA event that marks the copy's end, and the next reader to take it waits
   on that event before writing (the only host waits are there and on the hand-over queue, both off the
   scoring thread's hot path).
2. **Copy** - the scoring thread queues the host->device copy of a slot on a side CUDA stream into one of
   two device slots (double buffering), after a device-side wait for the scoring of the batch that last
   used that device slot; the scoring stream then waits (on the device) for the copy's event.
3. **Score** - the caller scores the batch on its current stream; asking for the next batch marks the
   device slot free (an event recorded on the scoring stream).

Values are checked for NaN/Inf wherever they are read: `Shard.read_docs` checks its own; a direct read
is checked on the GPU after its copy (one sum per batch, read back once per pass, `_check_values`) or, on the
CPU, by the reader (`_finite`) unless the caller's backend checks them (``check_values=False``: the CPU
backend's ``check_finite``); a failed check re-reads the batch through the shard's checked reader,
whose error names the document and the token.

When the corpus fits the GPU budget the stream is *resident*: the first pass copies each batch into its
own device buffer and later passes (one per query batch) reuse them without reading anything. A corpus
made resident beforehand (`Corpus.to`, ``residency=``) is not read at all: each batch is a view of its
buffer, and a rerank batch names its candidates in it (no rows are copied). A corpus resident in host
memory and scored on CUDA (``host_residency=``) is not read from its files either: the readers gather each
batch's rows from it into the slots (`gather_rows`).

On the CPU there are no streams: safetensors ranges are read into the slots as on CUDA (the reader checks
their values unless the backend does), other batches are the shard's tensors (or packed in a slot); at
most ``reader_threads + 2`` batches are in flight, so reads overlap the scoring. Nothing is read through
a map of a file: the pages of a map count in the process's resident set for as long as it lives (what
`--max-host-memory` bounds, `maxsim_cli.memory`), and a map of a file truncated meanwhile kills the
process with SIGBUS.

Memory (bytes): host: ``(reader_threads + 2) * slot`` plus, for batches read through `Shard.read_docs`,
one unstaged batch per reader (zero for memory-mapped Arrow files), where ``slot`` is the largest batch's
embeddings, scales, offsets and side data. Device: ``2 * slot`` (or every batch when resident); the
scores of a batch are the caller's to count.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from maxsim_kernels.cpu import one_torch_thread

from maxsim_cli.scoring.staging import PinnedArena, SlotBuffers, gather_rows, gathered_offsets
from maxsim_cli.shards.resident import Residency

_STOP = object()  # put in the slot queue to stop the dispatcher


# A part of a plan: docs [start, stop) of shard `shard`, or the docs at `indices` of that shard, in order.
Part = tuple[int, int, int] | tuple[int, np.ndarray]


@dataclass
class BatchPlan:
    """The documents of one batch and int64 side data that travels with them to the device."""

    index: int
    parts: list[Part]
    num_docs: int
    num_tokens: int
    # int64 side data (docno ranks, candidate lists), or a function computing it in the reader thread.
    side: np.ndarray | Callable[[], np.ndarray] | None = None
    side_len: int = 0

    def side_array(self) -> np.ndarray | None:
        return self.side() if callable(self.side) else self.side


@dataclass
class Batch:
    """A batch ready to score on the device (or the CPU): packed documents and their side data."""

    plan: BatchPlan
    embeddings: torch.Tensor  # [T, dim], the shard's dtype
    offsets: torch.Tensor  # int64 [n + 1]
    scales: torch.Tensor | None  # float32 [T] (int8 corpora)
    side: torch.Tensor | None  # int64 [side_len]
    host_offsets: np.ndarray  # int64 [n + 1], the same offsets on the host
    # A rerank batch of a contiguous resident corpus is scored in place: ``embeddings`` / ``offsets`` /
    # ``scales`` are the whole corpus's and ``ordinals`` maps the batch's documents (as its side data
    # numbers them) to documents of it, so that no candidate row is copied.
    ordinals: np.ndarray | None = None


@dataclass
class StreamTimes:
    """Seconds spent per stage: reading (summed over reader threads), copying host->device (device
    time), waiting for a batch (the scoring thread idle), and the number of bytes read."""

    read_s: float = 0.0
    copy_s: float = 0.0
    wait_s: float = 0.0
    bytes_read: int = 0
    batches: int = 0
    _copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list, repr=False)

    def settle(self) -> None:
        """Fold recorded CUDA copy events into `copy_s` (synchronises on them)."""
        for start, end in self._copy_events:
            end.synchronize()
            self.copy_s += start.elapsed_time(end) / 1000.0
        self._copy_events.clear()


@dataclass
class _HostBatch:
    """What a reader returns: packed host tensors (views of a pinned slot on CUDA)."""

    embeddings: torch.Tensor
    offsets: torch.Tensor
    scales: torch.Tensor | None
    side: torch.Tensor | None
    host_offsets: np.ndarray
    slot: SlotBuffers | None
    checked: bool = True  # values checked for NaN/Inf on the host (False: read directly)


def read_parts(shards: Sequence, parts: Sequence[Part]) -> list:
    """Read each part of a plan (`Shard.read_docs` for a range, `read_doc_indices` for an index list)."""
    out = []
    for part in parts:
        shard = shards[part[0]]
        if len(part) == 3:
            out.append(shard.read_docs(int(part[1]), int(part[2])))
        else:
            out.append(shard.read_doc_indices(part[1]))
    return out


class BatchStream:
    """Batches of `plans` on `device`, read by background threads and copied on a side stream.

    Iterate it once per query batch; each iteration yields every plan's `Batch` in plan order. The
    batch yielded last may be used (by work queued on the current stream) until the next one is asked
    for. `start` begins an iteration's reads before it is asked for. Call `close` (or use it as a context
    manager) to stop the threads.
    """

    def __init__(
        self,
        shards: Sequence,
        plans: Sequence[BatchPlan],
        *,
        dim: int,
        dtype: torch.dtype,
        scaled: bool,
        device: torch.device,
        reader_threads: int,
        resident: bool = False,
        arena: PinnedArena | None = None,
        check_values: bool = True,
        residency: Residency | None = None,
        host_residency: Residency | None = None,
    ) -> None:
        self.shards = shards
        self.residency = residency  # the corpus already in the device's memory: nothing to read
        # the corpus resident in host memory (`Corpus.to("cpu")`), scored on CUDA: batches gathered from it
        # into the slots instead of read from its files (the engine passes it on CUDA only; on the CPU a
        # resident corpus is ``residency``)
        self.host_residency = host_residency
        self.check_values = check_values  # CPU: False when the caller's backend checks values itself
        self.arena = arena
        self.plans = list(plans)
        self.dim = dim
        self.dtype = dtype
        self.scaled = scaled
        self.device = device
        self.cuda = device.type == "cuda"
        self.reader_threads = max(1, reader_threads)
        self.resident = resident and self.cuda
        self.times = StreamTimes()
        self._lock = threading.Lock()
        self._resident: list[Batch] | None = None
        self.max_tokens = max((p.num_tokens for p in self.plans), default=0)
        self.max_docs = max((p.num_docs for p in self.plans), default=0)
        self.max_side = max((p.side_len for p in self.plans), default=0)
        self._pool: ThreadPoolExecutor | None = None
        self._dispatcher: threading.Thread | None = None
        self._stop = threading.Event()
        self._device_slots: list[SlotBuffers] = []
        self._pinned: list[SlotBuffers] = []
        self._slots: queue.Queue = queue.Queue()
        self._ready: queue.Queue | None = None  # the next iteration's batches, once `start` has begun it
        # CUDA: safetensors shards are read straight into the pinned slots, their values checked on
        # the GPU: one sum per such batch, written into a device vector (`_check_sums`, one slot a plan)
        # and read back once at the end of the pass.
        self._checks: list[BatchPlan] = []
        self._check_sums: torch.Tensor | None = None
        if self.cuda:
            self._copy_stream = torch.cuda.Stream(device=device)

    # memory --------------------------------------------------------------------------------------

    @staticmethod
    def slot_bytes(
        max_tokens: int, max_docs: int, max_side: int, dim: int, itemsize: int, scaled: bool
    ) -> int:
        """Bytes of one staging slot (pinned or device) for batches up to these sizes."""
        return SlotBuffers.nbytes(max_tokens, max_docs, max_side, dim, itemsize, scaled)

    @staticmethod
    def host_slots(reader_threads: int) -> int:
        """Number of pinned slots (CUDA) or batches in flight (CPU)."""
        return max(1, reader_threads) + 2

    DEVICE_SLOTS = 2

    # reading ------------------------------------------------------------------------------------

    def _read(self, plan: BatchPlan, slot: SlotBuffers | None) -> _HostBatch:
        start = time.perf_counter()
        side = plan.side_array()
        if self.host_residency is not None:
            assert slot is not None
            result = self._gather(plan, slot, side)
            with self._lock:
                self.times.read_s += time.perf_counter() - start
                self.times.bytes_read += result.embeddings.numel() * result.embeddings.element_size()
            return result
        if all(self._direct_rows(p) for p in plan.parts):
            result = self._read_direct(plan, slot, side)
            if not self.cuda and self.check_values and not _finite(result.embeddings, result.scales):
                read_parts(self.shards, plan.parts)  # the shard's checked reader names the document
            with self._lock:
                self.times.read_s += time.perf_counter() - start
                self.times.bytes_read += result.embeddings.numel() * result.embeddings.element_size()
            return result
        parts = read_parts(self.shards, plan.parts)
        if not self.cuda:
            # CPU: use the shard's tensors as they are when there is one part, else pack them.
            if len(parts) == 1:
                emb, off, scales = parts[0].embeddings, parts[0].offsets, parts[0].scales
            else:
                emb = torch.cat([p.embeddings for p in parts])
                off = _concat_offsets([p.offsets for p in parts])
                scales = torch.cat([p.scales for p in parts]) if self.scaled else None
            host_offsets = off.numpy()
            side_t = (
                torch.from_numpy(np.ascontiguousarray(side, dtype=np.int64)) if side is not None else None
            )
            result = _HostBatch(emb, off, scales, side_t, host_offsets, None)
        else:
            slot.allocate()
            if slot.copied is not None:
                slot.copied.synchronize()  # the previous copy out of this slot has finished
            tokens = 0
            docs = 0
            ints = slot.ints.numpy()
            ints[0] = 0
            for part in parts:
                n_tok = part.embeddings.shape[0]
                n_doc = part.offsets.shape[0] - 1
                slot.embeddings[tokens : tokens + n_tok].copy_(part.embeddings)
                if slot.scales is not None:
                    slot.scales[tokens : tokens + n_tok].copy_(part.scales)
                ints[docs + 1 : docs + n_doc + 1] = part.offsets.numpy()[1:] + tokens
                tokens += n_tok
                docs += n_doc
            if side is not None:
                ints[docs + 1 : docs + 1 + len(side)] = side
            host_offsets = ints[: docs + 1].copy()
            result = _HostBatch(
                slot.embeddings[:tokens],
                slot.ints[: docs + 1],
                slot.scales[:tokens] if slot.scales is not None else None,
                slot.ints[docs + 1 : docs + 1 + plan.side_len] if side is not None else None,
                host_offsets,
                slot,
            )
        nbytes = sum(p.embeddings.numel() * p.embeddings.element_size() for p in parts)
        with self._lock:
            self.times.read_s += time.perf_counter() - start
            self.times.bytes_read += nbytes
        return result

    def _direct_rows(self, part: Part) -> bool:
        """Whether the part's shard reads its token rows straight into a caller's buffer (safetensors:
        `read_rows_into` for a range, `read_docs_into` for a rerank's index list)."""
        return hasattr(self.shards[part[0]], "read_rows_into" if len(part) == 3 else "read_docs_into")

    def _read_direct(self, plan: BatchPlan, slot: SlotBuffers, side: np.ndarray | None) -> _HostBatch:
        """Read a plan of document ranges or index lists of safetensors shards straight into a (pinned)
        slot: no copy of the rows but the read, no check of their values on the host (on CUDA the GPU
        checks them after the copy, `_check_values`)."""
        slot.allocate()
        if slot.copied is not None:
            slot.copied.synchronize()  # the previous copy out of this slot has finished
        ints = slot.ints.numpy()
        ints[0] = 0
        tokens = docs = 0
        for part in plan.parts:
            shard = self.shards[part[0]]
            scales = slot.scales[tokens:] if slot.scales is not None else None
            if len(part) == 2:  # a rerank's documents, in the plan's order
                lengths = shard.read_docs_into(part[1], slot.embeddings[tokens:], scales)
                n_doc = len(lengths)
                ints[docs + 1 : docs + n_doc + 1] = np.cumsum(lengths) + tokens
                tokens += int(lengths.sum())
                docs += n_doc
                continue
            _, start, stop = part
            offsets = shard.offsets
            t0, t1 = int(offsets[start]), int(offsets[stop])
            shard.read_rows_into(t0, t1, slot.embeddings[tokens:], scales)
            n_doc = stop - start
            ints[docs + 1 : docs + n_doc + 1] = offsets[start + 1 : stop + 1] - t0 + tokens
            tokens += t1 - t0
            docs += n_doc
        if side is not None:
            ints[docs + 1 : docs + 1 + len(side)] = side
        return _HostBatch(
            slot.embeddings[:tokens],
            slot.ints[: docs + 1],
            slot.scales[:tokens] if slot.scales is not None else None,
            slot.ints[docs + 1 : docs + 1 + plan.side_len] if side is not None else None,
            ints[: docs + 1].copy(),
            slot,
            checked=False,
        )

    def _gather(self, plan: BatchPlan, slot: SlotBuffers, side: np.ndarray | None) -> _HostBatch:
        """A plan's rows gathered from the corpus resident in host memory into a (pinned) slot
        (`gather_rows`, on this reader thread); its values were checked when it was made resident."""
        residency = self.host_residency
        assert residency is not None
        slot.allocate()
        if slot.copied is not None:
            slot.copied.synchronize()  # the previous copy out of this slot has finished
        docs = _ordinals(residency.doc_base, plan.parts)
        starts, offsets = gathered_offsets(residency.host_offsets, docs)
        gather_rows(
            residency.embeddings,
            residency.scales,
            starts,
            offsets,
            0,
            len(docs),
            slot.embeddings,
            slot.scales,
        )
        tokens, n_doc = int(offsets[-1]), len(docs)
        ints = slot.ints.numpy()
        ints[: n_doc + 1] = offsets
        if side is not None:
            ints[n_doc + 1 : n_doc + 1 + len(side)] = side
        return _HostBatch(
            slot.embeddings[:tokens],
            slot.ints[: n_doc + 1],
            slot.scales[:tokens] if slot.scales is not None else None,
            slot.ints[n_doc + 1 : n_doc + 1 + plan.side_len] if side is not None else None,
            offsets,
            slot,
        )

    def _check_values(self) -> None:
        """After a pass: re-read, through the shard's checked reader, every directly read batch whose
        device check saw NaN/Inf (or a negative int8 scale); that raises the shard's one-line error
        naming the document and token. (A float32 sum that overflows on finite values is a false
        alarm: the re-read then passes.)"""
        if not self._checks:
            return
        assert self._check_sums is not None
        # one copy to the host, where numpy tests the sums: the pass's end launches no kernel of its own
        # (a fresh process paid 54-67 ms there for the first uses of torch's stack and isfinite kernels,
        # docs/kernel-notes.md, "The pass, traced")
        sums = self._check_sums[: len(self._checks)].cpu().numpy()
        plans = [plan for plan, ok in zip(self._checks, np.isfinite(sums), strict=True) if not ok]
        self._checks.clear()
        for plan in plans:
            read_parts(self.shards, plan.parts)

    def _dispatch(self, pool: ThreadPoolExecutor, slots: queue.Queue, ready: queue.Queue) -> None:
        """Hand plans to the reader pool in order, each with a free slot (blocks while none is free)."""
        try:
            for plan in self.plans:
                slot = slots.get()
                if slot is _STOP or self._stop.is_set():
                    return
                ready.put((plan, pool.submit(self._read, plan, slot), slot))
        finally:
            ready.put(None)

    # iteration ----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        if self.residency is not None:
            yield from self._from_residency()
            return
        if self._resident is not None:
            yield from self._resident
            return
        kept: list[Batch] = []
        yield from self._stream(kept)
        if self.resident:
            self._resident = kept

    def start(self) -> None:
        """Begin reading the next iteration's batches into the staging slots now, before it is asked
        for: a run calls it once its staging memory is locked, so that the first reads overlap the rest
        of its set-up instead of opening the pass. Iterating begins them when this was not called;
        `close` stops them either way. Nothing to do for a stream that reads nothing (resident)."""
        if self.residency is None and self._resident is None and self._ready is None:
            self._ready = self._begin_reads()

    def _begin_reads(self) -> queue.Queue:
        """Start the dispatcher and the reader pool over a fresh set of free slots; returns the queue
        of read batches, in plan order, ending with None."""
        self._stop.clear()
        slots: queue.Queue = queue.Queue()
        ready: queue.Queue = queue.Queue()
        self._slots = slots
        n_slots = self.host_slots(self.reader_threads)
        if not self._pinned:
            # staging slots: pinned on CUDA; on the CPU plain memory that direct reads reuse (allocated
            # on first use, so corpora read through `Shard.read_docs` never allocate them)
            self._pinned = [self._buffers("cpu", pin=self.cuda) for _ in range(n_slots)]
        if self.cuda and not self.resident and not self._device_slots:
            self._device_slots = [self._buffers(self.device) for _ in range(self.DEVICE_SLOTS)]
        for i in range(n_slots):
            slots.put(self._pinned[i])
        self._pool = ThreadPoolExecutor(
            self.reader_threads,
            thread_name_prefix="maxsim-read",
            initializer=_reader_thread_init,
        )
        self._dispatcher = threading.Thread(
            target=self._dispatch, args=(self._pool, slots, ready), name="maxsim-dispatch", daemon=True
        )
        self._dispatcher.start()
        return ready

    def _stream(self, kept: list[Batch]) -> Iterator[Batch]:
        ready, self._ready = self._ready, None
        if ready is None:
            ready = self._begin_reads()
        slots = self._slots
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        previous: SlotBuffers | None = None  # device slot of the batch yielded last (CUDA)
        previous_token: object | None = None  # its in-flight token (CPU)
        i = 0
        try:
            while True:
                # Asking for the next batch means the previous one's work is queued (CUDA) or done (CPU).
                if previous is not None and compute is not None:
                    previous.released = torch.cuda.Event()
                    previous.released.record(compute)
                    previous = None
                if previous_token is not None:
                    slots.put(previous_token)
                    previous_token = None
                waited = time.perf_counter()
                item = ready.get()
                if item is None:
                    break
                plan, future, token = item
                host: _HostBatch = future.result()  # re-raises a reader's error here
                self.times.wait_s += time.perf_counter() - waited
                if not self.cuda:
                    batch = Batch(
                        plan, host.embeddings, host.offsets, host.scales, host.side, host.host_offsets
                    )
                    previous_token = token
                else:
                    assert compute is not None
                    if self.resident:
                        dev = self._buffers(self.device, plan)
                    else:
                        dev = self._device_slots[i % self.DEVICE_SLOTS]
                    batch = self._copy(plan, host, dev, compute)
                    slots.put(host.slot)  # readers wait for the copy's event before refilling it
                    previous = dev
                    if self.resident:
                        kept.append(batch)
                self.times.batches += 1
                i += 1
                yield batch
            self._check_values()
        finally:
            self.close()

    def _from_residency(self) -> Iterator[Batch]:
        """Batches out of the resident corpus, whose values were checked when it was made resident: an
        exhaustive batch is a view of its buffer; a rerank batch is scored in place (`Batch.ordinals`)."""
        residency = self.residency
        assert residency is not None
        for plan in self.plans:
            side = plan.side_array()
            self.times.batches += 1
            if side is None:
                embeddings, scales, host_offsets, offsets = _resident_rows(residency, plan.parts)
                yield Batch(plan, embeddings, offsets, scales, None, host_offsets)
                continue
            side_t = torch.from_numpy(np.ascontiguousarray(side, dtype=np.int64))
            yield Batch(
                plan, residency.embeddings, residency.offsets, residency.scales,
                side_t.to(residency.device, non_blocking=True), residency.host_offsets,
                _ordinals(residency.doc_base, plan.parts),
            )  # fmt: skip

    def _buffers(
        self, device: torch.device | str, plan: BatchPlan | None = None, pin: bool = False
    ) -> SlotBuffers:
        if plan is None:
            tokens, docs, side = self.max_tokens, self.max_docs, self.max_side
        else:
            tokens, docs, side = plan.num_tokens, plan.num_docs, plan.side_len
        arena = self.arena if pin else None
        return SlotBuffers(tokens, docs, side, self.dim, self.dtype, self.scaled, device, pin, arena)

    def _copy(self, plan: BatchPlan, host: _HostBatch, dev: SlotBuffers, compute: torch.cuda.Stream) -> Batch:
        tokens = host.embeddings.shape[0]
        n_ints = host.host_offsets.shape[0] + plan.side_len
        # A reader that takes this slot next waits for `end` (`slot.copied`). A blocking-sync event puts
        # it to sleep: CUDA's default with one context on many cores is to spin, and with a slot handed
        # back as soon as its copy is queued, several readers could spin at once on the cores that the
        # scoring thread needs (the pass did not measurably change: docs/kernel-notes.md).
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True, blocking=True)
        with torch.cuda.stream(self._copy_stream):
            if dev.released is not None:
                self._copy_stream.wait_event(dev.released)  # scoring of this slot's last batch is done
            start.record(self._copy_stream)
            dev.embeddings[:tokens].copy_(host.embeddings, non_blocking=True)
            if host.scales is not None and dev.scales is not None:
                dev.scales[:tokens].copy_(host.scales, non_blocking=True)
            dev.ints[:n_ints].copy_(host.slot.ints[:n_ints], non_blocking=True)
            end.record(self._copy_stream)
        host.slot.copied = end
        compute.wait_event(end)
        self.times._copy_events.append((start, end))
        n_docs = host.host_offsets.shape[0] - 1
        if not host.checked:
            # one read of the batch at HBM speed, queued on the scoring stream; `_check_values` reads
            # the values back once per pass
            scales = dev.scales[:tokens] if self.scaled and dev.scales is not None else None
            if self._check_sums is None or self._check_sums.shape[0] < len(self.plans):
                self._check_sums = torch.empty(len(self.plans), dtype=torch.float32, device=self.device)
            batch_check(dev.embeddings[:tokens], scales, out=self._check_sums[len(self._checks)])
            self._checks.append(plan)
        return Batch(
            plan,
            dev.embeddings[:tokens],
            dev.ints[: n_docs + 1],
            dev.scales[:tokens] if dev.scales is not None and host.scales is not None else None,
            dev.ints[n_docs + 1 : n_ints] if plan.side_len else None,
            host.host_offsets,
        )

    def close(self) -> None:
        """Stop the dispatcher and the readers (reads not yet started are cancelled)."""
        self._stop.set()
        self._ready = None
        if self._dispatcher is not None:
            self._slots.put(_STOP)  # wakes a dispatcher waiting for a free slot
            if self._dispatcher.ident is not None:  # not when a signal came before its start()
                self._dispatcher.join()
            self._dispatcher = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self.cuda:
            self.times.settle()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Half-precision bit patterns with every exponent bit set are the infinities and NaNs.
_NON_FINITE_BITS = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
# int16 values checked a step: the masked copy stays in cache. 512 KiB steps: 0.159 s per GB of fp16 on one
# core of the 2-core machine, against 0.196-0.212 s for 128 KiB or 2 MiB (docs/kernel-notes.md,
# "`maxsim score`: the host-side constants").
_FINITE_STEP = 1 << 18


# Niceness of the reader threads (Linux): they copy from the page cache on every core, and the scoring
# thread, which issues every batch's work to the GPU, then runs slower: 0.67-0.71 s beside 16 readers,
# 0.47 s at niceness 10, 0.46 s alone (docs/kernel-notes.md, "`maxsim score`: the host-side constants").
READER_NICE = 10  # added to the process's niceness (at most 19)


def _reader_thread_init() -> None:
    one_torch_thread()
    with contextlib.suppress(AttributeError, OSError):  # per-thread priority: Linux only
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + READER_NICE))


def batch_check(
    embeddings: torch.Tensor, scales: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A 0-dim float32 tensor (``out`` when given), on the batch's device, that is finite unless the batch
    has a NaN/Inf value (float embeddings: their float32 sum) or a NaN/Inf or negative scale (int8: the
    sum of the scales' square roots; -0.0 and 0.0 pass). A sum can also overflow on finite values: a false
    alarm, which the re-read in `BatchStream._check_values` clears. One or two launches a batch: less work
    for the thread that issues every batch's work (docs/kernel-notes.md, "`maxsim score`: the host-side
    constants")."""
    if out is None:
        out = torch.empty((), dtype=torch.float32, device=embeddings.device)
    if scales is not None:
        return torch.sum(torch.sqrt(scales).reshape(-1), 0, out=out)
    return torch.sum(embeddings.reshape(-1), 0, dtype=torch.float32, out=out)


def _finite(embeddings: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """No NaN/Inf values (and no negative int8 scale).

    Half precision: the largest sign-cleared bit pattern must be below the all-ones exponent, checked in
    cache-sized steps on the int16 view. float32 (and scales): `torch.aminmax`, which propagates NaN and
    exposes +-Inf in one pass (~4x faster on the CPU than the float32 sum `Shard.read_docs` uses)."""
    if scales is not None:
        if scales.numel() == 0:
            return True
        lo, hi = torch.aminmax(scales)
        return bool(torch.isfinite(lo) & torch.isfinite(hi) & (lo >= 0))
    if embeddings.numel() == 0 or embeddings.dtype == torch.int8:
        return True
    limit = _NON_FINITE_BITS.get(embeddings.dtype)
    if limit is None:
        lo, hi = torch.aminmax(embeddings)
        return bool(torch.isfinite(lo) & torch.isfinite(hi))
    bits = embeddings.reshape(-1).view(torch.int16)
    masked = torch.empty(min(_FINITE_STEP, bits.numel()), dtype=torch.int16)
    for step in bits.split(_FINITE_STEP):
        out = masked[: step.numel()]
        torch.bitwise_and(step, 0x7FFF, out=out)
        if int(out.max()) >= limit:
            return False
    return True


def _resident_rows(
    residency: Residency, parts: Sequence[Part]
) -> tuple[torch.Tensor, torch.Tensor | None, np.ndarray, torch.Tensor]:
    """The rows of ``parts`` (consecutive document ranges, as exhaustive plans cut them, across shards
    too) as one view of the resident corpus's buffer: (embeddings, scales, host offsets [n + 1], the same
    offsets on the device, from the corpus's own: no copy from the host)."""
    base = residency.doc_base
    spans = [(int(base[p[0]] + p[1]), int(base[p[0]] + p[2])) for p in parts if len(p) == 3]
    assert len(spans) == len(parts), parts
    assert all(a[1] == b[0] for a, b in zip(spans[:-1], spans[1:], strict=True)), parts
    g0, g1 = spans[0][0], spans[-1][1]
    t0, t1 = int(residency.host_offsets[g0]), int(residency.host_offsets[g1])
    scales = residency.scales[t0:t1] if residency.scales is not None else None
    return (
        residency.embeddings[t0:t1],
        scales,
        residency.host_offsets[g0 : g1 + 1] - t0,
        residency.offsets[g0 : g1 + 1] - t0,
    )


def _ordinals(doc_base: np.ndarray, parts: Sequence[Part]) -> np.ndarray:
    """The documents of ``parts`` (ranges or index lists of shards) as documents of the whole residency,
    in the parts' order."""
    docs = [
        np.arange(doc_base[p[0]] + p[1], doc_base[p[0]] + p[2])
        if len(p) == 3
        else doc_base[p[0]] + np.asarray(p[1], dtype=np.int64)
        for p in parts
    ]
    return np.concatenate(docs) if len(docs) > 1 else docs[0]


def _concat_offsets(offsets: Sequence[torch.Tensor]) -> torch.Tensor:
    """Join per-part offsets ``[0, ..., T_i]`` into one ``[0, ..., sum T_i]``."""
    out = [offsets[0]]
    base = int(offsets[0][-1])
    for off in offsets[1:]:
        out.append(off[1:] + base)
        base += int(off[-1])
    return torch.cat(out)
