"""Embeddings from memory: packed and checked as a shard's writer checks them, for `Queries.from_embeddings`
and `Corpus.from_embeddings` alike; `MemoryShard`, the one shard of an in-memory corpus.

An encoder returns a list of ``[len, dim]`` arrays or tensors (PyLate, stanford ColBERT) or a padded
``[n, L, dim]`` tensor with an ``[n, L]`` mask (colpali-engine). `pack_embeddings` packs either into one
``[T, dim]`` tensor with int64 offsets (masked tokens left out exactly), makes the ids strings and checks
ids, lengths, dims and values (NaN/Inf), naming the query or document. A corpus's tensors are packed on
the device they were given on (``keep_device``); queries are packed on the CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from maxsim_cli.errors import InputError, MaxsimError, MaxsimWarning
from maxsim_cli.shards.format import NORM_TOLERANCE, ShardInfo, check_ids, check_values, show_id, torch_dtypes
from maxsim_cli.shards.shard import Shard

if TYPE_CHECKING:
    import torch

    from maxsim_cli.shards.resident import Residency

# What messages call an in-memory corpus (in-memory queries are "queries": `maxsim_cli.queries`).
IN_MEMORY_CORPUS = "corpus"
# Rows checked at a time for unit norms and all-zero rows: bounds the float32 temporary.
CHECK_ROWS = 1 << 16


class Words(NamedTuple):
    """How messages name what is packed: one item, several, and its id."""

    what: str
    plural: str
    id_word: str
    int8_remedy: str  # what to do about int8 values given without scales


QUERY_WORDS = Words("query", "queries", "query id", "pass the float embeddings")
DOCUMENT_WORDS = Words(
    "document", "documents", "id", "pass scales= (one float32 scale a token) or the float embeddings"
)


@dataclass
class Packed:
    """Packed embeddings: item i is ``values[offsets[i]:offsets[i + 1]]``."""

    ids: list[str]
    values: torch.Tensor  # [T, dim]: float16, bfloat16, float32, or int8 with ``scales``
    offsets: torch.Tensor  # int64 [n + 1], on the CPU
    scales: torch.Tensor | None  # float32 [T] beside int8 values, on their device


def as_ids(ids: Any, name: str, words: Words) -> list[str]:
    """Ids as strings (an int 7 is ``"7"``; a numpy array or tensor of ints gives ints); anything else is
    an `InputError`, as is an id that is not valid UTF-8."""
    listed = ids.tolist() if hasattr(ids, "tolist") and not isinstance(ids, (str, bytes)) else ids
    out = []
    for i, key in enumerate(listed):
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (str, int, np.integer)):
            raise InputError(
                f"{name}: {words.id_word} at index {i} is {type(key).__name__}; ids must be str or int"
            )
        out.append(key if isinstance(key, str) else str(int(key)))
    try:
        "".join(out).encode("utf-8")
    except UnicodeEncodeError:
        i, key = next((i, k) for i, k in enumerate(out) if not _encodes(k))
        raise InputError(
            f"{name}: {words.id_word} {show_id(key)} at index {i} is not valid UTF-8 (lone surrogate)"
        ) from None
    return out


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_lengths(ids: list[str], lengths: Sequence[int], name: str, words: Words) -> None:
    """Every item holds at least one token (after its mask)."""
    for i, n in enumerate(lengths):
        if n < 1:
            raise InputError(
                f"{name}: {words.what} {show_id(ids[i])} (index {i}) has no tokens (after its mask); every "
                f"{words.what} needs at least one"
            )


def _listable(value: Any) -> bool:
    """Whether ``value`` is a sequence of per-item arrays (not a string, a scalar or a mapping)."""
    from collections.abc import Iterable, Mapping

    return isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))


def pack_embeddings(
    ids: Any,
    embeddings: Any,
    mask: Any = None,
    *,
    name: str,
    words: Words,
    scales: Any = None,
    keep_device: bool = False,
) -> Packed:
    """``embeddings`` (a list of ``[len, dim]`` arrays/tensors, or a padded ``[n, L, dim]`` one) packed,
    ``mask`` (``[n, L]``, or one ``[len]`` per listed item; True/1 marks a real token) applied exactly,
    int8 ``scales`` (``[n, L]`` or one ``[len]`` per item) packed beside them. float64 and integer values
    become float32; float16, bfloat16 and float32 are kept. ``keep_device``: tensors stay on their device
    (all on one), else everything comes to the CPU. Raises `InputError` naming ``name`` and the item for
    a bad shape, an empty item, a dim mismatch, a bad id, NaN/Inf."""
    import torch

    from maxsim_cli.shards.inputs import as_tensor, mask_rows

    keys = as_ids(ids, name, words)

    def item(i: int) -> str:  # the i-th item, as messages name it
        if i < len(keys):
            return f"{words.what} {show_id(keys[i])} (index {i})"
        return f"{words.what} at index {i}"

    def tensor(x: Any, where: str) -> torch.Tensor:
        return as_tensor(x, where, keep_device=keep_device)

    scale_rows: torch.Tensor | None = None
    if isinstance(embeddings, (torch.Tensor, np.ndarray)) and embeddings.ndim == 3:
        padded = tensor(embeddings, f"{name}: embeddings")
        if padded.shape[0] != len(keys):
            raise InputError(f"{name}: {len(keys)} ids but {padded.shape[0]} padded {words.plural}")
        if mask is None:
            keep = torch.ones(padded.shape[:2], dtype=torch.bool)
        else:
            keep = mask_rows(mask, f"{name}: mask")
            if tuple(keep.shape) != tuple(padded.shape[:2]):
                raise InputError(
                    f"{name}: mask has shape {tuple(keep.shape)}; expected {tuple(padded.shape[:2])} "
                    f"([{words.plural}, tokens]) for embeddings of shape " + str(tuple(padded.shape))
                )
        lengths = keep.sum(dim=1).to(torch.int64)
        check_lengths(keys, lengths.tolist(), name, words)
        keep = keep.to(padded.device)
        packed = padded[keep]
        if scales is not None:
            given = tensor(scales, f"{name}: scales")
            if tuple(given.shape) != tuple(padded.shape[:2]):
                raise InputError(
                    f"{name}: scales have shape {tuple(given.shape)}; expected {tuple(padded.shape[:2])} "
                    f"([{words.plural}, tokens]): one scale a token"
                )
            scale_rows = given.to(padded.device)[keep]
    elif isinstance(embeddings, (torch.Tensor, np.ndarray)):
        raise InputError(
            f"{name}: embeddings of shape {tuple(embeddings.shape)}; pass a list of [tokens, dim] "
            f"arrays, one per {words.what}, or a padded [{words.plural}, tokens, dim] array with a mask"
        )
    else:
        if not _listable(embeddings):
            raise InputError(
                f"{name}: embeddings of type {type(embeddings).__name__}; pass a list of [tokens, dim] "
                f"arrays, one per {words.what}, or a padded [{words.plural}, tokens, dim] array with a mask"
            )
        for what, given in (("mask", mask), ("scales", scales)):
            if given is not None and not _listable(given):
                raise InputError(
                    f"{name}: {what} of type {type(given).__name__}; with a list of embeddings pass a "
                    f"list of {what} arrays, one per {words.what}"
                )
        docs = [tensor(e, f"{name}: {item(i)}") for i, e in enumerate(embeddings)]
        if len(docs) != len(keys):
            raise InputError(f"{name}: {len(keys)} ids but {len(docs)} embedding arrays")
        for i, d in enumerate(docs):
            if d.ndim != 2:
                raise InputError(f"{name}: {item(i)} has shape {tuple(d.shape)}; expected [tokens, dim]")
        parts = None
        if scales is not None:
            parts = [tensor(s, f"{name}: the scales of {item(i)}").reshape(-1) for i, s in enumerate(scales)]
            if len(parts) != len(docs):
                raise InputError(f"{name}: {len(parts)} scale arrays for {len(docs)} {words.plural}")
            for i, (d, s) in enumerate(zip(docs, parts, strict=True)):
                if s.shape[0] != d.shape[0]:
                    raise InputError(
                        f"{name}: the scales of {item(i)} hold {s.shape[0]} values for {d.shape[0]} tokens; "
                        "give one scale a token"
                    )
        if mask is not None:
            masks = [mask_rows(m, f"{name}: the mask of {item(i)}").reshape(-1) for i, m in enumerate(mask)]
            if len(masks) != len(docs):
                raise InputError(f"{name}: {len(masks)} masks for {len(docs)} {words.plural}")
            for i, (d, m) in enumerate(zip(docs, masks, strict=True)):
                if m.shape[0] != d.shape[0]:
                    raise InputError(
                        f"{name}: the mask of {item(i)} has {m.shape[0]} entries for {d.shape[0]} tokens"
                    )
            docs = [d[m.to(d.device)] for d, m in zip(docs, masks, strict=True)]
            if parts is not None:
                parts = [s[m.to(s.device)] for s, m in zip(parts, masks, strict=True)]
        check_lengths(keys, [d.shape[0] for d in docs], name, words)
        if len({d.shape[1] for d in docs}) > 1:
            i = next(i for i, d in enumerate(docs) if d.shape[1] != docs[0].shape[1])
            raise InputError(
                f"{name}: {item(i)} has vectors of {docs[i].shape[1]} values but {words.what} "
                f"{show_id(keys[0])} has {docs[0].shape[1]}; encode all {words.plural} with one model"
            )
        if len({d.device for d in docs}) > 1:
            i = next(i for i, d in enumerate(docs) if d.device != docs[0].device)
            raise InputError(
                f"{name}: {item(i)} is on {docs[i].device} but {words.what} {show_id(keys[0])} on "
                f"{docs[0].device}; put every {words.what} on one device"
            )
        lengths = torch.tensor([d.shape[0] for d in docs], dtype=torch.int64)
        packed = torch.cat([d.to(docs[0].dtype) for d in docs]) if docs else torch.zeros(0, 0)
        if parts is not None:
            scale_rows = torch.cat([s.to(packed.device) for s in parts]) if parts else torch.zeros(0)
    if packed.dtype == torch.int8 and scale_rows is None:
        raise InputError(f"{name}: int8 {words.what} embeddings carry no scales; {words.int8_remedy}")
    if scale_rows is not None and packed.dtype != torch.int8:
        raise InputError(
            f"{name}: scales given with {str(packed.dtype).removeprefix('torch.')} embeddings; scales go "
            "with int8 embeddings only: leave them out"
        )
    if packed.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.int8):
        packed = packed.to(torch.float32)
    packed = packed.contiguous()
    if scale_rows is not None:
        scale_rows = scale_rows.to(torch.float32).contiguous()
    offsets = torch.zeros(len(keys) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths.cpu(), 0)
    check_ids(name, keys, what=words.id_word)
    check_values(name, packed, scale_rows, offsets.numpy(), keys, 0, what=words.what)
    return Packed(keys, packed, offsets, scale_rows)


# ----------------------------------------------------------------------------------------------------
# an in-memory corpus


class MemoryShard(Shard):
    """The shard of an in-memory corpus (`Corpus.from_embeddings`): packed rows on the device they were
    given on. It names no file (``path`` is the corpus's name in messages); reads are slices of its rows,
    copied to the CPU when they live elsewhere (a call that scores on another device than theirs)."""

    def __init__(self, name: str, packed: Packed, *, normalized: bool, encoder: str | None) -> None:
        values = packed.values
        dtype = {v: k for k, v in torch_dtypes().items()}[values.dtype]
        info = ShardInfo(
            name,
            "memory",
            len(packed.ids),
            int(values.shape[0]),
            int(values.shape[1]),
            dtype,
            "int8-per-token" if dtype == "int8" else "none",
            normalized,
            encoder,
        )
        super().__init__(info, packed.ids, packed.offsets.numpy())
        self.values: torch.Tensor | None = values
        self.scales: torch.Tensor | None = packed.scales

    def _rows(self) -> torch.Tensor:
        if self.values is None:
            raise MaxsimError(
                f"{self.path}: this in-memory corpus was closed; make a new one with Corpus.from_embeddings"
            )
        return self.values

    def _read_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        values = self._rows()
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        scales = self.scales[a:b].cpu() if self.scales is not None else None
        return values[a:b].cpu(), scales

    def residency(self) -> Residency:
        """The rows as a corpus resident on their device: nothing copied but the offsets."""
        from maxsim_cli.shards.resident import residency_of

        return residency_of(self._rows(), self.scales, np.asarray(self.offsets, dtype=np.int64))

    def move(self, device: torch.device) -> None:
        """Put the rows on ``device`` (they leave the one they were on). Raises `MaxsimError` (one line:
        how much is needed, how much is free) when they do not fit."""
        import torch

        from maxsim_cli.shards.resident import available_bytes, shard_bytes
        from maxsim_cli.units import format_size

        values = self._rows()
        if values.device == device:
            return
        need, free = shard_bytes(self), available_bytes(device)
        refusal = (
            f"{self.path}: the corpus needs {format_size(need)} on {device} but only {format_size(free)} "
            "is free there; free memory, or use a device with more"
        )
        if need > free:
            raise MaxsimError(refusal)
        try:
            moved = values.to(device)
            scales = self.scales.to(device) if self.scales is not None else None
        except torch.OutOfMemoryError:
            raise MaxsimError(refusal) from None
        self.values, self.scales = moved, scales

    def close(self) -> None:
        """Let the rows go (their memory is freed once nothing else holds them)."""
        self.values = self.scales = None


def memory_shard(
    ids: Any,
    embeddings: Any,
    mask: Any = None,
    *,
    scales: Any = None,
    normalized: bool | None = None,
    encoder: str | None = None,
    name: str = IN_MEMORY_CORPUS,
) -> MemoryShard:
    """The documents of `Corpus.from_embeddings` packed on their device and checked by the rules of a
    shard's writer (`ShardWriter`): ids, lengths, dims, NaN/Inf, ``normalized=True`` asserted, all-zero
    token rows (padding passed without its mask) warned about with a `MaxsimWarning`."""
    if encoder is not None and (not isinstance(encoder, str) or not encoder or "\n" in encoder):
        raise InputError(f"{name}: encoder name must be a non-empty single line")
    packed = pack_embeddings(
        ids, embeddings, mask, name=name, words=DOCUMENT_WORDS, scales=scales, keep_device=True
    )
    if not packed.ids:
        raise InputError(f"{name}: no documents; a corpus needs at least one document to score")
    if packed.values.shape[1] == 0:
        raise InputError(f"{name}: the vectors hold no values (dim 0); pass [tokens, dim] arrays, dim >= 1")
    offsets = packed.offsets.numpy()
    if packed.scales is not None:  # int8: as the writer records it, no norms measured
        unit = bool(normalized)
    else:
        unit = _unit_rows(name, packed.values, offsets, packed.ids, claimed=normalized)
        unit = unit if normalized is None else normalized
    return MemoryShard(name, packed, normalized=unit, encoder=encoder)


def _unit_rows(
    name: str, values: torch.Tensor, offsets: np.ndarray, ids: list[str], *, claimed: bool | None
) -> bool:
    """Whether every row has unit L2 norm (within `NORM_TOLERANCE`); with ``claimed`` True the first row
    that has not is an `InputError`, as the writer refuses it. Counts the documents with an all-zero row
    and warns about them as the writer does. Rows are read in chunks on their device."""
    from maxsim_cli.shards.inputs import zero_row_warning

    unit = True
    zero_rows: list[np.ndarray] = []
    for start in range(0, values.shape[0], CHECK_ROWS):
        chunk = values[start : start + CHECK_ROWS]
        if unit or claimed:
            norms = chunk.float().norm(dim=1)
            off = (norms - 1).abs() > NORM_TOLERANCE
            if bool(off.any()):
                unit = False
                if claimed:
                    row = start + int(off.nonzero()[0, 0])
                    doc = int(np.searchsorted(offsets, row, side="right")) - 1
                    raise InputError(
                        f"{name}: normalized=True but token {row - int(offsets[doc])} of document "
                        f"{show_id(ids[doc])} has L2 norm {float(norms[row - start]):.4g}; normalise the "
                        "vectors or pass normalized=None"
                    )
        zero = ~chunk.ne(0).any(dim=1)
        if bool(zero.any()):
            zero_rows.append(zero.nonzero()[:, 0].cpu().numpy() + start)
    if zero_rows:
        docs = np.unique(np.searchsorted(offsets, np.concatenate(zero_rows), side="right") - 1)
        remedy = "pass mask= (the attention mask) so that padding is left out"
        warnings.warn(
            zero_row_warning(name, len(docs), ids[int(docs[0])], remedy), MaxsimWarning, stacklevel=4
        )
    return unit
