"""Running top-k per query, merged on the device, with a total order that does not depend on batching.

Each (query, document) score becomes one int64 *order key*

    key = (ord32(score) << 32) | rank(docno)

where ``ord32`` maps a float32 to an int32 with the same order (non-negative floats keep their bits;
negative floats have their 31 low bits flipped, which reverses their order), and ``rank(docno)`` is the
document's position among all the corpus's docnos sorted ascending by their UTF-8 bytes (``0 <= rank <
2**32``, unique because docnos are unique; ``-1`` for a deleted document, whose key is `LEFT_OUT`).
Comparing keys as signed integers compares scores first and
docnos second, so "largest key first" is exactly trec_eval's order: score descending, ties broken by docno
descending. Since every key is distinct, the top k keys form one well-defined set, so merging batches in
any order, of any size, over shards in any order, gives the same result: no margin for ties is needed,
and the tie-break happens on the device, where the scores are.

``ord32`` is an involution (applying it twice gives the bits back), so the winning scores are decoded
exactly from the keys; ``-0.0`` is first turned into ``+0.0`` so that the two zeros tie, as they do when
printed. Scores are finite (the shards are checked for NaN/Inf when read).

Memory (bytes, on the scores' device): the state holds at most ``nq * k`` keys (8 B each); a merge of a
``[nq, nd]`` score block allocates ``nq * nd * (4 + 8)`` for the key computation (an int32 temporary and
the int64 keys, next to the caller's float32 scores) plus ``nq * min(k, nd) * 16`` for `torch.topk`'s
values and indices, and ``nq * 2k * 8`` to concatenate with the state. `PAIR_BYTES` and `STATE_BYTES`
bound this for the engine's memory accounting.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Bytes per (query, document) pair while a block is merged: the kernel's float32 score (4), the int32
# temporary (4), the int64 key (8), and `torch.topk`'s int64 values and indices for the block's best
# (counted per pair, an upper bound when k < nd: 16). 32 rounds it up.
PAIR_BYTES = 32
# Bytes per (query, kept result): the state (8), the block's best (8 + 8 indices), the concatenation
# (16 for 2k keys) and the new state with its indices (16): 56 rounded up.
STATE_BYTES = 64

# Keys (all queries') that `RunningTopK.add` leaves to `result` to sort on the host rather than cut to k
# on the device: the blocks' best keys (`block_best_keys`) for one query against 200K documents are 1,568, and
# numpy sorts 2,048 int64 in ~20 us, where `torch.topk` on the device is a launch or more.
HOST_SORTED_KEYS = 2048
_LOW31 = 0x7FFFFFFF
_LOW32 = 0xFFFFFFFF
MAX_RANKS = 1 << 32
# The key of a document left out of the search: deleted (`Corpus.rank_of_ordinal` gives it rank -1) or
# disallowed by a filter (`RunningTopK.add`'s ``hidden``). The smallest int64, which no score's key
# reaches (a NaN, whose key it would be, is read as +inf), and which `RunningTopK.result` drops.
LEFT_OUT = -(1 << 63)


def order_keys(
    scores: torch.Tensor, ranks: torch.Tensor, left_out: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 keys ``(ord32(score) << 32) | rank`` for float32 ``scores [nq, nd]`` and int64 ``ranks``,
    ``[nd]`` (one per document) or ``[nq, nd]`` (one per score). A negative rank (a deleted document)
    gives `LEFT_OUT`. ``left_out``: the columns whose ranks are negative (int64, ``[nd]`` ranks only), when
    the caller knows them: the ranks are then not scanned for them (one pass over ``nd`` per block).

    ``scores`` may be modified in place (``-0.0`` becomes ``+0.0``, NaN becomes ``+inf``); it must be
    contiguous float32. A NaN score (finite embeddings whose products overflow float32 to inf - inf) ranks
    first, like ``+inf``: the run's writer then refuses it, naming the document, where a NaN with its sign
    bit set would rank last and leave the top-k unseen. On CUDA one launch of `maxsim_kernels.order_keys`
    does the same arithmetic.
    """
    if scores.dtype != torch.float32:
        raise TypeError(f"order_keys: scores must be float32, got {scores.dtype}")
    if scores.is_cuda and scores.dim() == 2:  # one launch instead of the nine below
        from maxsim_kernels.order_keys import order_keys_triton

        return order_keys_triton(scores, ranks)
    scores.add_(0.0)  # -0.0 + 0.0 == +0.0 in IEEE arithmetic: the two zeros must tie
    scores.nan_to_num_(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    bits = scores.view(torch.int32)
    key32 = bits >> 31  # -1 for negative floats, 0 otherwise
    key32 &= _LOW31
    key32 ^= bits  # negative floats: flip the 31 low bits, which reverses their order
    keys = key32.to(torch.int64)
    del key32
    keys <<= 32
    ranks = ranks.to(device=keys.device, dtype=torch.int64)
    keys |= ranks
    # a document left out (deleted): below every other key; its columns filled, not a mask of every key
    if ranks.dim() == 1 and keys.dim() == 2:
        if left_out is None:
            left_out = torch.nonzero(ranks < 0).squeeze(1)
        if left_out.numel():
            keys.index_fill_(1, left_out.to(keys.device), LEFT_OUT)
    elif ranks.numel() and int(ranks.min()) < 0:
        keys.masked_fill_((ranks < 0).expand_as(keys), LEFT_OUT)
    return keys


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `order_keys`: ``(float32 scores, int64 ranks)`` with the shape of ``keys``."""
    key32 = (keys >> 32).to(torch.int32)
    bits = key32 ^ ((key32 >> 31) & _LOW31)
    return bits.view(torch.float32), keys & _LOW32


class RunningTopK:
    """The best ``k`` documents of each of ``num_queries`` queries, merged one score block at a time.

    `add` takes a float32 ``[nq, nd]`` block of scores and the docno ranks of its ``nd`` documents and
    keeps, per query, the ``k`` largest order keys seen so far. It only queues device work: there is no
    host synchronisation until `result`.
    """

    def __init__(self, num_queries: int, k: int) -> None:
        if k < 1:
            raise ValueError(f"RunningTopK: k must be >= 1, got {k}")
        self.num_queries = num_queries
        self.k = k
        self._keys: torch.Tensor | None = None

    def add(
        self,
        scores: torch.Tensor,
        ranks: torch.Tensor,
        hidden: torch.Tensor | None = None,
        left_out: torch.Tensor | None = None,
    ) -> None:
        """Merge one block: ``scores`` float32 ``[nq, nd]`` (consumed: modified in place), ``ranks`` [nd].
        ``hidden``: bool ``[nd]`` on the scores' device, True for documents a filter disallows: their keys
        become `LEFT_OUT`, as a deleted document's, so they are kept only while fewer than ``k`` others
        have been seen and `result` drops them (a filtered search's ``k`` is at most the documents it
        allows). ``left_out``: the deleted documents' columns, when the caller knows them (`order_keys`)."""
        if scores.dim() != 2 or scores.shape[0] != self.num_queries:
            raise ValueError(
                f"RunningTopK.add: expected scores [{self.num_queries}, nd], got {tuple(scores.shape)}"
            )
        if scores.shape[1] == 0:
            return
        if self._block_best(scores, ranks):
            from maxsim_kernels.order_keys import block_best_keys

            # each run of documents' best keys, not every key: far fewer keys to keep, and no topk over
            # all of them where they are few enough for `result` to sort (`HOST_SORTED_KEYS`)
            keys = block_best_keys(scores.contiguous(), ranks, self.k, hidden)
            if self._keys is None and keys.numel() <= max(self.k * self.num_queries, HOST_SORTED_KEYS):
                self._keys = keys
                return
        else:
            keys = order_keys(scores, ranks, left_out)
            if hidden is not None:
                keys.masked_fill_(hidden, LEFT_OUT)
        if keys.shape[1] > self.k:
            keys = torch.topk(keys, self.k, dim=1, largest=True, sorted=False).values
        if self._keys is not None:
            # The state is replaced only once the merge has succeeded: an out-of-memory error inside it
            # leaves the state as it was, so the caller can retry the block in halves.
            keys = torch.cat((self._keys, keys), dim=1)
            if keys.shape[1] > self.k:
                keys = torch.topk(keys, self.k, dim=1, largest=True, sorted=False).values
        self._keys = keys

    def _block_best(self, scores: torch.Tensor, ranks: torch.Tensor) -> bool:
        """Whether a block goes through `block_best_keys`: on CUDA, one rank a document, a small k, and
        enough documents that the blocks' best are fewer than the keys."""
        if not scores.is_cuda:  # (the kernels, and Triton with them, are not imported on the CPU path)
            return False
        from maxsim_kernels.order_keys import BEST_BLOCK, BEST_MAX_K

        return (
            ranks.dim() == 1
            and ranks.dtype == torch.int64
            and self.k <= BEST_MAX_K
            and scores.shape[1] > BEST_BLOCK
        )

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores float32 [nq, m], ranks int64 [nq, m])`` on the CPU, best first, ``m = min(k, docs)``."""
        if self._keys is None:
            empty = torch.empty((self.num_queries, 0))
            return empty, empty.to(torch.int64)
        # sorted on the host (the keys are distinct: ascending order reversed is descending): ~4 MB at
        # 512 queries x 1000, where a fresh process's first sort on the GPU cost 41-85 ms of kernel
        # loading (docs/kernel-notes.md, "The pass, traced"); numpy's sort takes ~1 ms per 64K keys on
        # one core, faster than torch's on the CPU path too
        keys = self._keys.cpu().numpy()
        if 4 * self.k < keys.shape[1]:  # the k largest first (one pass), then only those sorted: a
            # search's 1,568 block-best keys at k = 10 in ~11 us against ~25 for the whole sort
            keys = np.partition(keys, keys.shape[1] - self.k, axis=1)[:, keys.shape[1] - self.k :]
        keys = np.sort(keys, axis=1)[:, ::-1].copy()
        # documents left out come last, in every row alike (each row saw the same documents)
        keep = min(self.k, int((keys != LEFT_OUT).sum(axis=1).max(initial=0)))
        scores, ranks = _decode_host_keys(np.ascontiguousarray(keys[:, :keep]))
        return torch.from_numpy(scores), torch.from_numpy(ranks)


def _decode_host_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`decode_keys` of int64 ``keys`` on the host, in numpy: the same bits, without a torch call an
    operation (a search's few keys decode in a few microseconds)."""
    key32 = (keys >> 32).astype(np.int32)
    bits = key32 ^ ((key32 >> 31) & np.int32(_LOW31))
    return bits.view(np.float32), keys & np.int64(_LOW32)
